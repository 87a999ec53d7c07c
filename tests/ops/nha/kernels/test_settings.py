"""`ops/nha/kernels/settings.py`: frozen launch settings by device capability, and the shapes derived from them (plain
Python: no Triton or GPU needed)."""

import dataclasses

import pytest
import torch

from nha_retrofit.ops.nha.kernels import settings


def test_settings_are_frozen_and_chosen_by_capability(monkeypatch):
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.HOPPER.forward.warps = 4
    assert settings.settings_for("cpu") is settings.HOPPER
    for major, want in ((9, settings.HOPPER), (10, settings.HOPPER), (8, settings.EARLIER)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert settings.settings_for("cuda:0") is want
    assert settings.EARLIER.forward.stages == settings.HOPPER.forward.stages - 1


@pytest.mark.parametrize("longest,chunks,segment", [
    (64, 1, None), (64, 128, None), (64, 255, None), (64, 256, 16), (64, 511, 16), (64, 512, 32), (64, 1023, 32),
    (64, 1024, 64), (64, 4096, 64), (32, 1024, 32), (32, 4096, 32), (32, 512, 32), (32, 256, 16)])
def test_state_segment_leaves_16_segments_of_16_to_longest_chunks(longest, chunks, segment):
    """The longest segment of at most `segment_longest` chunks that leaves 16 segments; none (the states scanned
    whole) where that would be shorter than 16 chunks."""
    forward = dataclasses.replace(settings.HOPPER.forward, segment_longest=longest)
    assert settings.state_segment(chunks, dataclasses.replace(settings.HOPPER, forward=forward)) == segment


@pytest.mark.parametrize("groups,block,training_chunk,inference_chunk", [
    (1, 32, 32, 64), (2, 32, 32, 64), (3, 32, 32, 32), (4, 32, 32, 32), (8, 16, 32, 32), (16, 8, 32, 32)])
def test_query_blocks_fill_128_rows_and_chunks_follow(groups, block, training_chunk, inference_chunk):
    """Forward blocks of 128 rows (tokens x query heads per kv head) within a 32-token training chunk; without a
    backward 64-token chunks only where one query block fills them."""
    s = settings.HOPPER
    assert settings.forward_block(groups, 32, s) == block
    assert settings.chunk_tokens(groups, True, s) == training_chunk
    assert settings.chunk_tokens(groups, False, s) == inference_chunk
