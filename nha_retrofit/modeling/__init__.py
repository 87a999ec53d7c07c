"""NHA models for transformers. The files of this folder are also shipped verbatim inside converted checkpoints
(remote code), so they import only torch, transformers and each other.

Importing this package registers the NHA configs and models with transformers' Auto classes, so that checkpoints
load (and their tokenizers resolve) through nha_retrofit's own code, without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .modeling_nha import NHA_MODEL_CLASSES

for _model in NHA_MODEL_CLASSES.values():
    AutoConfig.register(_model.config_class.model_type, _model.config_class, exist_ok=True)
    AutoModelForCausalLM.register(_model.config_class, _model, exist_ok=True)
