"""The command line's own contract: parse errors are one `error:` line and exit 1 like every other user mistake,
checks that need no model answer before torch is imported, --version, help that is not cut."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, message", [
    (["bench", "--slots", "abc"], "error: invalid value for '--slots': "),
    (["bench", "--contexs", "512"], "error: no such option: --contexs (Possible options: --batch-contexts, --contexts"),
    (["push", "x", "me/x", "--mesage", "m"], "error: no such option: --mesage (Possible options: --message)"),
    (["benhc"], "error: no such command 'benhc'. Did you mean 'bench'?"),
    (["plan", "x", "--full-layer-ids", "3,x"], "error: invalid value for --full-layer-ids: '3,x': expected"),
    (["plan", "x", "--full-kv-head-ids", "7:0,7-1"], "error: invalid value for --full-kv-head-ids: '7-1': expected"),
    (["plan", "smollm2-135m", "--full-kv-head-ids", "1:3"], "error: --full-kv-head-ids (1, 3): out of range, the model "
                                                            "has layers 0..29 of KV heads 0..2"),
])
def test_parse_errors_are_one_line_and_exit_1(args, message):
    code, output = cli(*args)
    assert code == 1 and output.startswith(message) and len(output.splitlines()) == 1, output


def run_without_torch(*args) -> subprocess.CompletedProcess:
    """`nha-retrofit ARGS` in a process where importing torch fails: an answer proves torch was never needed."""
    script = "import sys; sys.modules['torch'] = None; from nha_retrofit.cli import main; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("args, message", [
    (["convert", "smollm2-135m", "-o", "OUT", "--slots", "0"], "error: --slots 0: at least one slot is needed"),
    (["convert", "smollm2-135m", "-o", "EXISTING"], "already exists; pass --overwrite"),
    (["plan", "smollm2-135m", "--gate-normalizer", "0"], "error: --gate-normalizer 0: must be > 0"),
    (["plan", "smollm2-135m", "--full-kv-heads", "2", "--full-kv-head-ids", "1:0"],
     "error: --full-kv-heads and --full-kv-head-ids: give one of the two"),
    (["search", "smollm2-135m", "--window", "-1"], "error: --window -1: a window is an integer >= 0"),
    (["bench", "--random-weights", "llama3-8b", "--contexts", "1,a"], "error: invalid value for --contexts"),
    (["bench", "EXISTING", "--slots", "8"], "error: --slots applies only with --random-weights"),
    (["finetune", "RECIPE"], "error: recipe key train.lrr: unknown key, did you mean lr?"),
])
def test_mistakes_are_reported_before_torch_is_imported(tmp_path, args, message):
    (tmp_path / "existing").mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {path: x}\ndata: {files: [a.txt]}\nstages: {lm: {tokens: 10}}\ntrain: {lrr: 1}\n")
    paths = {"OUT": tmp_path / "out", "EXISTING": tmp_path / "existing", "RECIPE": recipe}
    result = run_without_torch(*[paths.get(a, a) for a in args])
    assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_plan_prints_full_kv_heads():
    code, output = cli("plan", "smollm2-135m", "--full-kv-head-ids", "7:0,14:2,14:1")
    assert code == 0, output
    assert "full attention at none; full KV heads (layer:head) 7:0, 14:1, 14:2;" in output
    assert "| 14 | 256 | 64 | 1,2 |" in output


def test_version():
    from importlib.metadata import version

    assert cli("--version") == (0, f"nha-retrofit {version('nha-retrofit')}")


def test_help_is_wrapped_not_cut():
    code, output = cli("bench", "--help")
    assert code == 0 and "--compile-original / --no-compile-original" in output and "…" not in output
