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


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated layer numbers such as 3,11,19,27") from None


@app.command()
@user_errors
def convert(
    model: Annotated[str, typer.Argument(help="Local folder, Hub id in the local HF cache, or 'smollm2-135m'.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the NHA checkpoint to.")],
    full_layers: Annotated[int, typer.Option(help="Layers that keep full attention, evenly spaced.")] = 4,
    full_layer_ids: Annotated[str | None, typer.Option(help="Exact full layers, e.g. 3,11,19,27.")] = None,
    window: Annotated[int, typer.Option(help="Sliding window of the NHA layers.")] = 64,
    slots: Annotated[int, typer.Option(help="Slots of the NHA memory per KV head.")] = 64,
    gate_normalizer: Annotated[float, typer.Option(help="tau in log(alpha) = logsigmoid(g) / tau.")] = 8.0,
    slot_bias_init: Annotated[float, typer.Option(help="Initial per-head slot-logit offset (0 = paper).")] = -4.0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
):
    """Convert a pretrained Llama-family model into an NHA hybrid checkpoint."""
    from .convert.converter import convert as run_convert

    ids = parse_layer_ids(full_layer_ids)
    run_convert(
        model, output, full_layers=len(ids) if ids is not None else full_layers, full_layer_ids=ids, window=window,
        slots=slots, gate_normalizer=gate_normalizer, slot_bias_init=slot_bias_init, overwrite=overwrite,
    )


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: Annotated[Path, typer.Argument(help="A folder written by `nha-retrofit convert`.")],
    texts: Annotated[str, typer.Option(help="Comma-separated held-out texts.")] = "python-stdlib,shakespeare",
    max_tokens: Annotated[int, typer.Option(help="Tokens of each text to score.")] = 8192,
    chunk_len: Annotated[int, typer.Option(help="Tokens per independent chunk.")] = 1024,
    prompt: Annotated[str, typer.Option(help="Prompt for a short greedy completion ('' to skip).")] = (
        "The three most important rules of writing readable Python code are"
    ),
):
    """Held-out perplexity: original vs converted (as planned) vs converted with every window full; then generate."""
    from .eval.compare import compare_perplexity, generate_text

    results = compare_perplexity(
        checkpoint, [t.strip() for t in texts.split(",") if t.strip()], max_tokens=max_tokens, chunk_len=chunk_len
    )
    variants = list(next(iter(results.values())))
    typer.echo("\n| text | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
    for name, row in results.items():
        typer.echo(f"| {name} | " + " | ".join(f"{row[v]:.2f}" for v in variants) + " |")
    if prompt:
        typer.echo(f"\n{prompt}{generate_text(checkpoint, prompt)}")


def main():
    app(prog_name="nha-retrofit")


if __name__ == "__main__":
    sys.exit(main())
