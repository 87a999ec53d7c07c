"""The layer plan on its own: full-layer selection and the `nha-retrofit plan` table, from a config dict (the plan
reads no files)."""

from nha_retrofit.plan import evenly_spaced, plan_table

CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
          "hidden_size": 48, "dtype": "float32"}


def test_evenly_spaced_full_layers():
    assert evenly_spaced(32, 4) == [3, 11, 19, 27]
    assert evenly_spaced(30, 30) == list(range(30))
    assert len(set(evenly_spaced(30, 7))) == 7


def test_plan_table_counts_parameters_and_cache_bytes():
    table = plan_table(CONFIG, full_layers=1, window=3, slots=5)
    # head dim 48 / 6 = 8; per layer 2 KV heads * 5 slots * 48 gate weights + 6 slot biases = 486 parameters; a full
    # layer caches 2 * 2 heads * 8 * 4 bytes = 128 B per token; an NHA layer 2*2*5*8*4 + 3*(2*(3*8*4 + 4*5) + 1) + 9
    assert "full attention at [1]" in table
    assert "| 0 | 3 | 5 | 486 | 1,348 B fixed |" in table
    assert "| 1 | full | - | 486 (unused) | 128 B per token |" in table
    assert table.splitlines()[-1] == (
        "new parameters: 1,944; cache per sequence: 128 B per token (full layers) + 4,044 B fixed (NHA layers); "
        "the original needs 512 B per token"
    )
