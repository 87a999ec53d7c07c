"""lm-evaluation-harness scores of the compared models, through lm-eval's own Hugging Face model class (`HFLM`)
wrapped around the loaded model objects, so every model is scored on the same weights in one process.

lm-eval is an optional extra (`pip install 'nha-retrofit[eval]'`). Task names are lm-eval's (`lm-eval ls tasks`),
or those of YAML tasks in a local folder (`include_path`). Standard errors are not computed: lm-eval's bootstrap
forks worker processes of a process that holds the model; the number of examples scored is reported instead.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from pathlib import Path

from ..errors import NHARetrofitError

EVAL_EXTRA = "pip install 'nha-retrofit[eval]'"


def require_lm_eval(names, builtin=()) -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise NHARetrofitError(f"task {names[0]!r} is not built in ({', '.join(builtin)}); lm-evaluation-harness "
                               f"tasks need lm-eval: {EVAL_EXTRA}") from None


@functools.cache
def _task_manager(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager(names, include_path=None, builtin=()):
    """lm-eval's TaskManager that knows every name in `names`; one error line for a name it does not know.
    lm-eval's own index (thousands of YAML files, seconds to read) is read only when the local folder does not hold
    every task; it is read once per process."""
    require_lm_eval(names, builtin)
    if include_path is not None:
        include_path = Path(include_path)
        if not include_path.is_dir():
            raise NHARetrofitError(f"--include-path {include_path} is not a folder of lm-eval task YAML files")
        local = _task_manager(str(include_path), False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = _task_manager(None if include_path is None else str(include_path), True)
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, [*builtin, *manager.all_tasks], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise NHARetrofitError(f"unknown task {name!r}{hint}: neither built in ({', '.join(builtin)}) nor an "
                                   "lm-evaluation-harness task (`lm-eval ls tasks` lists them; --include-path adds a "
                                   "folder of task YAML files)")
    return manager


@contextlib.contextmanager
def quiet_logs():
    """Keep lm-eval's log (its warnings about being handed a model object are expected here) and huggingface_hub's
    (a retry line per attempt to reach an unreachable Hub) to errors: a failure is reported as one line."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def metric_values(task_results: dict) -> dict:
    """{metric: value} from one task's lm-eval results ({"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...});
    a metric under a filter other than `none` keeps the filter in its name."""
    values = {}
    for key, value in task_results.items():
        metric, comma, filter_name = key.partition(",")
        if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):  # alias, sample_len, ...
            continue
        values[metric if filter_name in ("", "none") else key] = value
    return values


def harness_scores(variants, tokenizer, names, manager, *, batch_size: int = 1, limit: int | None = None) -> dict:
    """Scores of every variant on every task: {task: {"examples": n, "metrics": {metric: {variant: value}}}}."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    scores = {}
    for variant in variants.names:
        with variants.use(variant) as model, quiet_logs():
            wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
            try:
                output = lm_eval.simple_evaluate(model=wrapped, tasks=list(names), limit=limit, task_manager=manager,
                                                 bootstrap_iters=0, log_samples=False)
            except OSError as error:  # ConnectionError, a data set missing from the cache or the disk
                raise NHARetrofitError(f"lm-evaluation-harness could not load the data of {', '.join(names)}: "
                                       f"{str(error).splitlines()[0]}. Hub data sets need the Hub or a copy in the "
                                       "Hugging Face cache (HF_DATASETS_CACHE)") from None
        for task, results in output["results"].items():
            entry = scores.setdefault(task, {"examples": None, "metrics": {}})
            samples = output.get("n-samples", {}).get(task, {})
            entry["examples"] = samples.get("effective", entry["examples"])
            for metric, value in metric_values(results).items():
                entry["metrics"].setdefault(metric, {})[variant] = value
    return scores
