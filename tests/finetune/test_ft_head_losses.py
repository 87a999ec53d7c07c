"""Chunked head losses (cross-entropy and KL to the teacher a chunk of tokens at a time) against a float64 reference
on full logits, values and gradients; the same through a model's forward; the teacher's low-precision originals;
the memory projection of the Llama-3-8B recipe."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ft_helpers import byte_tokenizer, write_corpus, write_tiny_original, tiny_recipe
from nha_retrofit.finetune import finetune, load_recipe
from nha_retrofit.finetune.head_losses import chunked_head_losses

ROOT = Path(__file__).resolve().parents[2]


def reference_losses(hidden, weight, bias, targets, teacher, teacher_is_hidden, temperature):
    """Plain float64 cross-entropy and KL(teacher || student) x T^2 on the full [tokens x vocab] logits."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    ce = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    if teacher is None:
        return ce, torch.zeros((), dtype=torch.float64)
    reference = F.linear(teacher.double(), weight.double(), None if bias is None else bias.double()) \
        if teacher_is_hidden else teacher.double()
    student = F.log_softmax(logits / temperature, dim=-1).flatten(0, -2)
    target = F.log_softmax(reference / temperature, dim=-1).flatten(0, -2)
    kl = (target.exp() * (target - student)).sum(-1).mean()
    return ce, kl * temperature**2


@pytest.mark.parametrize("teacher_kind", ["none", "hidden", "logits"])
@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_losses_and_gradients_match_full_logits_in_float64(teacher_kind, chunk):
    gen = torch.Generator().manual_seed(3)
    batch, length, width, vocab, temperature = 2, 19, 12, 53, 1.7  # 38 tokens: chunks of 5 leave a partial one
    hidden = torch.randn(batch, length, width, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=gen) * 0.5).requires_grad_()
    bias = torch.randn(vocab, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    teacher = {"none": None, "hidden": torch.randn(batch, length, width, generator=gen),
               "logits": torch.randn(batch, length, vocab, generator=gen) * 2}[teacher_kind]
    is_hidden = teacher_kind != "logits"
    ce, kl = chunked_head_losses(hidden, weight, targets, teacher, bias=bias, teacher_is_hidden=is_hidden,
                                 temperature=temperature, chunk=chunk)
    ce_ref, kl_ref = reference_losses(hidden, weight, bias, targets, teacher, is_hidden, temperature)
    assert abs(ce.item() - ce_ref.item()) < 1e-5 and abs(kl.item() - kl_ref.item()) < 1e-5
    if teacher is not None:
        assert kl.item() > 0.05  # a real divergence, not a zero by construction
    mix = (0.7, 1.3)
    grads = torch.autograd.grad(mix[0] * ce + mix[1] * kl, (hidden, weight, bias))
    ref_grads = torch.autograd.grad(mix[0] * ce_ref + mix[1] * kl_ref, (hidden, weight, bias))
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    return write_tiny_original(root / "orig"), write_corpus(root / "data")


@pytest.mark.parametrize("trainable", ["attention", "full"])
def test_lm_loss_through_the_model_matches_full_logits_and_the_original_teacher(world, trainable):
    """lm_loss (head hooks, chunked) against CE and KL computed on full logits of the model and of the original
    model loaded independently, values and gradients; `full` trains the head, so the teacher hands over logits."""
    from transformers import AutoModelForCausalLM

    from nha_retrofit.finetune.model import load_model, resolve_source, select_trainable
    from nha_retrofit.finetune.stages import lm_loss, snapshot_teacher

    model_path, data = world
    spec = load_recipe(tiny_recipe(model_path, data, "unused", train={"trainable": trainable}))
    model = select_trainable(load_model(resolve_source(spec.model)), spec.train)
    snapshot_teacher(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)  # the student has moved away from the original
    ids = torch.randint(0, 257, (2, 23), generator=gen)
    loss, metrics = lm_loss(model, model, ids, ce_weight=0.6, distill_weight=1.4, temperature=2.0)
    trained = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, trained, materialize_grads=True)

    original = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad():
        reference = original(input_ids=ids).logits[:, :-1].double()
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    student, target = F.log_softmax(logits / 2, -1), F.log_softmax(reference / 2, -1)
    kl = (target.exp() * (target - student)).sum(-1).mean() * 4
    expected = torch.autograd.grad(0.6 * ce + 1.4 * kl, trained, materialize_grads=True)
    assert abs(metrics["ce"] - ce.item()) < 1e-5 and abs(metrics["kl"] - kl.item()) < 1e-5 and kl.item() > 1e-3
    assert abs(loss.item() - (0.6 * ce + 1.4 * kl).item()) < 1e-5
    for got, want in zip(grads, expected):
        assert (got.double() - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item())


def test_teacher_keeps_bf16_originals_only_when_exact(world):
    from nha_retrofit.finetune.model import load_model, resolve_source, select_trainable
    from nha_retrofit.finetune.stages import snapshot_teacher, teacher_mode

    model_path, data = world
    spec = load_recipe(tiny_recipe(model_path, data, "unused"))
    model = select_trainable(load_model(resolve_source(spec.model)), spec.train).eval()
    q = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():  # a bf16 checkpoint's values, except one projection
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        q.add_(1e-4)
    ids = torch.randint(0, 257, (1, 30), generator=torch.Generator().manual_seed(0))

    def teacher_logits():
        with teacher_mode(model):
            exact = model(input_ids=ids, use_cache=False).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return exact, model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        before = teacher_logits()
    kept = snapshot_teacher(model, torch.bfloat16)
    dtypes = {p.data_ptr(): saved.dtype for p, saved in model._nha_teacher_originals}
    assert dtypes[q.data_ptr()] == torch.float32 and list(dtypes.values()).count(torch.float32) == 1
    assert kept == sum(p.numel() for p, _ in model._nha_teacher_originals) and len(dtypes) > 1
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
        after = teacher_logits()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])  # fp32, and bf16 autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trained values came back
    assert abs(model.model.layers[0].self_attn.k_proj.weight[0, 0].item() - 0.1 -
               model._nha_teacher_originals[1][1][0, 0].float().item()) < 1e-6


def test_memory_projection_of_the_llama3_recipe_at_its_real_size(tmp_path, monkeypatch):
    """The 8B recipe's dry run on a weightless Llama-3-8B (config only): parameter counts and the projection's
    terms, computed here by hand."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from convert_large import LLAMA3_8B

    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    byte_tokenizer().save_pretrained(folder)
    data = write_corpus(tmp_path / "data")
    recipe = ROOT / "recipes" / "llama3_10b.yaml"
    overrides = [f"model.path={folder}", f"data.files=[{data}/*.txt]", "data.dataset=null", "data.eval_blocks=1",
                 "data.seq_len=64", "data.long.seq_len=0", f"train.output_dir={tmp_path / 'run'}"]
    plan = finetune(recipe, overrides, dry_run=True, log=lambda *_: None)
    full = 5  # the default count, one layer in six; a weightless model cannot be probed, so they are placed evenly
    gates = (4096 + 1) * 8 * 64  # the gate projection and its bias (the recipe's gate_bias_init)
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + gates + 32  # q, o, k, v, gates, slot offsets
    trainable, total = (32 - full) * per_layer, 8_030_261_248 + 32 * (gates + 32)
    assert plan["trainable_parameters"] == trainable and plan["total_parameters"] == total
    memory, gib = plan["memory_per_gpu_gib"], 2**30
    assert memory["sharding"] == "none" and memory["processes"] == 1
    fp32 = trainable + 128256 * 4096 + 65 * 4096 + full * 32  # trained, the embedding, norms, full layers' offsets
    weights = 2 * (total - fp32) + 4 * fp32  # frozen matrices stay bf16
    assert memory["weights"] == round(weights / gib, 2)
    assert memory["optimizer"] == round(8 * trainable / gib, 2) and memory["gradients"] == round(4 * trainable / gib, 2)
    teacher = (32 - full) * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert memory["teacher_originals"] == round(2 * teacher / gib, 2)
    # checkpointed layer inputs: 4 blocks x 64 tokens x 32 layers x 4096 x 2 bytes, plus one layer's internals
    assert memory["activations"] > 4 * 64 * 32 * 4096 * 2 / gib
    parts = ("weights", "gradients", "optimizer", "teacher_originals", "activations", "head_losses")
    assert abs(memory["total"] - sum(memory[k] for k in parts)) < 0.05 and 34 < memory["total"] < 36

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as `accelerate launch --config_file fsdp.yaml` sets them
    monkeypatch.setenv("WORLD_SIZE", "8")
    sharded = finetune(recipe, overrides, dry_run=True, log=lambda *_: None)["memory_per_gpu_gib"]
    assert sharded["sharding"] == "fsdp" and sharded["processes"] == 8
    gathered = 2 * 2 * total / 32  # two decoder layers' weights in bf16
    assert sharded["weights"] == round((weights / 8 + gathered) / gib, 2)
    assert sharded["optimizer"] == round(8 * trainable / 8 / gib, 2)
    assert sharded["teacher_originals"] == round(4 * teacher / 8 / gib, 2)  # fp32 shards, swapped in place
    assert sharded["activations"] == memory["activations"] and sharded["total"] < memory["total"] / 3


@pytest.mark.parametrize("converted", [False, True])
def test_frozen_matrices_kept_in_bf16_compute_what_fp32_weights_compute(tmp_path, converted):
    """A bf16 checkpoint trained under bf16 autocast: frozen matrices stay bf16 (autocast casts them to bf16 at every
    use anyway), everything else is fp32 (norms and embeddings keep the residual stream in fp32): the same logits
    and gradients as with every weight in fp32, at a fraction of the memory."""
    from transformers import AutoModelForCausalLM

    from nha_retrofit.finetune.model import fp32_except_frozen_matrices, load_model, resolve_source, select_trainable

    folder = write_tiny_original(tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    byte_tokenizer().save_pretrained(tmp_path / "bf16")
    spec = load_recipe(tiny_recipe(tmp_path / "bf16", tmp_path, "unused"))
    if converted:  # a converted checkpoint, rather than the original converted on the fly
        from nha_retrofit.conversion import convert
        from nha_retrofit.plan import PlanSpec

        convert(str(tmp_path / "bf16"), tmp_path / "nha", PlanSpec(select="even", full_layers=1, window=4, slots=4),
                log=lambda *_: None)
        spec.model.path, spec.model.convert = str(tmp_path / "nha"), None
    source = resolve_source(spec.model)
    reference = select_trainable(load_model(source, torch.float32), spec.train)
    lean = fp32_except_frozen_matrices(select_trainable(load_model(source, torch.bfloat16), spec.train))
    dtypes = {name: p.dtype for name, p in lean.named_parameters()}
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == torch.bfloat16  # a full layer's: frozen
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    assert all(b.dtype == torch.float32 for b in lean.buffers())  # RoPE frequencies
    ids = torch.randint(0, 257, (2, 21), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (reference, lean):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        grads = torch.autograd.grad(logits.float().square().mean(), [p for p in model.parameters() if p.requires_grad])
        results.append((logits, grads))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_held_out_evaluation_shows_progress_and_gives_the_same_numbers(capsys):
    """The evaluation before training ran for minutes on the CPU without a line: it now shows a bar per model."""
    from nha_retrofit.finetune.stages import evaluate_blocks
    from tiny_models import TINY_LLAMA, tiny_nha_pair

    _, nha = tiny_nha_pair([3, None, 0, 2])
    blocks = torch.randint(0, TINY_LLAMA["vocab_size"], (5, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quiet = evaluate_blocks(nha, blocks, 2)
        assert capsys.readouterr().err == ""
        shown = evaluate_blocks(nha, blocks, 2, progress=True)
        original = evaluate_blocks(nha, blocks, 2, teacher=True, progress=True)
    assert shown == quiet and quiet["eval_kl"] > 0 and original["eval_ce"] != quiet["eval_ce"]
    bars = capsys.readouterr().err
    assert "held-out blocks:   0%| " in bars and "held-out blocks, original:   0%| " in bars and "0/3" in bars
