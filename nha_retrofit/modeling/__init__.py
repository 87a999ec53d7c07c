"""NHA models for transformers. The files of this folder are also shipped verbatim inside converted checkpoints
(remote code), so they import only torch, transformers and each other.

Importing this package registers the NHA configs and models with transformers' Auto classes, so that checkpoints
load (and their tokenizers resolve) through nha_retrofit's own code, without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_nha import NHALlamaConfig
from .modeling_nha import NHALlamaForCausalLM

for _config, _model in ((NHALlamaConfig, NHALlamaForCausalLM),):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)
