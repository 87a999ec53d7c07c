"""`nha-retrofit eval`: every kind of task in one run on the CPU (tables printed; JSON, markdown and PNGs in the output
folder; the latest evaluation recorded in the checkpoint and put into the model card by `push`), and one clear line
with nothing written for each mistake."""

import json
import shutil
import sys

import pytest

from cli_helpers import cli
from nha_retrofit.hub import prepare_upload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VARIANTS = ["original", "nha", "nha_all_full", "window_only"]
SETUPS = {"NO-LM-EVAL", "NO-MATPLOTLIB", "EXISTING-OUTPUT"}  # what a bad-input case sets up, not arguments


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    """A copy of the tiny checkpoint, which the evaluation writes its record into."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint")


@pytest.mark.slow
def test_every_task_kind_in_one_run(checkpoint, local_tasks, tmp_path):
    out, json_path = tmp_path / "out", tmp_path / "report.json"
    code, output = cli(
        "eval", checkpoint, "--tasks", "heldout,passkey,niah,positions,tiny_choice", "--include-path", local_tasks,
        "--device", "cpu", "--texts", "python-docs", "--max-tokens", "400", "--chunk-len", "200", "--lengths",
        "450", "--depths", "0,100", "--samples", "2", "--position-length", "300", "--sequences", "2",
        "--limit", "3", "--batch-size", "2", "--prompt", "The pass key is", "--output", out, "--json", json_path,
    )
    assert code == 0, output
    for title in ("### Held-out perplexity", "### lm-evaluation-harness", "### passkey: accuracy (%)",
                  "### niah_single", "### niah_multikey", "### Mean next-token loss by position"):
        assert title in output
    assert "| python-docs |" in output and "| 256-300 |" in output and "\nThe pass key is" in output

    report = json.loads((out / "evaluation.json").read_text())
    assert json.loads(json_path.read_text()) == report
    assert report["variants"] == VARIANTS and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["heldout"]["python-docs"]["original"] == report["heldout"]["python-docs"]["nha_all_full"]
    assert report["harness"]["tiny_choice"]["examples"] == 3
    for task in ("passkey", "niah_single", "niah_multikey"):
        result = report["retrieval"][task]
        assert result["lengths"] == [450] and result["depths"] == [0, 100]
        assert result["accuracy"]["original"] == result["accuracy"]["nha_all_full"]
        for grid in result["accuracy"].values():
            assert len(grid) == 1 and len(grid[0]) == 2 and all(v in (0, 0.5, 1) for v in grid[0])
    assert report["positions"]["buckets"] == [[0, 64], [64, 128], [128, 256], [256, 300]]
    pngs = {f"{task}_{variant}.png" for task in ("passkey", "niah_single", "niah_multikey") for variant in VARIANTS}
    assert {p.name for p in out.iterdir()} == {"evaluation.json", "evaluation.md", "positions.png", *pngs}
    assert all((out / name).read_bytes().startswith(PNG_SIGNATURE) for name in [*pngs, "positions.png"])
    assert "### passkey" in (out / "evaluation.md").read_text()

    record = json.loads((checkpoint / "nha_eval.json").read_text())
    assert "checkpoint" not in record and record["retrieval"] == report["retrieval"]
    code, output = cli("eval", checkpoint, "--tasks", "heldout", "--variants", "nha", "--device", "cpu", "--texts",
                       "python-stdlib", "--max-tokens", "400", "--chunk-len", "200", "--prompt", "")
    assert code == 0, output
    record = json.loads((checkpoint / "nha_eval.json").read_text())  # the new text joins the earlier results
    assert sorted(record["heldout"]) == ["python-docs", "python-stdlib"] and record["harness"] == report["harness"]

    upload = prepare_upload(checkpoint, "me/tiny-nha")
    assert "nha_eval.json" in upload.files
    card = upload.written["README.md"].decode()
    assert "model-index:" in card and "name: tiny-nha" in card and "type: nha-retrofit/passkey" in card
    assert "name: passkey, 450 tokens" in card and "type: tiny_choice" in card and "## Evaluation" in card
    assert f"value: {round(record['heldout']['python-stdlib']['nha'], 4)}" in card


def test_the_retrieval_suite_on_a_users_own_haystack(checkpoint, tmp_path):
    """Two suite tasks of the held-out group over the user's file: the JSON, the tables, a heatmap per model, the
    record in the checkpoint; the NHA model with every window full scores as the original."""
    notes, out = tmp_path / "notes.txt", tmp_path / "out"
    notes.write_text("".join(f"Entry {i}: the harbour crane lifted crate {i} before noon.\n" for i in range(300)))
    code, output = cli("eval", checkpoint, "--tasks", "suite:passkey,suite:niah_word", "--group", "heldout",
                       "--haystack", notes, "--lengths", "300", "--depths", "0,100", "--samples", "2", "--variants",
                       "original,nha,nha_all_full", "--device", "cpu", "--batch-size", "3", "--output", out,
                       "--kv-cache-dtype", "auto")
    assert code == 0, output
    assert "### Retrieval suite, heldout group (notes.txt): accuracy (%) [95% interval]; 2 samples" in output
    assert "The NHA models read each answer from a static cache, its full layers' keys and values in auto." in output
    report = json.loads((out / "evaluation.json").read_text())
    suite = report["suite"]
    assert suite["tasks"] == ["passkey", "niah_word"] and suite["reference"] == "original"
    assert suite["kv_cache"] == "auto"
    assert list(suite["groups"]) == ["heldout"] and suite["groups"]["heldout"]["haystacks"] == ["notes.txt"]
    for scores in suite["groups"]["heldout"]["tasks"].values():
        assert scores["cells"]["nha_all_full"] == scores["cells"]["original"]
        assert [stat["samples"] for stat in scores["summary"]["nha"]] == [4]
        assert list(scores["ratio"]) == ["nha", "nha_all_full"] and len(scores["bar"]) == 1
    pngs = {f"suite_heldout_{variant}.png" for variant in ("original", "nha", "nha_all_full")}
    assert {p.name for p in out.iterdir()} == {"evaluation.json", "evaluation.md", *pngs}
    assert all((out / name).read_bytes().startswith(PNG_SIGNATURE) for name in pngs)
    assert json.loads((checkpoint / "nha_eval.json").read_text())["suite"] == suite


@pytest.mark.parametrize("args, message", [
    (["--tasks", "passkey", "--lengths", "256,1024"], "length 1024 is beyond the model's 512 positions "
                                                      "(max_position_embeddings); pass --allow-beyond-positions"),
    (["--tasks", "positions", "--position-length", "600"], "position length 600 is beyond the model's 512"),
    (["--tasks", "heldout", "--prompt", "a b " * 300], "length of --prompt and its completion 641 is beyond the "
                                                       "model's 512 positions (max_position_embeddings); pass "
                                                       "--allow-beyond-positions"),
    pytest.param(["--tasks", "passkee", "--include-path", "TASKS"], "unknown task 'passkee' (did you mean 'passkey'?)",
                 marks=pytest.mark.slow),  # lm-eval indexes its thousands of task files (13 s on 2 cores)
    (["--tasks", "passkey", "--depths", "0,150"], "needle depths are percentages from 0 to 100"),
    (["--tasks", "heldout", "--texts", "wikitext"], "unknown text 'wikitext'"),
    (["--tasks", "heldout", "--chunk-len", "9000"], "--chunk-len must be >= 2 and at most --max-tokens (8192)"),
    (["--variants", "nha,sliding"], "unknown model variant 'sliding'"),
    (["--tasks", "passkey", "--lengths", "30"], "length 30 is too short for passkey"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--tasks", "arc_easy", "NO-LM-EVAL"], "task 'arc_easy' is not built in (heldout, passkey, niah, "
                                            "niah_single, niah_multikey, suite, positions); lm-evaluation-harness "
                                            "tasks need lm-eval: pip install 'nha-retrofit[eval]'"),
    (["--tasks", "suite", "--group", "dev"], "unknown suite group 'dev'; choose from tuning, heldout, all"),
    (["--tasks", "suite:kvv"], "unknown suite task 'kvv'; choose from passkey, niah_number"),
    (["--tasks", "suite", "--lengths", "1024"], "length 1024 is beyond the model's 512 positions"),
    (["--tasks", "suite:kv", "--lengths", "60"], "length 60 is too short for kv"),
    (["--tasks", "suite", "--kv-cache-dtype", "int4"], "unknown KV cache dtype 'int4'; use auto, float8_e4m3"),
    (["--tasks", "suite,passkey", "--haystack", "notes.txt"], "--haystack notes.txt is neither a held-out text "
                                                              "(python-stdlib, shakespeare, python-docs) nor a "
                                                              "readable UTF-8 text file"),
    (["--tasks", "passkey", "NO-MATPLOTLIB"], "the PNG plots need matplotlib: pip install 'nha-retrofit[eval]'"),
    (["EXISTING-OUTPUT"], "already exists; pass --overwrite to replace it"),
])
def test_bad_input_is_one_line_and_writes_nothing(checkpoint, local_tasks, tmp_path, monkeypatch, args, message):
    out = tmp_path / "out"
    if "NO-LM-EVAL" in args:
        monkeypatch.setitem(sys.modules, "lm_eval", None)  # any import of it now fails
    if "NO-MATPLOTLIB" in args:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    if "EXISTING-OUTPUT" in args:
        out.mkdir()
    args = [str(local_tasks) if a == "TASKS" else a for a in args if a not in SETUPS]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, output = cli("eval", checkpoint, *args, "--samples", "1", "--output", out, "--json", tmp_path / "r.json")
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1, output
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
