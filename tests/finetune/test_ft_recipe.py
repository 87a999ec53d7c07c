"""Recipe schema: typed keys, overrides, errors that name the key; every shipped recipe passes --dry-run."""

import re
from pathlib import Path

import pytest
import yaml

from ft_helpers import save_recipe, tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.finetune import finetune, load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def minimal(**extra):
    return {"model": {"path": "x"}, "data": {"files": ["a.txt"]}, "stages": {"lm": {"tokens": 10}}, **extra}


def test_defaults_and_types():
    recipe = load_recipe(minimal(train={"lr": "3e-5", "batch_size": 2.0}))
    assert recipe.train.lr == 3e-5 and recipe.train.batch_size == 2
    assert recipe.train.trainable == "attention" and recipe.stages.attention_transfer.tokens == 0


@pytest.mark.parametrize(
    "raw, message",
    [
        (minimal(trian={}), "recipe key trian: unknown key, did you mean train?"),
        (minimal(train={"lrr": 1}), "recipe key train.lrr: unknown key, did you mean lr?"),
        (minimal(train={"xyz": 1}), "recipe key train.xyz: unknown key (train accepts batch_size, betas,"),
        (minimal(train={"lr": "fast"}), "recipe key train.lr: expected a number"),
        (minimal(train={"lr": -1.0}), "recipe key train.lr: -1.0: must be > 0"),
        (minimal(train={"batch_size": 1.5}), "recipe key train.batch_size: expected an integer"),
        (minimal(train={"trainable": "ffn"}), "recipe key train.trainable: expected one of attention, gates, lora"),
        (minimal(train={"gradient_checkpointing": "yes"}), "recipe key train.gradient_checkpointing: expected true"),
        (minimal(data={"files": "a.txt"}), "recipe key data.files: expected a list"),
        (minimal(data={"files": ["a"], "dataset": "b/c"}), "recipe key data: give exactly one"),
        (minimal(stages={"lm": {"tokens": 0}}), "recipe key stages: both stages have tokens 0"),
        (minimal(eval={"heldout_texts": ["poems"]}), "recipe key eval.heldout_texts[0]: 'poems'"),
        (minimal(train={"betas": [0.9, 1.0]}), "recipe key train.betas[1]: 1.0: must be < 1"),
        (minimal(data={"files": ["a"], "synthetic": {"share": 1.5}}), "recipe key data.synthetic.share: 1.5: must be <= 1"),
        (minimal(train={"lr": float("nan")}), "recipe key train.lr: expected a finite number"),
        (minimal(data={"files": ["a"], "seq_len": 64, "long": {"seq_len": 100}}),
         "recipe key data.long.seq_len: must be a multiple of data.seq_len (64) larger than it"),
        (minimal(data={"files": ["a"], "seq_len": 64, "long": {"seq_len": 256}}, train={"batch_size": 2}),
         "recipe key data.long.seq_len: 256 tokens per block must divide the 2 x 64 tokens of a micro-batch"),
        (minimal(data={"files": ["a"], "long": {"share": 0}}), "recipe key data.long.share: 0: must be > 0"),
        (minimal(model={"path": "x", "convert": {"slots": 0}}), "recipe key model.convert.slots: 0: at least one slot"),
        (minimal(model={"path": "x", "convert": {"widow": 32}}), "recipe key model.convert.widow: unknown key, did you "
                                                                 "mean window?"),
        ({"data": {"files": ["a"]}, "stages": {"lm": {"tokens": 1}}}, "recipe key model.path: required"),
    ],
)
def test_errors_name_the_key(raw, message):
    with pytest.raises(NHARetrofitError, match=re.escape(message)):
        load_recipe(raw)


def test_every_error_is_reported_on_one_line():
    with pytest.raises(NHARetrofitError) as caught:
        load_recipe(minimal(train={"lrr": 1e-4, "batch_size": 0, "tensorboard": 1}, data={"files": ["a"], "seq_len": 1}))
    assert str(caught.value).split("; ") == [
        "recipe key data.seq_len: 1: must be >= 2",
        "recipe key train.batch_size: 0: must be >= 1",
        "recipe key train.tensorboard: expected true or false, got 1",
        "recipe key train.lrr: unknown key, did you mean lr?",
    ]


def test_the_convert_section_is_a_plan_spec():
    """`model.convert: {}` is PlanSpec's defaults; its keys are PlanSpec's, `--set` reaches them."""
    from nha_retrofit.plan import PlanSpec

    assert load_recipe(minimal(model={"path": "x", "convert": {}})).model.convert == PlanSpec()
    recipe = load_recipe(minimal(), ["model.convert.full_layer_ids=[2, 9]", "model.convert.select=last"])
    assert recipe.model.convert == PlanSpec(full_layer_ids=(2, 9), select="last")
    assert recipe.as_dict()["model"]["convert"]["full_layers"] == 2


def test_overrides(tmp_path):
    path = save_recipe(minimal(), tmp_path / "r.yaml")
    recipe = load_recipe(path, ["train.lr=1e-4", "stages.lm.distill_weight=0.5", "train.lora.target_modules=[q_proj]",
                                "model.convert.window=32"])
    assert recipe.train.lr == 1e-4 and recipe.stages.lm.distill_weight == 0.5
    assert recipe.train.lora.target_modules == ["q_proj"] and recipe.model.convert.window == 32
    with pytest.raises(NHARetrofitError, match="recipe key train.lrate: unknown key"):
        load_recipe(path, ["train.lrate=1"])
    with pytest.raises(NHARetrofitError, match="expected key.sub=value"):
        load_recipe(path, ["train.lr"])
    with pytest.raises(NHARetrofitError, match="model.path.x: model.path is not a section"):
        load_recipe(path, ["model.path.x=1"])


def test_placeholders_and_relative_paths(tmp_path):
    import sysconfig

    recipe = load_recipe(minimal(data={"files": ["{stdlib}/heapq.py", "{recipe_dir}/x.txt"]}))
    assert recipe.data.files[0] == str(Path(sysconfig.get_paths()["stdlib"]) / "heapq.py")
    with pytest.raises(NHARetrofitError, match="unknown placeholder"):
        load_recipe(minimal(data={"files": ["{nowhere}/a.txt"]}))


def test_every_path_key_follows_one_rule(tmp_path, monkeypatch):
    """Placeholders and ~ expand in data and output paths alike; a relative path stays relative to the working
    folder, as on the command line, wherever the recipe lies."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    sections = dict(data={"files": ["docs/*.txt", "{recipe_dir}/x.txt"]}, train={"output_dir": "{recipe_dir}/run"},
                    export={"folder": "~/exports/model"})
    (tmp_path / "recipes").mkdir()
    recipe = load_recipe(save_recipe(minimal(**sections), tmp_path / "recipes" / "r.yaml"))
    folder = (tmp_path / "recipes").resolve()
    assert recipe.data.files == ["docs/*.txt", str(folder / "x.txt")]
    assert recipe.train.output_dir == str(folder / "run")
    assert recipe.export.folder == str(tmp_path / "home" / "exports" / "model")
    assert load_recipe(save_recipe(minimal(train={"output_dir": "runs/a"}), tmp_path / "recipes" / "s.yaml")
                       ).train.output_dir == "runs/a"
    with pytest.raises(NHARetrofitError, match=r"recipe key train.output_dir: '\{run\}/x' uses an unknown placeholder"):
        load_recipe(minimal(train={"output_dir": "{run}/x"}))


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    return write_tiny_original(root / "orig"), write_corpus(root / "data"), root


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_dry_runs(name, tiny_world):
    """Every shipped recipe validates; model and data are replaced by a tiny local Llama and local files, since the
    real ones (8B-30B weights, SlimPajama) are not on this machine."""
    model, data, root = tiny_world
    raw = yaml.safe_load((RECIPES / name).read_text())
    overrides = [f"model.path={model}", "model.convert.full_layer_ids=null", "model.convert.full_kv_head_ids=null",
                 "model.convert.full_layers=1", f"data.files=[{data}/*.txt]", "data.dataset=null", "data.seq_len=32", "data.eval_blocks=2", f"train.output_dir={root / name}"]
    long = raw["data"].get("long", {"seq_len": 0, "share": 0})
    overrides.append(f"data.long.seq_len={32 * long['seq_len'] // raw['data']['seq_len']}")  # the same blocks joined
    plan = finetune(RECIPES / name, overrides, dry_run=True, log=lambda *_: None)
    assert plan["total_steps"] >= 1 and plan["trainable_parameters"] > 0
    assert plan["total_tokens"] >= raw["stages"]["lm"]["tokens"]
    assert plan["long_block_steps"] == round(plan["lm_steps"] * long["share"])


def test_a_plan_the_model_cannot_take_names_the_recipe_key(tiny_world, tmp_path):
    model, data, _ = tiny_world
    recipe = tiny_recipe(model, data, tmp_path / "run", model={"convert": {"full_layer_ids": [99]}})
    with pytest.raises(NHARetrofitError, match=r"^recipe key model.convert.full_layer_ids: 99: out of range, the model"):
        finetune(recipe, dry_run=True, log=lambda *_: None)


@pytest.mark.slow
def test_demo_recipe_dry_runs_with_its_real_model(tmp_path, smollm2_nha):
    """The demo recipe as shipped, on the embedded SmolLM2 (data limited to two stdlib files to stay fast); the
    retrieval probe's pick on the CPU is the GPU recipe's pinned plan (slow: the probe runs 16 prompts)."""
    plan = finetune(
        RECIPES / "smollm2_demo.yaml",
        ['data.files=["{stdlib}/this.py", "{stdlib}/bisect.py", "{stdlib}/shlex.py"]', "data.seq_len=256",
         f"train.output_dir={tmp_path / 'run'}"],
        dry_run=True, log=lambda *_: None,
    )
    pinned = load_recipe(RECIPES / "smollm2_gpu.yaml").model.convert.full_kv_head_ids
    assert plan["full_layers"] == [] and plan["windows"] == [256]  # the default: the probe's 15 KV heads
    assert [tuple(pair) for pair in plan["full_kv_heads"]] == list(pinned) and len(pinned) == 15
    assert plan["total_parameters"] > 134_000_000 and 0 < plan["trainable_parameters"] < plan["total_parameters"] / 3


def test_dry_run_through_the_cli(tiny_world, tmp_path):
    from typer.testing import CliRunner

    from nha_retrofit.cli import app

    model, data, _ = tiny_world
    path = save_recipe(tiny_recipe(model, data, tmp_path / "run"), tmp_path / "r.yaml")
    result = CliRunner().invoke(app, ["finetune", str(path), "--dry-run", "--set", "train.batch_size=4"])
    assert result.exit_code == 0, result.output
    assert '"tokens_per_step": 128' in result.output
    result = CliRunner().invoke(app, ["finetune", str(path), "--dry-run", "--set", "train.lr=fast"])
    assert result.exit_code == 1
    assert "error: recipe key train.lr: expected a number" in result.output


def test_dry_run_in_a_folder_that_holds_a_run_needs_no_overwrite(tiny_world, tmp_path):
    """A dry run writes nothing: it notes what the real run will need instead of refusing."""
    model, data, _ = tiny_world
    path = save_recipe(tiny_recipe(model, data, tmp_path / "run"), tmp_path / "r.yaml")
    (tmp_path / "run" / "checkpoints" / "step-00000001").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    plan = finetune(path, dry_run=True, log=lambda *_: None)
    assert "already holds a run; pass --resume to continue it or --overwrite" in plan["output_dir"]
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


@pytest.mark.parametrize("saved", [True, False])
def test_ctrl_c_says_where_the_last_checkpoint_is_and_how_to_resume(tiny_world, tmp_path, monkeypatch, saved):
    from typer.testing import CliRunner

    from nha_retrofit.cli import app
    from nha_retrofit.finetune.trainer import Run

    def interrupted(self):
        if saved:
            (self.checkpoints / "step-00000004").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(Run, "train", interrupted)
    model, data, _ = tiny_world
    path = save_recipe(tiny_recipe(model, data, tmp_path / "run"), tmp_path / "r.yaml")
    result = CliRunner().invoke(app, ["finetune", str(path), "--set", "train.lr=0.001"])
    assert result.exit_code == 130
    command = f"nha-retrofit finetune {path} --set train.lr=0.001"
    if saved:
        expected = (f"interrupted: the last checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step-00000004'}; "
                    f"continue with `{command} --resume`")
    else:
        expected = f"interrupted before the first checkpoint (one every 2 steps): nothing to resume, `{command} --overwrite`"
    assert expected in result.output and "Traceback" not in result.output
