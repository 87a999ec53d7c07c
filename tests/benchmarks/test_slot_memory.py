"""benchmarks/slot_memory.py: each NHA layer's slot timescales, 1 / mean(-log alpha) per slot, against a float64
computation from the layer's own input, and what a gate bias does to them."""

import torch
import torch.nn.functional as F

from nha_retrofit.conversion import convert
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.plan import PlanSpec
from slot_memory import slot_timescales, summary


def reference_timescales(model, ids, layer: int) -> torch.Tensor:
    """From the hidden states entering `layer`, normed as its attention sees them, in float64."""
    attention = model.model.layers[layer].self_attn
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[layer]
        x = model.model.layers[layer].input_layernorm(hidden).double()
    gates = x @ attention.g_proj.weight.double().T
    if attention.g_proj.bias is not None:
        gates = gates + attention.g_proj.bias.double()
    log_alpha = F.logsigmoid(gates.unflatten(-1, (attention.num_kv_heads, attention.num_slots))) / \
        attention.gate_normalizer
    return (1 / -log_alpha.mean(dim=(0, 1))).flatten()


def test_timescales_match_float64_and_a_gate_bias_lengthens_them(tiny_llama_folder, tmp_path):
    ids = torch.randint(3, 128, (1, 57), generator=torch.Generator().manual_seed(4))
    medians = []
    for name, bias in (("plain", None), ("biased", 3.0)):
        spec = PlanSpec(select="even", full_layers=1, window=3, slots=5, gate_bias_init=bias)
        model = load_nha_checkpoint(convert(tiny_llama_folder, tmp_path / name, spec, log=lambda *_: None)).eval()
        timescales = slot_timescales(model, ids)
        assert sorted(timescales) == [i for i, w in enumerate(model.config.nha_windows) if w is not None]
        for layer, values in timescales.items():
            expected = reference_timescales(model, ids, layer)
            torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), expected, rtol=1e-5, atol=0)
        medians.append([summary(values)["median"] for values in timescales.values()])
    assert all(biased > 5 * plain for plain, biased in zip(*medians))  # sigmoid(g + 3) keeps alpha far nearer 1
