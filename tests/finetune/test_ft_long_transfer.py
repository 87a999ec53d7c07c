"""The LM stage's `transfer_weight` term: each NHA layer's output against the full attention of its own projections,
at the positions beyond its window, checked against a float64 reference built from the original attention layers;
its gradient; blocks no longer than a window; the recipe key; a training run with gradient checkpointing."""

import json

import pytest
import torch

from ft_helpers import save_recipe, tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.finetune import finetune, load_recipe
from nha_retrofit.finetune.stages import lm_loss, long_position_transfer
from tiny_models import tiny_nha_pair

WINDOWS = [3, None, 7, 1]


def reference_transfer(original, nha, ids) -> torch.Tensor:
    """Mean over NHA layers of the float64 squared error, beyond the layer's window, between its output and the
    original attention layer's output on the same input."""
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True) for i, layer in enumerate(nha.model.layers)]
    outputs = {}
    hooks += [layer.self_attn.register_forward_hook(lambda module, args, out, i=i: outputs.__setitem__(i, out[0]))
              for i, layer in enumerate(nha.model.layers)]
    with torch.no_grad():
        nha(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    errors = []
    for i, window in enumerate(WINDOWS):
        if window is None:
            continue
        with torch.no_grad():
            embeddings = original.model.rotary_emb(inputs[i], positions)
            target, _ = original.model.layers[i].self_attn(inputs[i], embeddings, None)
        error = (outputs[i].double() - target.double()).pow(2).mean(-1)[:, window:]
        errors.append(error.mean() if error.numel() else torch.zeros((), dtype=torch.float64))
    return torch.stack(errors).mean()


@pytest.mark.parametrize("length", [6, 19])
def test_lm_loss_adds_each_layers_error_beyond_its_window(length):
    original, nha = tiny_nha_pair(WINDOWS, slots=4, seed=3)
    nha.train()
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(length))
    plain, plain_metrics = lm_loss(nha, nha, ids)
    with long_position_transfer(nha) as modules:
        loss, metrics = lm_loss(nha, nha, ids, transfer_weight=0.7, transfer_modules=modules)
        loss.backward()
    expected = reference_transfer(original, nha, ids)
    assert expected.item() > 1e-6  # the slots and the window do change every layer's output
    assert "transfer" not in plain_metrics
    assert metrics["transfer"] == pytest.approx(expected.item(), rel=1e-4)
    assert loss.item() == pytest.approx(plain.item() + 0.7 * expected.item(), rel=1e-5)
    assert nha.model.layers[0].self_attn.g_proj.weight.grad.abs().sum() > 0
    assert all(m.attention_transfer is False and m.transfer_from == 0 for m in modules)  # restored on exit


def test_blocks_no_longer_than_every_window_add_zero():
    _, nha = tiny_nha_pair([5, None, 5, 5], slots=4, seed=1)
    nha.train()
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    plain, _ = lm_loss(nha, nha, ids)
    with long_position_transfer(nha) as modules:
        loss, metrics = lm_loss(nha, nha, ids, transfer_weight=2.0, transfer_modules=modules)
        loss.backward()
    assert metrics["transfer"] == 0.0 and loss.item() == pytest.approx(plain.item())


def test_recipe_key_and_a_run_with_gradient_checkpointing(tmp_path):
    model_path = write_tiny_original(tmp_path / "original")
    data = write_corpus(tmp_path / "corpus")
    recipe = tiny_recipe(model_path, data, tmp_path / "out", train={"gradient_checkpointing": True})
    recipe["stages"]["lm"].update(transfer_weight=0.5, ce_weight=0.0, distill_weight=0.0)
    path = save_recipe(recipe, tmp_path / "recipe.yaml")
    assert load_recipe(path).stages.lm.transfer_weight == 0.5
    with pytest.raises(NHARetrofitError, match="transfer_weight"):
        load_recipe(path, ["stages.lm.transfer_weight=0"])
    finetune(str(path), [], overwrite=True)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    transfers = [r["transfer"] for r in rows if r.get("stage") == "lm" and "transfer" in r]
    assert transfers and all(t > 0 for t in transfers)
