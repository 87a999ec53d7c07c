"""`nha-retrofit push`: what goes up (a checked, complete checkpoint in one commit, a model card, no local paths),
and one clear line for every mistake. The Hub itself is replaced by a recording stand-in, except in the offline
check, which runs the real client in a fresh process."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

from cli_helpers import cli
from nha_retrofit.checksums import CHECKSUMS
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.hub import model_card, prepare_upload, push_checkpoint


class RecordingHub:
    """Stands in for huggingface_hub.HfApi: records calls; `fail` is raised by whoami."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def whoami(self):
        if self.fail is not None:
            raise self.fail
        return {"name": "me"}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, {**kwargs, "operations": operations}))
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()


def read(operation) -> bytes:
    source = operation.path_or_fileobj
    return source if isinstance(source, bytes) else open(source, "rb").read()


def test_one_commit_holds_the_whole_checkpoint_and_a_card(family):
    _, _, _, out = family
    upload = prepare_upload(out, "me/tiny-nha")
    hub = RecordingHub()
    url = push_checkpoint(upload, "me/tiny-nha", private=True, branch="v1", api=hub)
    assert url == "https://huggingface.co/me/tiny-nha/commit/abc"
    assert [call[0] for call in hub.calls] == ["create_repo", "create_branch", "create_commit"]
    assert hub.calls[0][2] == {"private": True, "exist_ok": True}
    operations = {op.path_in_repo: op for op in hub.calls[2][2]["operations"]}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = {"config.json", "model.safetensors.index.json", *index["weight_map"].values(), "modeling_nha.py",
                "configuration_nha.py", "nha_cache.py", "tokenizer.json", "README.md", "nha_conversion.json"}
    assert expected <= set(operations) and hub.calls[2][2]["revision"] == "v1"
    for name in set(operations) - {"README.md", "nha_conversion.json", CHECKSUMS}:
        assert read(operations[name]) == (out / name).read_bytes()
    pushed = {name: read(operation) for name, operation in operations.items()}
    digests = json.loads(pushed.pop(CHECKSUMS))  # the repository's files as sent, the rewritten record included
    assert digests == {name: hashlib.sha256(data).hexdigest() for name, data in pushed.items()}
    record = json.loads(read(operations["nha_conversion.json"]))
    assert "source_path" not in record and record["plan"]["windows"] == json.loads(
        (out / "config.json").read_text())["nha_windows"]
    card = read(operations["README.md"]).decode()
    assert 'from_pretrained("me/tiny-nha", trust_remote_code=True)' in card and "library_name: transformers" in card
    assert "4 of 6 layers read a 5-slot gated memory" in card and "Converted, not finetuned" in card


def test_card_names_a_hub_base_model_and_the_finetuning_numbers():
    config = {"nha_windows": [None, 64, 64, None], "nha_num_slots": 64, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "dtype": "bfloat16"}
    record = {"source": "meta-llama/Meta-Llama-3-8B", "finetune": {
        "before": {"eval_ppl": 31.5, "original_eval_ppl": 6.25}, "after": {"eval_ppl": 7.125}}}
    card = model_card("me/llama-nha", config, record)
    assert "base_model: meta-llama/Meta-Llama-3-8B" in card and "layers [0, 3] keep full attention" in card
    assert "| eval_ppl | 31.5 | 7.125 |" in card and "| original_eval_ppl | 6.25 | - |" in card
    assert "holds a fixed 1,048,649 bytes per sequence" in card  # 2*8*64*128*4 + 64*(8*(3*128*2 + 256) + 1) + 9
    assert "base_model" not in model_card("me/x", config, {"source": "/home/me/llama"})
    heads = model_card("me/x", {**config, "nha_full_kv_heads": [[], [1, 5], [0], []]}, record)
    assert "keep full attention, and so do KV heads (layer:head) 1:1, 1:5, 2:0 inside NHA layers." in heads
    assert "KV cache only for the full layers and heads; each NHA layer holds a fixed 1,048,649 bytes per sequence " \
           "at most" in heads


def test_card_metadata_holds_the_latest_evaluation_of_the_nha_model():
    """`nha-retrofit eval`'s record becomes the card's eval_results (the NHA model's scores; retrieval as the mean
    over depths per length) and its tables."""
    from huggingface_hub import ModelCard

    config = {"nha_windows": [None, 64, 64, None], "nha_num_slots": 64, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "dtype": "bfloat16"}
    evaluation = {
        "device": "NVIDIA H200", "dtype": "bfloat16", "windows": config["nha_windows"],
        "variants": ["original", "nha", "window_only"],
        "heldout": {"python-docs": {"original": 10.5, "nha": 11.25, "window_only": 14.0}},
        "harness": {"arc_easy": {"examples": 2376, "metrics": {"acc": {"original": 0.51, "nha": 0.4812}}}},
        "retrieval": {"passkey": {"lengths": [1024, 2048], "depths": [0, 100], "samples": 10, "haystack": "python-docs",
                                  "seed": 0, "accuracy": {"original": [[1.0, 1.0], [1.0, 0.9]],
                                                          "nha": [[1.0, 0.8], [0.5, 0.7]],
                                                          "window_only": [[0.0, 0.1], [0.0, 0.0]]}}},
    }
    card = model_card("me/llama-nha", config, None, evaluation)
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in ModelCard(card).data.eval_results}
    assert results == {("held-out python-docs", "perplexity"): 11.25, ("arc_easy", "acc"): 0.4812,
                       ("passkey, 1024 tokens", "accuracy"): 0.9, ("passkey, 2048 tokens", "accuracy"): 0.6}
    assert "## Evaluation" in card and "| python-docs | 10.50 | 11.25 | 14.00 |" in card
    assert "| 2048 | 95.0 | 60.0 | 0.0 |" in card and "model-index" not in model_card("me/x", config, None)


def test_an_own_readme_is_sent_as_it_is_and_other_files_stay_home(family, tmp_path):
    _, _, _, out = family
    folder = tmp_path / "ckpt"
    shutil.copytree(out, folder)
    (folder / "README.md").write_text("# mine\n")
    (folder / "notes.txt").write_text("private\n")
    upload = prepare_upload(folder, "me/tiny-nha")
    assert "README.md" in upload.files and "README.md" not in upload.written and upload.skipped == ["notes.txt"]


def test_cli_dry_run_lists_the_upload(family):
    _, _, _, out = family
    code, output = cli("push", out, "me/tiny-nha", "--dry-run")
    assert code == 0 and "  config.json" in output and "  README.md (written for the Hub)" in output


def test_cli_dry_run_shows_the_model_card_it_would_send(family):
    _, _, _, out = family
    code, output = cli("push", out, "me/tiny-nha", "--dry-run", "--show-card")
    assert code == 0, output
    card = prepare_upload(out, "me/tiny-nha").written["README.md"].decode().strip()
    assert output.endswith(card) and "trust_remote_code=True" in card


def break_folder(folder, how):
    if how == "missing shard":
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        (folder / sorted(set(index["weight_map"].values()))[0]).unlink()
    elif how == "truncated shard":
        shard = sorted(folder.glob("*.safetensors"))[-1]
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink(missing_ok=True)
    elif how == "no remote code":
        (folder / "nha_cache.py").unlink()
    elif how == "pickle weights":
        for path in folder.glob("model*.safetensors*"):
            path.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"not a model")


@pytest.mark.parametrize("how, repo_id, message", [
    ("ok", "tiny-nha", "name the owner too"),
    ("ok", "me/bad..name", "is not a Hub repository id"),
    ("missing shard", "me/x", "is missing from"),
    ("truncated shard", "me/x", "is truncated"),
    ("no tokenizer", "me/x", "has no tokenizer files"),
    ("no remote code", "me/x", "lacks the remote code file nha_cache.py"),
    ("pickle weights", "me/x", "has only pickle weights"),
])
def test_cli_bad_checkpoint_or_repo_is_one_line(family, tmp_path, how, repo_id, message):
    _, _, _, out = family
    folder = tmp_path / "ckpt"
    shutil.copytree(out, folder)
    break_folder(folder, how)
    code, output = cli("push", folder, repo_id)
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1


def test_cli_refuses_a_folder_that_is_not_nha(family):
    _, _, original_folder, _ = family
    code, output = cli("push", original_folder, "me/x", "--dry-run")
    assert code == 1 and output.startswith("error: ") and "is not an NHA checkpoint" in output


@pytest.mark.parametrize("failure, message", [
    (LocalTokenNotFoundError("no token"), "not logged in to the Hugging Face Hub"),
    (OfflineModeIsEnabled("offline"), "the Hub could not be reached: offline"),
])
def test_hub_failures_become_user_errors(family, failure, message):
    _, _, _, out = family
    hub = RecordingHub(fail=failure)
    with pytest.raises(NHARetrofitError, match=message):
        push_checkpoint(prepare_upload(out, "me/x"), "me/x", api=hub)
    assert hub.calls == []


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 7-10 s
@pytest.mark.parametrize("family", ["llama3"], indirect=True)  # (the client's behaviour, not the family's)
def test_offline_push_in_a_fresh_process_is_one_line(family):
    _, _, _, out = family
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_not_a_real_token"}
    result = subprocess.run([sys.executable, "-m", "nha_retrofit.cli", "push", str(out), "me/x"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: the Hub could not be reached") and "Traceback" not in result.stderr
