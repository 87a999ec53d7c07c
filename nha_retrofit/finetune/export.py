"""Export the finetuned model: LoRA folded in, the same self-contained format as `convert`, written atomically."""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import atomic_folder
from .model import meta_model, select_trainable


def _full_model(run):
    """The trained model as one ordinary module on the CPU of the main process (None on the other processes)."""
    from accelerate.utils import DistributedType

    acc = run.acc
    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        state = acc.get_state_dict(run.model)  # full state dict, gathered on the main process
        if not acc.is_main_process:
            return None
        skeleton = select_trainable(meta_model(run.source), run.recipe.train)
        skeleton.load_state_dict(state, strict=False, assign=True)
        skeleton.tie_weights()
        return skeleton
    return acc.unwrap_model(run.model) if acc.is_main_process else None


def export_merged(run, folder: Path, summary: dict) -> Path | None:
    """Merge LoRA adapters, restore the planned windows, cast back to the original dtype, save with a record."""
    from ..conversion.converter import save_nha_checkpoint

    model = _full_model(run)
    if model is not None:
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model = model.to("cpu")
        dtype = run.source_dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            model = model.to(dtype)
        model.set_windows(list(model.config.nha_windows))
        if run.source.converted and run.source.record:
            record = {k: v for k, v in run.source.record.items() if k != "finetune"}
        else:
            record = {"source": run.source.original, "source_path": str(run.source.original_path),
                      "plan": run.source.plan.as_dict() if run.source.plan else None}
        record["finetune"] = {k: v for k, v in summary.items() if k != "export"}
        record["finetune"]["recipe"] = run.recipe.as_dict()
        with atomic_folder(Path(folder), overwrite=True) as tmp:
            save_nha_checkpoint(model, tmp, tokenizer_source=run.source.folder, record=record)
        run.log(f"exported {folder}")
    run.acc.wait_for_everyone()
    return Path(folder)
