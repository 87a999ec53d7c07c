"""NHA models for transformers. The files of this folder are also shipped verbatim inside converted checkpoints
(remote code), so they import only torch, transformers and each other.

Importing this package registers the NHA models with AutoModelForCausalLM for their configs
(`AutoModelForCausalLM.from_config(NHALlamaConfig(...))`). Their configs are not registered as a model_type: an NHA
config keeps its family's model_type, which stays the original's class without `trust_remote_code`.
"""

from transformers import AutoModelForCausalLM

from .modeling_nha import NHA_MODEL_CLASSES

for _model in NHA_MODEL_CLASSES.values():
    AutoModelForCausalLM.register(_model.config_class, _model, exist_ok=True)
