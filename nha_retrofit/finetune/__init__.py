"""Finetuning of NHA hybrids from a YAML recipe: attention transfer, then language modelling with optional
self-distillation; accelerate for devices and processes, peft for LoRA, resumable, exporting a merged checkpoint."""

from .recipe import Recipe, load_recipe
from .trainer import finetune

__all__ = ["Recipe", "finetune", "load_recipe"]
