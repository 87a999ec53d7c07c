"""What `nha-retrofit bench` runs: `engine.run_benchmark` on an NHA checkpoint, or on a model built from a config alone
with random weights (`random_weights.py`)."""

import dataclasses
from pathlib import Path

from ..errors import NHARetrofitError
from ..modeling.load import load_for_inference, nha_checkpoint_class, resolve_placement
from ..plan import PlanSpec, build_plan, cache_dims
from .engine import run_benchmark
from .options import check_options


def benchmark_checkpoint(folder, contexts=(512, 2048), *, device: str = "auto", dtype: str = "auto", **options) -> dict:
    """`run_benchmark` on the NHA checkpoint at `folder` (context tokens from its tokenizer when it has one)."""
    resolve_placement(device, dtype)
    model_class = nha_checkpoint_class(Path(folder))
    check_options(model_class.config_class.from_pretrained(folder).max_position_embeddings, contexts, **options)
    model = load_for_inference(folder, device, dtype)
    report = run_benchmark(model, contexts=contexts, token_source=Path(folder), **options)
    return {"model": {"name": Path(folder).name, "checkpoint": str(folder)}, **report}


def benchmark_random_weights(name_or_path: str, spec: PlanSpec, *, layers: int | None = None,
                             contexts=(512, 2048), device: str = "auto", dtype: str = "auto", **options) -> dict:
    """`run_benchmark` on a model built from a config alone (a named one or a config.json, `random_weights.py`),
    converted with the plan `spec` asks for, random weights in `dtype`."""
    from .random_weights import random_nha_model, random_weights_config

    name, config = random_weights_config(name_or_path)
    if layers is not None and not 1 <= layers <= config["num_hidden_layers"]:
        raise NHARetrofitError(f"--layers {layers}: the model has 1..{config['num_hidden_layers']} layers")
    num_layers = layers or config["num_hidden_layers"]
    if spec.select == "retrieval":  # random weights hold no retrieval heads to rank; the cost of a plan depends on
        spec = dataclasses.replace(spec, select="even")  # how many layers and heads are full, not on which
    plan = build_plan(num_layers, spec, kv_heads=cache_dims(config)[0])
    check_options(config.get("max_position_embeddings") or 2048, contexts, **options)
    target, weights_dtype = resolve_placement(device, dtype)
    model = random_nha_model(config, plan, target, weights_dtype, layers=layers)
    report = run_benchmark(model, contexts=contexts, **options)
    experts = getattr(model.config, "_experts_implementation", None) if hasattr(model.config, "num_experts") else None
    info = {"name": name, "random_weights": True, "layers": num_layers, "layers_of_config": config["num_hidden_layers"],
            "plan": plan.as_dict(), "plan_description": plan.describe(), "config": config}
    if experts:
        info["experts_implementation"] = experts
    return {"model": info, **report}
