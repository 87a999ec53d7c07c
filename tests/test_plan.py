"""The layer plan on its own: full-layer selection and the `nha-retrofit plan` table, from a config dict (the plan
reads no files)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.plan import PlanSpec, PlanSpecError, build_plan, evenly_spaced, plan_table

CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
          "hidden_size": 48, "dtype": "float32"}


def test_evenly_spaced_full_layers():
    assert evenly_spaced(32, 4) == [3, 11, 19, 27]
    assert evenly_spaced(30, 30) == list(range(30))
    assert len(set(evenly_spaced(30, 7))) == 7


def test_plan_table_counts_parameters_and_cache_bytes():
    table = plan_table(CONFIG, PlanSpec(select="even", full_layers=1, window=3, slots=5, gate_bias_init=None))
    # head dim 48 / 6 = 8; per layer 2 KV heads * 5 slots * 48 gate weights + 6 slot biases = 486 parameters; a full
    # layer caches 2 * 2 heads * 8 * 4 bytes = 128 B per token; an NHA layer 2*2*5*8*4 + 3*(2*(3*8*4 + 4*5) + 1) + 9
    assert "full attention at [1]" in table
    assert "| 0 | 3 | 5 | - | 486 | 1,348 B fixed |" in table
    assert "| 1 | full | - | all | 486 (unused) | 128 B per token |" in table
    assert table.splitlines()[-1] == (
        "new parameters: 1,944; cache per sequence: 128 B per token (full layers and heads) + 4,044 B fixed (NHA "
        "layers); the original needs 512 B per token"
    )


def test_plan_table_counts_full_kv_heads_per_token_and_the_rest_as_state():
    table = plan_table(CONFIG, PlanSpec(full_kv_head_ids=[(2, 1), (0, 0)], window=3, slots=5, gate_bias_init=None))
    # one KV head of two per token: 2 * 8 * 4 = 64 B; the other head's state 1*5*8*4*2 + 3*(1*(3*8*4 + 4*5) + 1) + 9
    assert "full attention at none; full KV heads (layer:head) 0:0, 2:1;" in table
    assert "| 0 | 3 | 5 | 0 | 486 | 680 B fixed + 64 B per token |" in table
    assert "| 1 | 3 | 5 | - | 486 | 1,348 B fixed |" in table
    assert "cache per sequence: 128 B per token (full layers and heads) + 4,056 B fixed" in table


def test_full_kv_heads_follow_the_ranking_skip_full_layers_and_fill_a_layer_to_full():
    ranking = [(1, 0), (3, 1), (1, 1), (0, 1), (2, 0)]
    plan = build_plan(4, PlanSpec(full_layer_ids=[3], full_kv_heads=3, window=2), head_ranking=ranking, kv_heads=2)
    assert plan.windows == (2, None, 2, None)  # layer 1 got both of its heads: a full layer
    assert plan.full_kv_heads == ((1,), (), (), ()) and plan.full_kv_head_pairs == [(0, 1)]
    assert plan.config_fields()["nha_full_kv_heads"] == [[1], [], [], []]
    spec = PlanSpec(full_kv_heads=3)
    assert spec.full_layer_count(4) == 0 and spec.needs_ranking and spec.needs_head_ranking
    even = build_plan(6, PlanSpec(full_kv_heads=8, select="even"), kv_heads=3)
    assert even.full_kv_head_pairs == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0)]
    assert build_plan(4, PlanSpec(select="even")).full_kv_heads is None


def test_the_default_keeps_the_cache_of_one_layer_in_six_as_the_probes_kv_heads_or_whole_layers_without_it():
    """Nothing named: 12 layers of 2 KV heads keep 2 layers' worth, the probe's first 4 heads; without its head
    ranking (no weights to probe) or with another `select`, 2 whole layers; anything named turns the default off."""
    ranking = [(5, 1), (7, 0), (5, 0), (2, 1), (9, 0)]
    spec = PlanSpec(window=8)
    assert spec.uses_default_full_set and spec.needs_ranking and not spec.needs_head_ranking
    plan = build_plan(12, spec, ranking=list(range(11, -1, -1)), head_ranking=ranking, kv_heads=2)
    assert plan.full_layer_ids == [5] and plan.full_kv_head_pairs == [(2, 1), (7, 0)]  # layer 5 got both heads
    assert build_plan(12, spec, ranking=list(range(11, -1, -1)), kv_heads=2).full_layer_ids == [10, 11]
    assert build_plan(12, PlanSpec(select="even"), head_ranking=ranking, kv_heads=2).full_layer_ids == [2, 8]
    for named in ({"full_layers": 2}, {"full_layer_ids": [0]}, {"full_kv_heads": 1}, {"windows": [8] * 12}):
        assert not PlanSpec(**named).uses_default_full_set
    assert build_plan(12, PlanSpec(full_layers=3), ranking=list(range(12)), head_ranking=ranking,
                      kv_heads=2).full_kv_heads is None


@pytest.mark.parametrize("spec, message", [
    (PlanSpec(full_kv_heads=9, select="even"), "--full-kv-heads 9: the NHA layers have 8 KV heads"),
    (PlanSpec(full_kv_head_ids=[(4, 0)]), "--full-kv-head-ids (4, 0): out of range"),
    (PlanSpec(full_kv_head_ids=[(0, 2)]), "--full-kv-head-ids (0, 2): out of range"),
    (PlanSpec(full_layer_ids=[0], full_kv_head_ids=[(0, 1)]), "layer 0 is a full layer already"),
    (PlanSpec(full_kv_heads=2), "ranks heads by probing the model's weights"),
])
def test_build_plan_refuses_full_kv_heads_that_cannot_be_placed(spec, message):
    with pytest.raises(NHARetrofitError, match=re.escape(message)):
        build_plan(4, spec, kv_heads=2)


def test_a_gate_bias_adds_one_parameter_per_slot_and_is_written_into_the_config():
    spec = PlanSpec(select="even", full_layers=1, window=3, slots=5, gate_bias_init=4.0)
    table = plan_table(CONFIG, spec)
    assert "slot bias init -4, gate bias init 4)" in table
    assert "| 0 | 3 | 5 | - | 496 | 1,348 B fixed |" in table  # 486 + 2 KV heads * 5 slots; the cache does not change
    assert build_plan(4, spec).config_fields()["nha_gate_bias_init"] == 4.0
    assert build_plan(4, PlanSpec(select="even")).config_fields()["nha_gate_bias_init"] == 8.0  # the default
    no_bias = PlanSpec(select="even", full_layers=1, gate_bias_init=None)
    assert build_plan(4, no_bias).config_fields()["nha_gate_bias_init"] is None
    assert "gate bias" not in plan_table(CONFIG, no_bias)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(slots=0), "--slots 0: at least one slot is needed"),
        (dict(window=-1), "--window -1: a window is an integer >= 0"),
        (dict(gate_normalizer=0.0), "--gate-normalizer 0: must be > 0"),
        (dict(select="middle"), "--select middle: choose one of retrieval, even, first, last"),
        (dict(full_layers=-2), "--full-layers -2: must be >= 0"),
        (dict(full_layer_ids=[3, 1, 3]), "--full-layer-ids 3: listed more than once"),
        (dict(full_layer_ids=[-1]), "--full-layer-ids -1: layer ids start at 0"),
        (dict(windows=[4, None, -2]), "--windows entry 2 is -2: a window is >= 0 or 'full'"),
        (dict(full_kv_heads=-1), "--full-kv-heads -1: must be >= 0"),
        (dict(full_kv_head_ids=[(1, 0), (1, 0)]), "--full-kv-head-ids lists a head more than once"),
        (dict(full_kv_head_ids=[(1, -1)]), "--full-kv-head-ids takes (layer, KV head) pairs of ids >= 0"),
    ],
)
def test_plan_spec_refuses_impossible_values_naming_the_field(fields, message):
    with pytest.raises(PlanSpecError) as caught:
        PlanSpec(**fields)
    assert str(caught.value) == message and caught.value.field == next(iter(fields))


def test_build_plan_precedence_and_the_checks_that_need_the_layer_count():
    spec = PlanSpec(full_layer_ids=[5, 0], window=7, slots=3, gate_normalizer=2.0, slot_bias_init=-1.0)
    assert spec.full_layer_ids == (5, 0) and spec.full_layers == 2  # the count follows the ids
    plan = build_plan(6, spec)
    assert plan.windows == (None, 7, 7, 7, 7, None) and plan.num_slots == 3
    assert (plan.gate_normalizer, plan.slot_bias_init) == (2.0, -1.0)
    assert build_plan(6, PlanSpec(full_layers=2, select="last", window=3)).windows == (3, 3, 3, 3, None, None)
    windows = build_plan(3, PlanSpec(windows=[1, None, 0], full_layers=3)).windows  # explicit windows win
    assert windows == (1, None, 0)
    for spec, message in [(PlanSpec(full_layer_ids=[6]), "--full-layer-ids 6: out of range, the model has layers 0..5"),
                          (PlanSpec(select="even", full_layers=7), "--full-layers 7: must be between 0 and 6"),
                          (PlanSpec(windows=[1, 2]), "--windows has 2 entries; the model has 6 layers")]:
        with pytest.raises(PlanSpecError, match=re.escape(message)):
            build_plan(6, spec)


CHANGED_DEFAULTS = """
import dataclasses, inspect, json, sys
from pathlib import Path
import nha_retrofit.plan as plan

@dataclasses.dataclass(frozen=True)
class Changed(plan.PlanSpec):  # as if the defaults were edited in plan.py
    full_layers: int = 1
    select: str = "last"
    window: int = 5
    slots: int = 3
    gate_normalizer: float = 2.0
    slot_bias_init: float = -1.0

plan.PlanSpec = Changed
from typer.testing import CliRunner
from nha_retrofit.cli import app, plan_spec
from nha_retrofit.eval.layer_search import search_full_layers
from nha_retrofit.finetune.model import resolve_source
from nha_retrofit.finetune.recipe import load_recipe

source, out = Path(sys.argv[1]), Path(sys.argv[2])
helps = {verb: CliRunner().invoke(app, [verb, "--help"], env={"COLUMNS": "200"}).output
         for verb in ("convert", "plan", "bench", "search")}
printed = CliRunner().invoke(app, ["plan", str(source)]).output
converted = CliRunner().invoke(app, ["convert", str(source), "-o", str(out)])
recipe = load_recipe({"model": {"path": str(source), "convert": {}}, "data": {"files": ["a.txt"]},
                      "stages": {"lm": {"tokens": 1}}})
print(json.dumps({
    "helps": helps, "plan": printed, "convert_code": converted.exit_code,
    "config": json.loads((out / "config.json").read_text()),
    "recipe_convert": recipe.model.convert == Changed(),
    "recipe_plan": resolve_source(recipe.model).plan.windows,
    "cli_spec": plan_spec() == Changed(),
    "search_spec": inspect.signature(search_full_layers).parameters["spec"].default == Changed(),
}))
"""


def test_every_verb_and_the_recipe_take_their_plan_defaults_from_plan_spec(tiny_llama_folder, tmp_path):
    """Changing PlanSpec's defaults changes what convert, plan, bench, search and the recipe do and show: they hold
    no default of their own (a fresh process, so every module imports the changed class)."""
    result = subprocess.run([sys.executable, "-c", CHANGED_DEFAULTS, str(tiny_llama_folder), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    for verb, help_page in seen["helps"].items():
        text = " ".join(help_page.split())  # wherever the help wraps its lines
        assert "[default: (5)]" in text and "[default: (3)]" in text and "(64)" not in text, verb
    assert "| 3 | full |" in seen["plan"] and "window 5, 3 slots, gate normalizer 2, slot bias init -1" in seen["plan"]
    assert seen["convert_code"] == 0
    config = seen["config"]
    assert config["nha_windows"] == [5, 5, 5, None] and config["nha_num_slots"] == 3
    assert (config["nha_gate_normalizer"], config["nha_slot_bias_init"]) == (2.0, -1.0)
    assert seen["recipe_convert"] and seen["recipe_plan"] == [5, 5, 5, None]
    assert seen["cli_spec"] and seen["search_spec"]

