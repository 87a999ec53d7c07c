"""The `nha-retrofit` command line run in-process, as the CLI tests drive it."""

from typer.testing import CliRunner

from nha_retrofit.cli import app


def cli(*args) -> tuple[int, str]:
    """`nha-retrofit ARGS...` (paths and numbers are turned into strings): (exit code, output stripped)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output.strip()
