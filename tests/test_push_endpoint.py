"""`nha-retrofit push` against a local Hub (tests/support/hub_server.py) through the real huggingface_hub client: the
repository is created, the branch made, the safetensors shards go up by the LFS API (checked by sha256), and one
commit holds exactly the checkpoint's files and its model card; what the Hub then serves is what the folder holds.

huggingface_hub sends LFS files through the Xet storage protocol whenever hf_xet is installed; the local Hub does not
speak it, so these tests set HF_HUB_DISABLE_XET, with which the client takes the LFS "basic" transfer instead."""

import hashlib
import json

import pytest

from cli_helpers import cli
from hub_checkpoints import save_hub_checkpoint, use_local_hub
from hub_server import GITATTRIBUTES, LocalHub
from nha_retrofit.conversion import convert
from nha_retrofit.hub import prepare_upload
from nha_retrofit.plan import PlanSpec

TOKEN = "hf_owner_token"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    source = save_hub_checkpoint(root / "tiny", seed=21)
    return convert(source, root / "tiny-nha", PlanSpec(select="even", full_layers=1, window=3, slots=5), log=lambda *_: None)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    with LocalHub() as hub:
        hub.users[TOKEN] = "me"
        use_local_hub(hub, monkeypatch, tmp_path / "hf", token=TOKEN)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        yield hub


def test_push_creates_the_repo_and_one_commit_with_the_checkpoint_and_its_card(hub, checkpoint):
    code, output = cli("push", checkpoint, "me/tiny-nha", "--private", "--branch", "v1", "--message", "first")
    assert code == 0, output
    repo = hub.repos["me/tiny-nha"]
    commit = repo.refs["v1"]
    assert output.endswith(f"{hub.url}/me/tiny-nha/commit/{commit}")  # printed after the LFS progress bar
    assert repo.private and repo.owner == "me" and repo.messages[commit] == "first"
    assert hub.files("me/tiny-nha", "main") == {".gitattributes": GITATTRIBUTES}  # the branch alone holds the push

    upload = prepare_upload(checkpoint, "me/tiny-nha")
    pushed = hub.files("me/tiny-nha", "v1")
    assert set(pushed) == {".gitattributes", *upload.files, *upload.written}
    for name in upload.files:
        assert pushed[name] == (checkpoint / name).read_bytes(), name
    assert pushed["README.md"] == upload.written["README.md"]
    assert 'from_pretrained("me/tiny-nha", trust_remote_code=True)' in pushed["README.md"].decode()
    assert "source_path" not in json.loads(pushed["nha_conversion.json"])

    shards = sorted(name for name in upload.files if name.endswith(".safetensors"))
    oids = {hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() for name in shards}
    assert {r.path.removeprefix("/lfs/") for r in hub.requests if r.method == "PUT"} == oids
    assert len([r for r in hub.requests if r.path.endswith("/verify")]) == len(oids)
    assert [r.path for r in hub.requests if "/commit/" in r.path] == ["/api/models/me/tiny-nha/commit/v1"]


def test_pushing_again_adds_a_commit_to_the_existing_repo_and_branch(hub, checkpoint):
    assert cli("push", checkpoint, "me/tiny-nha", "--branch", "v1")[0] == 0
    first, before = hub.repos["me/tiny-nha"].refs["v1"], len(hub.requests)
    code, output = cli("push", checkpoint, "me/tiny-nha", "--branch", "v1", "--message", "again")
    assert code == 0, output
    second = hub.repos["me/tiny-nha"].refs["v1"]
    assert second != first and hub.repos["me/tiny-nha"].messages[second] == "again"
    assert not [r for r in hub.requests[before:] if r.method == "PUT"]  # the Hub already holds every LFS object


@pytest.mark.parametrize("token, repo_id, message", [
    ("hf_unknown", "me/x", "error: the Hub refused the upload: Invalid user token."),
    (None, "me/x", "error: not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN"),
    (TOKEN, "someone-else/x", "error: the Hub refused the upload:"),
])
def test_refusals_are_one_line(hub, checkpoint, monkeypatch, token, repo_id, message):
    monkeypatch.delenv("HF_TOKEN")
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    code, output = cli("push", checkpoint, repo_id)
    assert code == 1 and output.splitlines()[-1].startswith(message) and "Traceback" not in output
    assert [line for line in output.splitlines() if line.startswith("error")] == [output.splitlines()[-1]]
    assert repo_id not in hub.repos


def test_offline_push_is_one_line_and_sends_nothing(hub, checkpoint, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, output = cli("push", checkpoint, "me/x")
    assert code == 1 and output.splitlines()[-1].startswith("error: the Hub could not be reached: Cannot reach")
    assert hub.requests == []
