"""`kernels/config.py`: the variants name real settings (plain Python data: runs without Triton or a GPU)."""

import pytest

from nha_retrofit.kernels import config


def test_config_variants_name_known_settings():
    """Every variant overrides existing CONFIG entries (a typo would silently time the defaults), and FORWARD_KEYS
    (which variants ops.py times forward-only) names existing entries."""
    for name, overrides in config.CONFIG_VARIANTS.items():
        assert set(overrides) <= set(config.CONFIG), name
    assert config.FORWARD_KEYS <= set(config.CONFIG)
    assert config.variant_overrides("fwd_block16+slot_bwd_block8") == dict(fwd_block=16, slot_bwd_block=8)
    with pytest.raises(KeyError, match="unknown kernel variant"):
        config.variant_overrides("defaults+no_such_variant")


@pytest.mark.parametrize("longest,chunks,segment", [
    (64, 1, None), (64, 128, None), (64, 255, None), (64, 256, 16), (64, 511, 16), (64, 512, 32), (64, 1023, 32),
    (64, 1024, 64), (64, 4096, 64), (32, 1024, 32), (32, 4096, 32), (32, 512, 32), (32, 256, 16)])
def test_auto_state_segment_leaves_16_segments_of_16_to_longest_chunks(longest, chunks, segment, monkeypatch):
    """"auto" (the default): the longest segment of at most CONFIG["state_segment_longest"] chunks (64 by default) that
    leaves 16 segments, none (the states scanned whole) where that would be shorter than 16 chunks; a number is taken
    as given."""
    monkeypatch.setitem(config.CONFIG, "state_segment", "auto")
    monkeypatch.setitem(config.CONFIG, "state_segment_longest", longest)
    assert config.state_segment(chunks) == segment
    monkeypatch.setitem(config.CONFIG, "state_segment", 3)
    assert config.state_segment(chunks) == 3
