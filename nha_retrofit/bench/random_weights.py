"""Models at a real architecture with random weights, built from its config alone: speed and memory do not depend on
the weights' values, so an architecture can be sized for hardware before any weight is downloaded.

The named configs are the published config.json files (the fields a model is built from), kept here as data:
- `llama3-8b`: meta-llama/Llama-3.1-8B (Llama-3-8B's shapes: 32 layers, 32 query / 8 key-value heads of 128; with
  the llama3 RoPE scaling that gives it 131072 positions);
- `qwen2.5-7b`: Qwen/Qwen2.5-7B (28 layers, 28 / 4 heads of 128, 131072 positions);
- `qwen3-30b-a3b`: Qwen/Qwen3-30B-A3B (48 layers, 32 / 4 heads of 128, 128 experts of which 8 per token, 40960
  positions).
"""

from pathlib import Path

import torch

from ..conversion.converter import nha_config_for
from ..conversion.source import read_source_config_dict
from ..errors import NHARetrofitError
from ..plan import LayerPlan

NAMED_CONFIGS = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    },
}


def random_weights_config(name_or_path: str) -> tuple[str, dict]:
    """(a name for the report, the config.json dict) of a named config or of a config.json file (or its folder)."""
    if name_or_path in NAMED_CONFIGS:
        return name_or_path, dict(NAMED_CONFIGS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir() or path.name == "config.json":
        folder = path if path.is_dir() else path.parent
        if (folder / "config.json").is_file():
            return str(path), read_source_config_dict(folder)
    raise NHARetrofitError(f"unknown --random-weights {name_or_path!r}: use {', '.join(NAMED_CONFIGS)} or the path "
                           "of a config.json (or of the folder holding it)")


def random_nha_model(config: dict, plan: LayerPlan, device, dtype, layers: int | None = None):
    """The NHA model of `config` converted with `plan`, random weights (transformers' own initialisation) made
    directly in `dtype` on `device`, in eval mode. `layers` keeps only the first layers (the plan must have as
    many windows)."""
    if layers is not None:
        config = {**config, "num_hidden_layers": layers}
        if isinstance(config.get("mlp_only_layers"), list):
            config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    model_class, nha_config = nha_config_for(config, plan)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in `dtype`: no float32 copy of the weights exists
    try:
        with torch.device(device), torch.no_grad():
            model = model_class(nha_config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
