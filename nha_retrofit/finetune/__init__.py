"""Finetuning of NHA hybrids from a YAML recipe: attention transfer, then language modelling with optional
self-distillation; accelerate for devices and processes, peft for LoRA, resumable, exporting a merged checkpoint."""

from .recipe import Recipe, load_recipe

__all__ = ["Recipe", "finetune", "load_recipe"]


def __getattr__(name):
    """`finetune` is imported on first use: a recipe is checked without importing torch."""
    if name == "finetune":
        from .trainer import finetune

        globals()["finetune"] = finetune
        return finetune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
