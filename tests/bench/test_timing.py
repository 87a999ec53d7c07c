"""The decode A/B of the benchmark scripts (`decode_arms`): every arm timed in every round, in alternating order, and
each arm's first-step logits compared with the first arm's."""

import contextlib
from unittest import mock

import torch

from nha_retrofit.bench.decoders import NHA, StaticDecoder
from nha_retrofit.bench.timing import Clock, decode_arms
from nha_retrofit.modeling import nha_cache
from nha_retrofit.modeling.nha_cache import attend_stored
from tiny_models import tiny_nha_pair


def test_decode_arms_times_each_arm_every_round_and_compares_their_first_steps():
    _, model = tiny_nha_pair([4, None, 3, 5], full_kv_heads=[[1], [], [], []])
    calls = []

    def halved_read(query, keys, values, real, scale):  # a different read: its logits must differ from the first
        calls.append(query.shape)
        return attend_stored(query, keys, values, real, scale) * 0.5

    arms = {"shipped": contextlib.nullcontext,
            "halved": lambda: mock.patch.object(nha_cache, "attend_stored", halved_read)}
    decoder = StaticDecoder(NHA, model)
    with torch.no_grad():
        record = decode_arms(decoder, 9, arms, rounds=3, steps=2, clock=Clock(model.device), log=lambda _: None)
    assert record["context"] == 9 and all(len(record["rounds"][name]) == 3 for name in arms)
    assert all(record[name]["min"] <= record[name]["median"] <= record[name]["max"] for name in arms)
    assert calls, "the patched read ran inside the halved arm's steps"
    assert list(record["first_step_logits"]) == ["halved"]
    compared = record["first_step_logits"]["halved"]
    assert compared["max_abs_difference"] > 1e-3 and compared["max_abs"] > 0
