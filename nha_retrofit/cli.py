"""The `nha-retrofit` command line: thin verbs over the package's functions.

User mistakes (NHARetrofitError) print one line and exit 1; anything else is a bug and keeps its traceback.
"""

import functools
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from .errors import NHARetrofitError
from .plan import FULL_LAYER_SHARE, PlanSpec, parse_windows

click_errors = sys.modules[typer.BadParameter.__module__]  # click's exceptions (newer typer vendors click)


class OneLineErrors(TyperGroup):
    """Parse errors (a bad number, an unknown option or verb) follow the same contract as every other user mistake:
    one `error:` line on stderr, exit 1; click's own suggestions ("Did you mean ...?") stay in the line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as help_page:
            help_page.show()
            sys.exit(0)
        except click_errors.ClickException as error:
            message = " ".join(error.format_message().split())
            typer.secho(f"error: {message[:1].lower()}{message[1:]}", fg=typer.colors.RED, err=True)
            sys.exit(1)
        except typer.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def print_version(value: bool):
    if value:
        from importlib.metadata import version

        typer.echo(f"nha-retrofit {version('nha-retrofit')}")
        raise typer.Exit()


# Plain click help (no rich panels): it wraps long option names and help instead of cutting them, at the terminal's
# width up to 120 columns.
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0], cls=OneLineErrors,
                  rich_markup_mode=None, context_settings={"max_content_width": 120})


@app.callback()
def options(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=print_version, help="Print the version and exit.")] = False,
):
    pass


def user_errors(command):
    """Turn NHARetrofitError into `error: <message>` on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except NHARetrofitError as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return wrapper


def parse_ints(text: str, option: str, expected: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated {expected}", param_hint=option) from None


def parse_names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_layer_ids(text: str | None) -> list[int] | None:
    return None if text is None else parse_ints(text, "--full-layer-ids", "layer numbers such as 3,11,19,27")


def parse_head_ids(text: str | None) -> list[tuple[int, int]] | None:
    """`7:0,14:2` -> [(7, 0), (14, 2)]."""
    if text is None:
        return None
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        layer, _, head = part.partition(":")
        if not (layer.strip().isdigit() and head.strip().isdigit()):
            raise typer.BadParameter(f"{part!r}: expected layer:head pairs such as 7:0,14:2",
                                     param_hint="--full-kv-head-ids")
        pairs.append((int(layer), int(head)))
    return pairs


def write_json(path: Path | None, report: dict) -> None:
    """`--json FILE`: the command's measurements, written atomically (nothing when no path was given)."""
    import json

    from .atomic import atomic_file

    if path is not None:
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")


ModelArgument = Annotated[str, typer.Argument(help="Local folder, Hub id (downloaded if missing), or 'smollm2-135m'.")]
RevisionOption = Annotated[str | None, typer.Option(help="Branch, tag or commit of a Hub id (default: main).")]
TokenOption = Annotated[str | None, typer.Option(help="Hub token (default: HF_TOKEN or `hf auth login`).")]


def plan_option(kind: type, text: str, field: str):
    """A plan option: left out, it is None and the plan takes PlanSpec's default for `field` (shown in --help)."""
    default = getattr(PlanSpec, field)
    shown = str(default) if default is not None else f"the cache of one layer in {FULL_LAYER_SHARE}"
    return Annotated[kind | None, typer.Option(help=text, show_default=shown)]


FullLayersOption = plan_option(int, "Layers that keep full attention. With no full layers or KV heads named, the cache "
                               "of one layer in six stays full: as the probe's strongest KV heads with --select "
                               "retrieval, else (or when the probe cannot run) as whole layers.", "full_layers")
FullLayerIdsOption = Annotated[str | None, typer.Option(help="Exactly these full layers, e.g. 2,9,17,25.")]
FullKVHeadsOption = Annotated[int | None, typer.Option(
    help="KV heads that keep full attention inside NHA layers, placed by --select (retrieval: the probe's strongest "
         "heads); makes --full-layers default to 0.")]
FullKVHeadIdsOption = Annotated[str | None, typer.Option(help="Exactly these full KV heads, as layer:head, e.g. 7:0,14:2.")]
SelectOption = plan_option(str, "Where --full-layers go: retrieval (the layers whose heads retrieve most, from a "
                           "probe of the original), even, first or last.", "select")
WindowsOption = Annotated[str | None, typer.Option(help="One window per layer, e.g. 32,32,full,... (overrides).")]
WindowOption = plan_option(int, "Sliding window of the NHA layers.", "window")
SlotsOption = plan_option(int, "Slots of the NHA memory per KV head.", "slots")
GateNormalizerOption = plan_option(float, "tau in log(alpha) = logsigmoid(g) / tau.", "gate_normalizer")
SlotBiasOption = plan_option(float, "Initial per-head slot-logit offset (0 = the paper).", "slot_bias_init")
GateBiasOption = plan_option(float, "Initial gate-logit bias of every slot: b > 0 lengthens the slots' memory, "
                             "alpha = sigmoid(g + b) ** (1 / tau); 0 is the paper's gates.", "gate_bias_init")
DeviceOption = Annotated[str, typer.Option(help="auto (CUDA if present), cpu or cuda[:N].")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Also write the results to this file.")]


def plan_spec(full_layers=None, full_layer_ids=None, select=None, windows=None, window=None, slots=None,
              gate_normalizer=None, slot_bias_init=None, gate_bias_init=None, full_kv_heads=None,
              full_kv_head_ids=None) -> PlanSpec:
    """The PlanSpec of a verb's plan options; those left out (None) keep PlanSpec's defaults."""
    if full_layers is not None and full_layer_ids is not None:
        raise NHARetrofitError("--full-layers and --full-layer-ids: give one of the two")
    if full_kv_heads is not None and full_kv_head_ids is not None:
        raise NHARetrofitError("--full-kv-heads and --full-kv-head-ids: give one of the two")
    given = dict(full_layers=full_layers, full_layer_ids=parse_layer_ids(full_layer_ids), select=select,
                 windows=None if windows is None else parse_windows(windows), window=window, slots=slots,
                 gate_normalizer=gate_normalizer, slot_bias_init=slot_bias_init, gate_bias_init=gate_bias_init,
                 full_kv_heads=full_kv_heads, full_kv_head_ids=parse_head_ids(full_kv_head_ids))
    return PlanSpec(**{field: value for field, value in given.items() if value is not None})


@app.command()
@user_errors
def convert(
    model: ModelArgument,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the NHA checkpoint to.")],
    full_layers: FullLayersOption = None,
    full_layer_ids: FullLayerIdsOption = None,
    full_kv_heads: FullKVHeadsOption = None,
    full_kv_head_ids: FullKVHeadIdsOption = None,
    select: SelectOption = None,
    windows: WindowsOption = None,
    window: WindowOption = None,
    slots: SlotsOption = None,
    gate_normalizer: GateNormalizerOption = None,
    slot_bias_init: SlotBiasOption = None,
    gate_bias_init: GateBiasOption = None,
    gate_init: Annotated[str, typer.Option(help="from_k (copy k_proj, the paper) or random.")] = "from_k",
    allow_pickle: Annotated[bool, typer.Option(help="Accept .bin/.pt weights (loaded with weights_only).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    revision: RevisionOption = None,
    token: TokenOption = None,
):
    """Convert a pretrained Llama, Qwen2.5 or Qwen3-MoE model into an NHA hybrid checkpoint (shard by shard)."""
    from .atomic import check_output_folder

    check_output_folder(output, overwrite)  # like the plan's checks, before torch is imported
    spec = plan_spec(full_layers, full_layer_ids, select, windows, window, slots, gate_normalizer, slot_bias_init,
                     gate_bias_init, full_kv_heads, full_kv_head_ids)
    from .conversion.converter import convert as run_convert

    run_convert(model, output, spec, gate_init=gate_init, allow_pickle=allow_pickle, overwrite=overwrite,
                revision=revision, token=token)


@app.command()
@user_errors
def plan(
    model: ModelArgument,
    full_layers: FullLayersOption = None,
    full_layer_ids: FullLayerIdsOption = None,
    full_kv_heads: FullKVHeadsOption = None,
    full_kv_head_ids: FullKVHeadIdsOption = None,
    select: SelectOption = None,
    windows: WindowsOption = None,
    window: WindowOption = None,
    slots: SlotsOption = None,
    gate_normalizer: GateNormalizerOption = None,
    slot_bias_init: SlotBiasOption = None,
    gate_bias_init: GateBiasOption = None,
    revision: RevisionOption = None,
    token: TokenOption = None,
):
    """Print the layer plan (per layer: window, slots, new parameters, cache bytes) without converting."""
    spec = plan_spec(full_layers, full_layer_ids, select, windows, window, slots, gate_normalizer, slot_bias_init,
                     gate_bias_init, full_kv_heads, full_kv_head_ids)
    from .conversion.resolve import resolve_model
    from .conversion.source import read_source_config_dict
    from .plan import plan_table

    config = read_source_config_dict(resolve_model(model, revision=revision, token=token, weights=False))
    ranking, heads = None, None
    if spec.needs_ranking:  # the retrieval probe reads the weights (downloaded for a Hub id)
        from .conversion.layer_ranking import plan_ranking

        ranking, heads, _ = plan_ranking(resolve_model(model, revision=revision, token=token), spec,
                                         config["num_hidden_layers"], log=lambda line: typer.echo(line, err=True))
    typer.echo(plan_table(config, spec, ranking, heads))


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: Annotated[Path, typer.Argument(help="An NHA checkpoint folder (converted or exported).")],
    tasks: Annotated[str, typer.Option(
        help="Comma-separated: heldout, passkey, niah, suite (or suite:TASK), positions, lm-eval tasks.")] = "heldout",
    variants: Annotated[str, typer.Option(help="Compared models: original, nha, nha_all_full, window_only.")] = (
        "original,nha,nha_all_full,window_only"
    ),
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")] = (
        "auto"
    ),
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 1,
    limit: Annotated[int | None, typer.Option(help="lm-eval tasks: score the first N examples of each.")] = None,
    include_path: Annotated[Path | None, typer.Option(help="A folder of lm-eval task YAML files.")] = None,
    texts: Annotated[str, typer.Option(help="heldout, positions: comma-separated held-out texts.")] = (
        "python-stdlib,python-docs,shakespeare"
    ),
    max_tokens: Annotated[int, typer.Option(help="heldout: tokens of each text to score.")] = 8192,
    chunk_len: Annotated[int, typer.Option(help="heldout: tokens per independent chunk.")] = 1024,
    lengths: Annotated[str | None, typer.Option(
        help="passkey/niah/suite: lengths in tokens (default 1K..4x training).")] = None,
    depths: Annotated[str, typer.Option(help="passkey/niah/suite: needle depths in percent.")] = "0,25,50,75,100",
    samples: Annotated[int | None, typer.Option(
        help="passkey/niah/suite: samples per length and depth (default 10; suite 20).")] = None,
    haystack: Annotated[str | None, typer.Option(
        help="passkey/niah/suite: a held-out text or a text file of your own as the haystack (default python-docs; "
             "suite: each group's own).")] = None,
    group: Annotated[str, typer.Option(help="suite: tuning, heldout or all.")] = "all",
    kv_cache_dtype: Annotated[str | None, typer.Option(
        help="suite: the NHA models read each answer from a static cache whose full layers store keys and values in "
             "this dtype (auto: the model's; float8_e4m3) instead of one forward pass.")] = None,
    seed: Annotated[int, typer.Option(help="passkey/niah/suite: seed of the samples.")] = 0,
    position_length: Annotated[int | None, typer.Option(help="positions: tokens per sequence.")] = None,
    sequences: Annotated[int, typer.Option(help="positions: sequences of held-out text.")] = 8,
    allow_beyond_positions: Annotated[bool, typer.Option(help="Allow lengths past max_position_embeddings.")] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Folder for the JSON, tables and PNGs.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing --output folder.")] = False,
    json_output: JsonOption = None,
    prompt: Annotated[str, typer.Option(help="heldout: prompt of a short greedy completion ('' to skip).")] = (
        "The three most important rules of writing readable Python code are"
    ),
):
    """Score the original, the NHA model, it with all windows full, and it window-only, side by side on one copy of
    the weights: held-out perplexity, lm-evaluation-harness tasks, passkey and needle retrieval, the retrieval suite,
    loss by position."""
    from .atomic import check_output_folder
    from .eval.evaluate import HeldoutSpec, evaluate_checkpoint
    from .eval.positions import PositionSpec
    from .eval.report import format_report, record_in_checkpoint, write_outputs
    from .eval.retrieval import RetrievalSpec
    from .eval.retrieval_suite import SuiteSpec

    if output is not None:
        check_output_folder(output, overwrite)
    task_names = parse_names(tasks)
    chosen_lengths = parse_ints(lengths, "--lengths", "lengths such as 1024,4096") if lengths else None
    chosen_depths = parse_ints(depths, "--depths", "depths in percent such as 0,50,100")
    given = {key: value for key, value in dict(samples=samples, haystack=haystack, seed=seed).items()
             if value is not None}  # the others: each kind's own default
    report = evaluate_checkpoint(
        checkpoint, task_names, variants=parse_names(variants), device=device, dtype=dtype, batch_size=batch_size,
        limit=limit, include_path=include_path,
        heldout=HeldoutSpec(parse_names(texts), max_tokens, chunk_len),
        retrieval=RetrievalSpec(chosen_lengths, chosen_depths, **given),
        suite=SuiteSpec(chosen_lengths, chosen_depths, group=group, kv_cache=kv_cache_dtype, **given),
        positions=PositionSpec(position_length, sequences, parse_names(texts)),
        allow_beyond_positions=allow_beyond_positions,
        prompt=prompt if "heldout" in task_names else None, plots=output is not None, progress=True,
    )
    typer.echo("\n" + format_report(report))
    if "completion" in report:
        typer.echo(f"{prompt}{report['completion']['text']}")
    write_outputs(report, output, json_output, overwrite)
    try:
        record_in_checkpoint(checkpoint, report)
    except NHARetrofitError as error:
        typer.secho(f"note: the evaluation was not recorded in the checkpoint: {error}", err=True)


@app.command()
@user_errors
def bench(
    checkpoint: Annotated[Path | None, typer.Argument(help="An NHA checkpoint folder (converted or exported).")] = None,
    random_weights: Annotated[str | None, typer.Option(
        help="Instead of a checkpoint: an architecture from its config alone, random weights (llama3-8b, qwen2.5-7b, "
             "qwen3-30b-a3b or a config.json).")] = None,
    contexts: Annotated[str, typer.Option(help="Comma-separated prompt lengths in tokens.")] = "512,2048",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes for decode throughput.")] = "",
    batch_contexts: Annotated[str | None, typer.Option(help="Contexts of the batch runs (default: all).")] = None,
    decode_steps: Annotated[int, typer.Option(help="Greedy one-token steps timed after each prefill.")] = 16,
    rounds: Annotated[int, typer.Option(help="Rounds in alternating order; medians with their range are reported.")] = 3,
    longest: Annotated[bool, typer.Option(help="Also find the longest context that fits, by doubling.")] = False,
    compile_original: Annotated[bool, typer.Option(
        help="Time the original's decode through torch.compile at every context (CUDA; one compile per context).")] = (
        True
    ),
    kv_cache_dtype: Annotated[str, typer.Option(
        help="NHA's full layers' keys and values: auto (the model's dtype) or float8_e4m3.")] = "auto",
    layers: Annotated[int | None, typer.Option(help="With --random-weights: keep only the first N layers.")] = None,
    full_layers: FullLayersOption = None,
    full_layer_ids: FullLayerIdsOption = None,
    full_kv_heads: FullKVHeadsOption = None,
    full_kv_head_ids: FullKVHeadIdsOption = None,
    select: SelectOption = None,
    windows: WindowsOption = None,
    window: WindowOption = None,
    slots: SlotsOption = None,
    device: DeviceOption = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")] = (
        "auto"
    ),
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Folder to write bench.json, bench.md and the charts (PNG) to.")] = None,
    json_output: JsonOption = None,
):
    """Prefill, decode, memory and batch throughput: an NHA model against its original with the same weights."""
    if (checkpoint is None) == (random_weights is None):
        raise NHARetrofitError("give a checkpoint folder or --random-weights CONFIG (one of the two)")
    plan_options = {"--layers": layers, "--full-layers": full_layers, "--full-layer-ids": full_layer_ids,
                    "--full-kv-heads": full_kv_heads, "--full-kv-head-ids": full_kv_head_ids, "--select": select,
                    "--windows": windows, "--window": window, "--slots": slots}
    given = [name for name, value in plan_options.items() if value is not None]
    if checkpoint is not None and given:
        raise NHARetrofitError(f"{given[0]} applies only with --random-weights: a checkpoint benchmarks the plan in "
                               f"its config.json")
    options = dict(
        contexts=parse_ints(contexts, "--contexts", "context lengths such as 512,2048"), decode_steps=decode_steps,
        rounds=rounds, batch_sizes=parse_ints(batch_sizes, "--batch-sizes", "batch sizes such as 1,8,32"),
        batch_contexts=None if batch_contexts is None else parse_ints(batch_contexts, "--batch-contexts",
                                                                      "context lengths"),
        longest=longest, compile_original=compile_original, kv_cache=kv_cache_dtype, device=device, dtype=dtype,
        progress=True,
    )
    if random_weights is not None:
        spec = plan_spec(full_layers, full_layer_ids, select, windows, window, slots,
                         full_kv_heads=full_kv_heads, full_kv_head_ids=full_kv_head_ids)
    from .bench.run import benchmark_checkpoint, benchmark_random_weights

    if checkpoint is not None:
        report = benchmark_checkpoint(checkpoint, **options)
    else:
        report = benchmark_random_weights(random_weights, spec, layers=layers, **options)
    from .bench import plots
    from .bench.output import write_report
    from .bench.report import format_report

    typer.echo(format_report(report))
    for warning in report["warnings"]:
        typer.secho(f"warning: {warning}", err=True)
    write_json(json_output, report)
    if output is not None:
        written = write_report(report, output)
        typer.echo("\nwrote " + ", ".join(str(path) for path in written))
        if not plots.available():
            typer.echo(plots.MISSING)


@app.command()
@user_errors
def search(
    model: ModelArgument,
    full_layers: FullLayersOption = None,
    window: WindowOption = None,
    slots: SlotsOption = None,
    gate_normalizer: GateNormalizerOption = None,
    slot_bias_init: SlotBiasOption = None,
    gate_bias_init: GateBiasOption = None,
    texts: Annotated[str, typer.Option(help="Comma-separated held-out texts to rank the layers on.")] = "python-stdlib",
    check_texts: Annotated[str, typer.Option(help="Other held-out texts to score the plans on.")] = "python-docs",
    max_tokens: Annotated[int, typer.Option(help="Tokens of each text.")] = 2048,
    chunk_len: Annotated[int, typer.Option(help="Tokens per independent chunk (longer than the window).")] = 512,
    device: DeviceOption = "auto",
    json_output: JsonOption = None,
    revision: RevisionOption = None,
    token: TokenOption = None,
):
    """Choose the layers that keep full attention: each layer's KL divergence from the original when it alone is NHA."""
    spec = plan_spec(full_layers, window=window, slots=slots, gate_normalizer=gate_normalizer,
                     slot_bias_init=slot_bias_init, gate_bias_init=gate_bias_init)
    from .eval.layer_search import format_search, search_full_layers

    report = search_full_layers(
        model, spec, texts=parse_names(texts), check_texts=parse_names(check_texts), max_tokens=max_tokens,
        chunk_len=chunk_len, device=device, revision=revision, token=token, progress=True,
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
    show_card: Annotated[bool, typer.Option(help="Also print the model card (README.md) that is sent.")] = False,
):
    """Publish a checkpoint on the Hugging Face Hub in one commit, checked complete, with a model card."""
    from .hub import prepare_upload, push_checkpoint

    upload = prepare_upload(checkpoint, repo_id)
    typer.echo(upload.describe())
    if show_card:
        typer.echo("\n" + upload.model_card())
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

    from .finetune.recipe import load_recipe

    checked = load_recipe(recipe, set_ or [])  # before torch is imported
    from .finetune import finetune as run_finetune

    try:
        result = run_finetune(checked, resume=resume, dry_run=dry_run, overwrite=overwrite)
    except KeyboardInterrupt:
        from .finetune.trainer import interrupted_note

        command = " ".join(["nha-retrofit finetune", str(recipe), *(f"--set {shlex.quote(s)}" for s in set_ or [])])
        typer.secho(interrupted_note(checked, command), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    if dry_run:
        typer.echo(json.dumps(result, indent=2, default=str))


def main():
    app(prog_name="nha-retrofit")


if __name__ == "__main__":
    sys.exit(main())
