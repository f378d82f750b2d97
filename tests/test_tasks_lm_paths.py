"""The language-model task moved to lambdanet/tasks/lm/ (issue 38): for one release its old import paths
(lambdanet.lm, lambdanet.lm.corpus, lambdanet.lm.task) still import, warn with a DeprecationWarning naming the new
path and give the new modules' very objects. The streaming ``step`` of the causal mixers and of a language model's
block now takes ``(state, x)``, as ``LanguageModel.step(state, tokens)`` does; the earlier ``(x, state)`` still
works for one release, with a DeprecationWarning, and gives the same result."""

import re
import warnings

import pytest
import torch

import lambdanet.tasks.lm as lm
from lambdanet.layers.causal_attention import CausalSelfAttention
from lambdanet.layers.causal_lambda import CausalLambdaLayer
from lambdanet.models import create_model
from lambdanet.tasks.lm import config, data, task
from moved_paths import assert_moved, forget_old_paths

MOVED = {
    "lambdanet.lm.corpus": "lambdanet.tasks.lm.data",
    "lambdanet.lm.task": "lambdanet.tasks.lm.task",
}
# every name lambdanet.lm.task had before the move that a caller may have imported (its configuration is config.py's)
OLD_TASK_NAMES = ["LMConfig", "LanguageModelTask", "train_lm", "evaluate_bits_per_byte", "load_lm", "sample",
                  "LM_PANELS", "DATA_HELP", "load_corpus", "windows", "RunConfig", "option", "shared", "list_models",
                  "create_model", "LanguageModel", "RunState", "Task", "run", "dataclass"]


def _forget_old_paths(monkeypatch) -> None:
    forget_old_paths(monkeypatch, "lambdanet.lm")


@pytest.mark.parametrize("old, new", MOVED.items())
def test_lm_old_paths_warn_and_alias(old, new, monkeypatch):
    assert_moved(old, new, monkeypatch, "lambdanet.lm", "lambdanet.tasks.lm")


def test_lm_old_objects_are_the_new_ones(monkeypatch):
    _forget_old_paths(monkeypatch)
    with pytest.warns(DeprecationWarning, match=re.escape("lambdanet.lm moved to lambdanet.tasks.lm")):
        import lambdanet.lm as old_package
    assert old_package.__all__ == lm.__all__
    assert all(getattr(old_package, name) is getattr(lm, name) for name in lm.__all__)
    with pytest.warns(DeprecationWarning, match="lambdanet.tasks.lm"):
        from lambdanet.lm.corpus import Corpus, _split_tail
        from lambdanet.lm.task import LMConfig, LanguageModelTask, sample
    assert LMConfig is config.LMConfig is task.LMConfig and LanguageModelTask is task.LanguageModelTask
    assert sample is task.sample and Corpus is data.Corpus and _split_tail is data._split_tail  # private names too
    import lambdanet.lm.task as old_task  # the forms earlier tests and scripts use

    assert old_task is task and all(hasattr(task, name) for name in OLD_TASK_NAMES)
    from lambdanet.lm import corpus

    assert corpus is data


def _mixers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        CausalLambdaLayer(16, heads=2, dim_k=4, dim_v=8, r=3, short_conv=2).double(),
        CausalSelfAttention(16, heads=2).double(),
        create_model("lambda_lm_nano").blocks[0].double(),  # a language model's block: its mixer's step inside
        create_model("transformer_lm_nano").blocks[0].double(),
    ]


@pytest.mark.parametrize("index", range(4))
def test_step_takes_state_first_and_the_old_order_warns_once_with_the_same_result(index):
    module = _mixers()[index]
    mixer = getattr(module, "mixer", module)
    x = torch.randn(2, 5, 16 if mixer is module else 64, dtype=torch.float64)
    new, old = mixer.init_state(2, dtype=torch.float64), mixer.init_state(2, dtype=torch.float64)
    for t in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new order warns of nothing
            y_new, new = module.step(new, x[:, t])
        with pytest.warns(DeprecationWarning, match=r"\.step\(x, state\) is deprecated: call .*\.step\(state, x\)"):
            y_old, old = module.step(x[:, t], old)
        torch.testing.assert_close(y_old, y_new, rtol=0, atol=0)
        assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)


def test_the_old_order_warns_once_per_call_through_a_block():
    block = _mixers()[2]
    state = block.mixer.init_state(2, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        block.step(torch.randn(2, 64, dtype=torch.float64), state)
    assert [type(w.message) for w in record] == [DeprecationWarning] and "_Block.step" in str(record[0].message)
    assert record[0].filename == __file__  # the warning points at the caller
