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
