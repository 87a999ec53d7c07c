"""One evaluation of an NHA checkpoint: the requested tasks, each scored for every compared model (`variants.py`)
on one loaded copy of the weights, collected into one report.

Tasks: `heldout` (perplexity on the built-in held-out texts), `passkey`, `niah` (= `niah_single` and
`niah_multikey`; `retrieval.py`), `suite` (the retrieval suite, or `suite:TASK` for some of its tasks;
`retrieval_suite.py`), `positions` (loss by position; `positions.py`), and any lm-evaluation-harness task
(`harness.py`). Every input is checked before the weights are loaded, so a mistake costs nothing.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field, replace

import torch
import transformers

from ..errors import NHARetrofitError
from ..modeling.decoding import kv_cache_dtype
from ..modeling.load import device_name, load_for_inference, resolve_placement
from .compare import COMPLETION_TOKENS, DEFAULT_TEXTS, check_texts, compare_perplexity, generate_text
from .positions import PositionSpec
from .needles import SUITE_TASKS
from .retrieval import RETRIEVAL_TASKS, RetrievalSpec, check_lengths, check_spec, default_lengths
from .retrieval_suite import SuiteSpec, check_suite_options
from .variants import VARIANTS, Variants, check_variants, load_tokenizer, read_checkpoint_facts

TASK_ALIASES = {"niah": ["niah_single", "niah_multikey"]}
BUILTIN_TASKS = ("heldout", "passkey", "niah", "niah_single", "niah_multikey", "suite", "positions")
SUITE_PREFIX = "suite:"


@dataclass
class HeldoutSpec:
    """Held-out perplexity: the texts, tokens of each scored, tokens per independent chunk."""

    texts: list[str] = field(default_factory=lambda: list(DEFAULT_TEXTS))
    max_tokens: int = 8192
    chunk_len: int = 1024


@dataclass
class TaskPlan:
    """The requested tasks sorted by kind, in the order given."""

    heldout: bool = False
    retrieval: list[str] = field(default_factory=list)
    suite: list[str] = field(default_factory=list)
    positions: bool = False
    harness: list[str] = field(default_factory=list)


def plan_tasks(names) -> TaskPlan:
    plan = TaskPlan()
    if not names:
        raise NHARetrofitError(f"no task given; built in: {', '.join(BUILTIN_TASKS)}, or lm-evaluation-harness tasks")
    for name in names:
        for task in TASK_ALIASES.get(name, [name]):
            if task == "heldout":
                plan.heldout = True
            elif task == "positions":
                plan.positions = True
            elif task in RETRIEVAL_TASKS:
                plan.retrieval += [task] if task not in plan.retrieval else []
            elif task == "suite" or task.startswith(SUITE_PREFIX):
                chosen = SUITE_TASKS if task == "suite" else [task.removeprefix(SUITE_PREFIX)]
                plan.suite += [name for name in chosen if name not in plan.suite]
            else:
                plan.harness += [task] if task not in plan.harness else []
    return plan


def evaluate_checkpoint(folder, tasks=("heldout",), *, variants=VARIANTS, device: str = "auto", dtype: str = "auto",
                        batch_size: int = 1, limit: int | None = None, include_path=None,
                        heldout: HeldoutSpec | None = None, retrieval: RetrievalSpec | None = None,
                        suite: SuiteSpec | None = None, positions: PositionSpec | None = None,
                        allow_beyond_positions: bool = False, prompt: str | None = None, plots: bool = False,
                        progress: bool = False, log=print) -> dict:
    """Score the checkpoint at `folder` on `tasks` for each of `variants`; returns the report (`report.py` formats
    and writes it). `prompt`: also a greedy completion by the NHA model. `plots`: check now that the PNGs can be
    drawn later (matplotlib installed)."""
    from .harness import harness_scores, task_manager
    from .positions import long_sequences, run_positions
    from .retrieval import retrieval_cells, run_retrieval
    from .retrieval_suite import build_suite, run_suite

    heldout, retrieval, positions = heldout or HeldoutSpec(), retrieval or RetrievalSpec(), positions or PositionSpec()
    suite = suite or SuiteSpec()
    plan = plan_tasks(list(tasks))
    variant_names = check_variants(variants)
    resolve_placement(device, dtype)
    if batch_size < 1:
        raise NHARetrofitError(f"--batch-size must be >= 1, got {batch_size}")
    if limit is not None and limit < 1:
        raise NHARetrofitError(f"--limit must be >= 1, got {limit}")
    max_positions, context = read_checkpoint_facts(folder)
    default = default_lengths(context, max_positions, allow_beyond_positions)
    if plan.heldout:
        check_texts(heldout.texts)
        if not 2 <= heldout.chunk_len <= heldout.max_tokens:
            raise NHARetrofitError(f"--chunk-len must be >= 2 and at most --max-tokens ({heldout.max_tokens}), got "
                                   f"{heldout.chunk_len}")
    if plan.retrieval:
        check_spec(retrieval)
        retrieval = replace(retrieval, lengths=check_lengths(retrieval.lengths or default, max_positions,
                                                             allow_beyond_positions))
    if plan.suite:
        suite = replace(suite, lengths=check_lengths(suite.lengths or default, max_positions, allow_beyond_positions))
        check_suite_options(suite.lengths, suite.depths, suite.samples, suite.group, plan.suite)
        if suite.kv_cache is not None:
            kv_cache_dtype(suite.kv_cache)
    if plan.positions:
        check_texts(positions.texts)
        positions = replace(positions, length=check_lengths([positions.length or default[-1]], max_positions,
                                                            allow_beyond_positions, what="position length")[0])
        if positions.sequences < 1:
            raise NHARetrofitError(f"--sequences must be >= 1, got {positions.sequences}")
    manager = task_manager(plan.harness, include_path, BUILTIN_TASKS) if plan.harness else None
    if plots and (plan.retrieval or plan.suite or plan.positions):
        from .plots import require_matplotlib

        require_matplotlib()
    tokenizer = load_tokenizer(folder)
    if prompt:
        check_lengths([len(tokenizer(prompt)["input_ids"]) + COMPLETION_TOKENS], max_positions, allow_beyond_positions,
                      what="length of --prompt and its completion")
    cells = retrieval_cells(tokenizer, plan.retrieval, retrieval) if plan.retrieval else None
    suite_samples = (build_suite(tokenizer, suite.lengths, suite.samples, suite.depths, suite.group, suite.haystack,
                                 suite.seed, plan.suite) if plan.suite else None)
    sequences = (long_sequences(tokenizer, positions.texts, positions.length, positions.sequences)
                 if plan.positions else None)

    model = load_for_inference(folder, device, dtype)
    compared = Variants(model, variant_names)
    report = {
        "checkpoint": str(folder), "device": device_name(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "windows": list(model.config.nha_windows), "max_position_embeddings": max_positions,
        "training_context": context, "variants": variant_names,
    }
    if plan.harness:  # first: its data sets may turn out to be out of reach
        report["harness"] = harness_scores(compared, tokenizer, plan.harness, manager, batch_size=batch_size,
                                           limit=limit)
    if plan.heldout:
        report["heldout"] = compare_perplexity(compared, tokenizer, heldout.texts, max_tokens=heldout.max_tokens,
                                               chunk_len=heldout.chunk_len, batch_size=batch_size, log=log)
    if plan.retrieval:
        report["retrieval"] = run_retrieval(compared, cells, retrieval, batch_size=batch_size, progress=progress)
    if plan.suite:
        report["suite"] = run_suite(compared, suite_samples, batch_size=batch_size, progress=progress,
                                    kv_cache=suite.kv_cache)
    if plan.positions:
        report["positions"] = run_positions(compared, sequences, positions, batch_size=batch_size, progress=progress)
    if prompt:
        report["completion"] = {"prompt": prompt, "text": generate_text(model, tokenizer, prompt)}
    return report
