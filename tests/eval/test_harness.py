"""lm-evaluation-harness through lm-eval's own HFLM around the loaded models: two local YAML tasks over JSON files
written here (multiple choice and rolling log-likelihood) run offline; the original and the NHA model with every window
full score exactly alike; a wrong task name and a Hub task on this offline machine are one clear line each."""

import datasets
import huggingface_hub.constants
import pytest

pytest.importorskip("lm_eval")

from nha_retrofit.errors import NHARetrofitError  # noqa: E402
from nha_retrofit.eval.evaluate import BUILTIN_TASKS  # noqa: E402
from nha_retrofit.eval.harness import harness_scores, task_manager  # noqa: E402
from nha_retrofit.eval.variants import VARIANTS, Variants, load_tokenizer  # noqa: E402
from nha_retrofit.modeling.load import load_for_inference  # noqa: E402

@pytest.fixture
def offline(monkeypatch):
    """This machine cannot reach the Hub: say so up front, as HF_HUB_OFFLINE=1 would have at import."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.slow
def test_local_tasks_score_the_original_and_the_all_full_model_alike(tiny_checkpoint, local_tasks, offline):
    names = ["tiny_choice", "tiny_rolling"]
    manager = task_manager(names, local_tasks, BUILTIN_TASKS)
    variants = Variants(load_for_inference(tiny_checkpoint, "cpu", "float32"), VARIANTS)
    scores = harness_scores(variants, load_tokenizer(tiny_checkpoint), names, manager, batch_size=4, limit=2)
    assert sorted(scores) == names
    assert scores["tiny_choice"]["examples"] == 2 and scores["tiny_rolling"]["examples"] == 2
    assert sorted(scores["tiny_choice"]["metrics"]) == ["acc", "acc_norm"]
    assert sorted(scores["tiny_rolling"]["metrics"]) == ["bits_per_byte", "byte_perplexity", "word_perplexity"]
    for task in names:
        for metric, values in scores[task]["metrics"].items():
            assert list(values) == list(VARIANTS)
            assert values["original"] == values["nha_all_full"], (task, metric)
    perplexities = scores["tiny_rolling"]["metrics"]["word_perplexity"]
    assert perplexities["nha"] != perplexities["original"] and perplexities["window_only"] != perplexities["nha"]
    assert all(0 <= value <= 1 for value in scores["tiny_choice"]["metrics"]["acc"].values())
    assert all(value > 1 for value in perplexities.values())


@pytest.mark.slow  # 10-17 s: lm-eval indexes its tasks in each case
def test_wrong_task_name_and_hub_task_offline_are_one_line(tiny_checkpoint, local_tasks, offline):
    with pytest.raises(NHARetrofitError, match=r"unknown task 'arc_esy' \(did you mean 'arc_easy'\?\): neither built "
                                               r"in \(heldout, passkey, .*`lm-eval ls tasks` lists them"):
        task_manager(["arc_esy"], local_tasks, BUILTIN_TASKS)
    manager = task_manager(["arc_easy"], local_tasks, BUILTIN_TASKS)  # a known task: its data is on the Hub
    variants = Variants(load_for_inference(tiny_checkpoint, "cpu", "float32"), ["nha"])
    with pytest.raises(NHARetrofitError, match=r"lm-evaluation-harness could not load the data of arc_easy: "
                                               r"Couldn't reach 'allenai/ai2_arc' on the Hub") as error:
        harness_scores(variants, load_tokenizer(tiny_checkpoint), ["arc_easy"], manager)
    assert len(str(error.value).splitlines()) == 1
