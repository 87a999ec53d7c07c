"""The finetuning loop on tiny random models: stages, trainable sets, resume, export, bad input."""

import json

import pytest
import torch

from ft_helpers import tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.finetune import finetune, load_recipe
from nha_retrofit.finetune.checkpoints import list_checkpoints

quiet = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    return write_tiny_original(root / "orig"), write_corpus(root / "data")


def losses(folder):
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["stage"], r["loss"]) for r in lines if "loss" in r]


def state_dict(folder):
    from nha_retrofit.modeling.load import load_nha_checkpoint

    return load_nha_checkpoint(folder).state_dict()


def test_attention_stage_trains_only_nha_attention_and_exports(world, tmp_path):
    model, data = world
    summary = finetune(tiny_recipe(model, data, tmp_path / "run"), **quiet)
    assert summary["steps"] == 6 and summary["tokens"] == 384
    stages = [s for _, s, _ in losses(tmp_path / "run")]
    assert stages == ["attention_transfer"] * 2 + ["lm"] * 4
    exported = tmp_path / "run" / "model"
    record = json.loads((exported / "nha_conversion.json").read_text())
    assert record["finetune"]["tokens"] == 384 and record["plan"]["windows"] == [4, None, 4, 4]
    assert record["finetune"]["after"]["eval_ppl"] > 0 and record["source_path"] == str(model)
    assert (exported / "modeling_nha.py").is_file() and (exported / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model).state_dict()
    trained = state_dict(exported)
    changed = {k for k in original if not torch.equal(original[k], trained[k])}
    assert changed, "nothing was trained"
    assert all(k.startswith(("model.layers.0.self_attn", "model.layers.2.", "model.layers.3.")) for k in changed)
    assert all(".self_attn." in k and "layers.1." not in k for k in changed)  # FFN, norms, full layer 1 frozen
    assert not list((tmp_path / "run").glob("**/.tmp-*"))


def test_gates_only_with_checkpointing_and_bf16(world, tmp_path):
    model, data = world
    recipe = tiny_recipe(model, data, tmp_path / "run",
                         train={"trainable": "gates", "gradient_checkpointing": True, "precision": "bf16"})
    finetune(recipe, **quiet)
    from nha_retrofit.finetune.model import load_model, resolve_source

    start = load_model(resolve_source(load_recipe(recipe).model)).state_dict()
    trained = state_dict(tmp_path / "run" / "model")
    changed = {k for k in start if not torch.equal(start[k], trained[k])}
    assert changed and all(k.endswith(("g_proj.weight", "g_proj.bias", "slot_bias")) for k in changed)


def test_lora_merges_into_plain_checkpoint(world, tmp_path):
    model, data = world
    recipe = tiny_recipe(model, data, tmp_path / "run", train={"trainable": "lora", "lr": 1e-2, "lora": {"r": 2}})
    finetune(recipe, **quiet)
    exported = tmp_path / "run" / "model"
    trained = state_dict(exported)
    assert not any("lora" in k for k in trained)
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert not torch.equal(original["model.layers.0.self_attn.q_proj.weight"], trained["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(original["model.layers.1.self_attn.q_proj.weight"], trained["model.layers.1.self_attn.q_proj.weight"])
    loaded = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    out = loaded.generate(torch.tensor([[65, 66, 67]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("trainable", ["lora", "attention", "full"])
def test_teacher_is_the_original_model(world, trainable):
    """All windows full + adapters disabled + original values of trained weights swapped in reproduces the original
    logits, however far training moved the weights."""
    from transformers import AutoModelForCausalLM

    from nha_retrofit.finetune.model import load_model, resolve_source, select_trainable
    from nha_retrofit.finetune.stages import snapshot_teacher, teacher_mode

    model_path, data = world
    spec = load_recipe(tiny_recipe(model_path, data, "unused", train={"trainable": trainable}))
    torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator
    model = select_trainable(load_model(resolve_source(spec.model)), spec.train).eval()
    kept = snapshot_teacher(model)
    assert (kept == 0) == (trainable == "lora")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or "q_proj" in name or "mlp" in name):
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    ids = torch.randint(0, 256, (2, 40), generator=generator)
    original = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad(), teacher_mode(model):
        teacher = model(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        student = model(input_ids=ids, use_cache=False).logits
        reference = original(input_ids=ids).logits
    assert (teacher - reference).abs().max() < 1e-5
    assert (student - reference).abs().max() > 1e-3
    assert [m.window for m in model.modules() if hasattr(m, "g_proj")] == [4, None, 4, 4]


def test_zero3_trains_parameters_of_one_dtype(world):
    """DeepSpeed flattens each parameter group into one buffer of one dtype: peft's fp32 LoRA weights beside a bf16
    model's gates must be cast to the compute dtype, the frozen weights left as loaded."""
    from nha_retrofit.finetune.model import load_model, resolve_source, select_trainable, trainable_in

    model_path, data = world
    spec = load_recipe(tiny_recipe(model_path, data, "unused", train={"trainable": "lora"}))
    model = select_trainable(load_model(resolve_source(spec.model), torch.bfloat16), spec.train)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {p.dtype for p in trained.values()} == {torch.float32, torch.bfloat16}  # what DeepSpeed rejects
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in trained.items() if p.dtype == torch.float32}
    trainable_in(model, torch.bfloat16)
    parameters = dict(model.named_parameters())
    assert {parameters[n].dtype for n in trained} == {torch.bfloat16}
    assert all(parameters[n].dtype == p.dtype and torch.equal(parameters[n], p) for n, p in frozen.items())
    assert all(torch.equal(parameters[n].float(), p.bfloat16().float()) for n, p in lora.items())


@pytest.mark.parametrize("student_first", [True, False])
@pytest.mark.parametrize("wrapper", ["none", "accelerate"])
def test_teacher_and_student_share_one_autocast_region(world, student_first, wrapper):
    """bf16 autocast caches the casts of fp32 weights for a whole region: without care the teacher would reuse the
    student's casts (or the student the teacher's) although teacher_mode swapped the weights. Training and evaluation
    run both in one region, so each must match its own fresh region exactly; also when accelerate's mixed-precision
    wrapper opens a caching region of its own inside every forward, as it does in the trainer: there a stale cast
    means training and scoring the other model's weights."""
    from nha_retrofit.finetune.model import load_model, resolve_source, select_trainable
    from nha_retrofit.finetune.stages import snapshot_teacher, teacher_mode

    model_path, data = world
    spec = load_recipe(tiny_recipe(model_path, data, "unused", train={"trainable": "attention"}))
    model = select_trainable(load_model(resolve_source(spec.model)), spec.train).eval()
    snapshot_teacher(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "proj" in name:
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    ids = torch.randint(0, 256, (2, 40), generator=generator)
    if wrapper == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # other tests' runs set another precision in this process (as the trainer does)
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
        AcceleratorState._reset_state()

    def student():
        return model(input_ids=ids, use_cache=False).logits

    def teacher():
        with teacher_mode(model):
            return model(input_ids=ids, use_cache=False).logits

    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        with autocast():
            alone_student = student()
        with autocast():
            alone_teacher = teacher()
        with autocast():
            first, second = (student(), teacher()) if student_first else (teacher(), student())
    shared_student, shared_teacher = (first, second) if student_first else (second, first)
    assert (alone_student - alone_teacher).abs().max() > 1e-2
    assert torch.equal(shared_student, alone_student) and torch.equal(shared_teacher, alone_teacher)


def test_attention_transfer_trains_only_gates(world, tmp_path):
    """Stage 1's target is the original layer output only if the projections stay frozen: only gates move."""
    model, data = world
    recipe = tiny_recipe(model, data, tmp_path / "run", stages={"lm": {"tokens": 0}})
    finetune(recipe, **quiet)
    from nha_retrofit.finetune.model import load_model, resolve_source

    start = load_model(resolve_source(load_recipe(recipe).model)).state_dict()
    trained = state_dict(tmp_path / "run" / "model")
    changed = {k for k in start if not torch.equal(start[k], trained[k])}
    assert changed and all(k.endswith(("g_proj.weight", "g_proj.bias", "slot_bias")) for k in changed)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    transfer = [r["transfer"] for r in rows if "transfer" in r]
    assert len(transfer) == 2 and all(t > 0 for t in transfer)


def test_resume_reproduces_the_loss_curve(world, tmp_path):
    model, data = world
    full = tiny_recipe(model, data, tmp_path / "full", train={"checkpoint_every": 100})
    finetune(full, **quiet)
    part = tiny_recipe(model, data, tmp_path / "part", train={"checkpoint_every": 100, "stop_after_steps": 3})
    result = finetune(part, **quiet)
    assert result["stopped_at_step"] == 3 and len(losses(tmp_path / "part")) == 3
    assert [p.name for p in list_checkpoints(tmp_path / "part" / "checkpoints")] == ["step-00000003"]
    part["train"]["stop_after_steps"] = None
    with pytest.raises(NHARetrofitError, match="pass --resume to continue it or --overwrite"):
        finetune(part, **quiet)
    finetune(part, resume=True, **quiet)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) <= 1e-6
    assert torch.equal(state_dict(tmp_path / "full" / "model")["model.layers.0.self_attn.g_proj.weight"],
                       state_dict(tmp_path / "part" / "model")["model.layers.0.self_attn.g_proj.weight"])


def test_resume_without_checkpoint(world, tmp_path):
    model, data = world
    with pytest.raises(NHARetrofitError, match="--resume: no checkpoint in"):
        finetune(tiny_recipe(model, data, tmp_path / "run"), resume=True, **quiet)


def test_non_finite_loss_stops_after_saving_the_last_good_state(world, tmp_path, monkeypatch):
    from nha_retrofit.finetune import stages

    model, data = world
    real = stages.lm_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), metrics) if calls["n"] == 2 else (loss, metrics)

    monkeypatch.setattr(stages, "lm_loss", poisoned)
    recipe = tiny_recipe(model, data, tmp_path / "run", train={"checkpoint_every": 100})
    with pytest.raises(NHARetrofitError, match=r"non-finite loss at step 4 \(lm\); stopped. The last good state \(step 3\)"):
        finetune(recipe, **quiet)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000003"]
    monkeypatch.setattr(stages, "lm_loss", real)
    summary = finetune(recipe, resume=True, **quiet)
    assert summary["steps"] == 6


@pytest.mark.parametrize(
    "data_override, message",
    [
        ({"files": ["{recipe_dir}/missing.txt"]}, "recipe key data.files: .*missing.txt not found"),
        ({"files": ["/nonexistent/*.txt"]}, "recipe key data.files: /nonexistent/\\*.txt matches no files"),
        ({"seq_len": 4096}, "recipe key data.seq_len: 4096 exceeds the model's max_position_embeddings 128"),
        ({"eval_blocks": 100000}, "the dataset is too small"),
    ],
)
def test_bad_data(world, tmp_path, data_override, message):
    model, data = world
    with pytest.raises(NHARetrofitError, match=message):
        finetune(tiny_recipe(model, data, tmp_path / "run", data=data_override), **quiet)


def test_empty_dataset(world, tmp_path):
    model, _ = world
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n\n")
    (empty / "b.txt").write_text("")
    with pytest.raises(NHARetrofitError, match=r"the dataset is empty: 2 file\(s\) hold no text"):
        finetune(tiny_recipe(model, empty, tmp_path / "run"), dry_run=True, **quiet)


def test_converted_checkpoint_as_input(world, tmp_path):
    from nha_retrofit.conversion import convert
    from nha_retrofit.plan import PlanSpec

    model, data = world
    converted = convert(str(model), tmp_path / "nha", PlanSpec(select="even", full_layers=1, window=4, slots=4), log=lambda *_: None)
    recipe = tiny_recipe(converted, data, tmp_path / "run")
    with pytest.raises(NHARetrofitError, match="recipe key model.convert: .* is already converted"):
        finetune(recipe, dry_run=True, **quiet)
    del recipe["model"]["convert"]
    recipe["stages"] = {"lm": {"tokens": 64}}
    summary = finetune(recipe, **quiet)
    record = json.loads((tmp_path / "run" / "model" / "nha_conversion.json").read_text())
    assert record["source_path"] == str(model) and record["finetune"]["steps"] == summary["steps"] == 1


def test_resume_refuses_a_changed_batch(world, tmp_path):
    model, data = world
    recipe = tiny_recipe(model, data, tmp_path / "run", train={"stop_after_steps": 1})
    finetune(recipe, **quiet)
    recipe["train"].update(stop_after_steps=None, batch_size=1)
    with pytest.raises(NHARetrofitError, match="--resume: the run in .* was started with tokens_per_step 64, the recipe now gives 32"):
        finetune(recipe, resume=True, **quiet)


def test_gradient_accumulation_matches_a_larger_batch(world, tmp_path):
    model, data = world
    finetune(tiny_recipe(model, data, tmp_path / "big", train={"batch_size": 2}), **quiet)
    finetune(tiny_recipe(model, data, tmp_path / "acc", train={"batch_size": 1, "grad_accum": 2}), **quiet)
    a, b = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert len(a) == len(b) == 6
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) < 1e-5


def test_tensorboard_needs_its_package(world, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.utils import is_tensorboard_available

    if is_tensorboard_available():
        pytest.skip("tensorboard is installed")
    model, data = world
    with pytest.raises(NHARetrofitError, match="recipe key train.tensorboard: install tensorboard"):
        finetune(tiny_recipe(model, data, tmp_path / "run", train={"tensorboard": True}), **quiet)


def test_long_blocks_end_the_lm_stage_with_the_same_tokens_per_step(world, tmp_path, monkeypatch):
    """data.long: the LM stage's last `share` of steps reads half as many blocks of twice the length, and a run
    stopped inside that phase resumes onto the same loss curve."""
    from nha_retrofit.finetune.data import LocalBlocks

    model, data = world
    drawn = []
    real = LocalBlocks.next_blocks

    def spy(self, count, long=False):
        blocks = real(self, count, long)
        drawn.append(tuple(blocks.shape))
        return blocks

    monkeypatch.setattr(LocalBlocks, "next_blocks", spy)
    long = {"long": {"seq_len": 64, "share": 0.5}}  # beside tiny_recipe's 32-token blocks
    full = tiny_recipe(model, data, tmp_path / "full", data=long, train={"checkpoint_every": 100})
    summary = finetune(full, **quiet)
    assert summary["steps"] == 6 and summary["tokens"] == 384 and summary["plan"]["long_block_steps"] == 2
    assert drawn == [(2, 32)] * 4 + [(1, 64)] * 2
    part = tiny_recipe(model, data, tmp_path / "part", data=long, train={"checkpoint_every": 100, "stop_after_steps": 5})
    finetune(part, **quiet)
    part["train"]["stop_after_steps"] = None
    finetune(part, resume=True, **quiet)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [x[:2] for x in a] == [x[:2] for x in b]
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) <= 1e-6
