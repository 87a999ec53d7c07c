"""A recipe whose `model.path` is a Hub id: `model.revision` picks the version, the token comes from HF_TOKEN, and the
model is downloaded from a local Hub (tests/support/hub_server.py) by the real huggingface_hub client when not
cached."""

import json

import pytest

from hub_checkpoints import save_hub_checkpoint, use_local_hub
from hub_server import LocalHub, serve_tree
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.finetune import load_recipe
from nha_retrofit.finetune.model import resolve_source


def recipe(**model):
    return {"model": model, "data": {"files": ["a.txt"]}, "stages": {"lm": {"tokens": 10}}}


def test_model_revision_is_a_typed_recipe_key():
    assert load_recipe(recipe(path="org/tiny", revision="v2")).model.revision == "v2"
    assert load_recipe(recipe(path="org/tiny")).model.revision is None
    with pytest.raises(NHARetrofitError, match=r"recipe key model.revision: expected a string, got \['v2'\]"):
        load_recipe(recipe(path="org/tiny", revision=["v2"]))


def test_recipe_downloads_the_revision_with_the_environment_token(monkeypatch, tmp_path):
    main = save_hub_checkpoint(tmp_path / "main", seed=31)
    v2 = save_hub_checkpoint(tmp_path / "v2", seed=32, num_hidden_layers=2)
    with LocalHub() as hub:
        hub.users["hf_reader"] = "reader"
        hub.add_repo("org/tiny", serve_tree(main), gated=True, readers=("reader",))
        commit = hub.add_repo("org/tiny", serve_tree(v2), branch="v2")
        use_local_hub(hub, monkeypatch, tmp_path / "hf", token="hf_reader")
        source = resolve_source(load_recipe(recipe(path="org/tiny", revision="v2", convert={"full_layers": 1})).model)
    assert source.folder == tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / commit
    assert not source.converted and source.original == "org/tiny" and len(source.plan.windows) == 2
    assert json.loads((source.folder / "config.json").read_text()) == json.loads((v2 / "config.json").read_text())
    assert all(r.token == "hf_reader" for r in hub.requests if "org/tiny" in r.path)
