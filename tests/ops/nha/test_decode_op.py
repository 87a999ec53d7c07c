"""The Triton decode step as a torch.library custom op: its schema declares the state it updates in place, its fake
implementation gives the output's shape without running a kernel, and torch.export traces a decode step through it
as one op (no graph break). The kernel itself is compared with the PyTorch step on CUDA."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nha_retrofit.ops.nha.decode_op import STATE_ARGUMENTS, decode_step, nha_decode_step
from nha_retrofit.ops.nha.recurrent_torch import nha_recurrent_step
from nha_retrofit.ops.nha.state import NHAState

BATCH, KV_HEADS, Q_HEADS, DIM, VALUE_DIM, SLOTS, WINDOW = 2, 2, 4, 16, 8, 8, 4


def inputs(device="cpu", dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q, q_rope = draw(BATCH, 1, Q_HEADS, DIM), draw(BATCH, 1, Q_HEADS, DIM)
    k, k_rope, v = draw(BATCH, 1, KV_HEADS, DIM), draw(BATCH, 1, KV_HEADS, DIM), draw(BATCH, 1, KV_HEADS, VALUE_DIM)
    gates = draw(BATCH, 1, KV_HEADS, SLOTS)
    return q, k, v, q_rope, k_rope, gates


def test_the_schema_declares_the_state_mutated_and_nothing_else():
    schema = torch.ops.nha_retrofit.decode_step.default._schema
    mutated = {argument.name for argument in schema.arguments if argument.alias_info and argument.alias_info.is_write}
    assert mutated == set(STATE_ARGUMENTS) and len(schema.returns) == 1


def test_the_fake_implementation_gives_the_output_shape_without_a_kernel():
    with FakeTensorMode():
        q, k, v, q_rope, k_rope, gates = inputs()
        out, state = nha_decode_step(q, k, v, q_rope, k_rope, gates, WINDOW, DIM**-0.5, gate_normalizer=8.0)
    assert out.shape == (BATCH, 1, Q_HEADS, VALUE_DIM) and out.dtype == torch.float32
    assert state.window_keys.shape == (BATCH, WINDOW, KV_HEADS, DIM)


class DecodeLayer(torch.nn.Module):
    """One decode step on a state held as buffers, as a static cache holds it."""

    def __init__(self):
        super().__init__()
        state = NHAState.empty(BATCH, KV_HEADS, SLOTS, DIM, VALUE_DIM, torch.float32, "cpu").for_decoding(WINDOW)
        for name, tensor in zip(STATE_ARGUMENTS, state.tensors()):
            self.register_buffer(name, tensor)

    def forward(self, q, k, v, q_rope, k_rope, gates):
        state = [getattr(self, name) for name in STATE_ARGUMENTS]
        return decode_step(q, k, v, q_rope, k_rope, gates, *state, None, None, WINDOW, DIM**-0.5, 8.0) * 2


def test_export_traces_a_decode_step_through_the_op():
    program = torch.export.export(DecodeLayer(), inputs(), strict=False)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert any("nha_retrofit.decode_step" in target for target in targets), targets
    assert any("mul" in target for target in targets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_the_op_equals_the_pytorch_step_on_cuda():
    q, k, v, q_rope, k_rope, gates = inputs("cuda")
    state = NHAState.empty(BATCH, KV_HEADS, SLOTS, DIM, VALUE_DIM, torch.float32, "cuda")
    out, state = nha_decode_step(q, k, v, q_rope, k_rope, gates, WINDOW, DIM**-0.5, state=state, gate_normalizer=8.0)
    expected, _ = nha_recurrent_step(q, k, v, q_rope, k_rope, gates, WINDOW, DIM**-0.5,
                                     state=NHAState.empty(BATCH, KV_HEADS, SLOTS, DIM, VALUE_DIM, torch.float32,
                                                          "cuda"), gate_normalizer=8.0)
    assert (out - expected).abs().max() <= 1e-4
