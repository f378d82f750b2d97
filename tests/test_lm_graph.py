"""Generation from a CUDA graph (lambdanet.models.lm_graph.StepGraph, ``generate(cuda_graph=True)``).

The capture itself needs CUDA (tests/test_device.py runs it); everything else runs here: ``capture=False`` runs
the same static-buffer step eagerly (the state copied back in place, the token fed through a buffer), which
must give the logits ``model.step`` gives, bit for bit (the same operations on the same values); the step must
read nothing on the host (what a graph cannot replay), checked by recording the operations it dispatches;
a model whose state grows is refused with a one-line error.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lambdanet import create_model
from lambdanet.models.lm_graph import StepGraph
from lambdanet.ops.causal_lambda import fused_chunk as FC

# the constant-state families and the lambda layer's options that change its state (decay, several lambdas,
# position lambdas alone, the short convolution's window, learnt positions need no state)
CONSTANT = {
    "lambda": ("lambda_lm_nano", {}),
    "plain_lambda": ("plain_lambda_lm_nano", {}),
    "linear": ("linear_lm_nano", {}),
    "decay_gate": ("plain_lambda_lm_nano", dict(decay="gate")),
    "lambdas2": ("plain_lambda_lm_nano", dict(lambdas=2)),
    "position_only": ("plain_lambda_lm_nano", dict(content=False)),
    "key_l2": ("plain_lambda_lm_nano", dict(key_norm="l2")),
}


class HostReads(TorchDispatchMode):
    """Records the operations that bring a device value to the host (``.item()``, ``int(tensor)``, ...)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _model(name, kwargs):
    torch.manual_seed(0)
    model = create_model(name, **kwargs).eval()
    with torch.no_grad():  # weights far from the initialisation (the convolution and gates no identity)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _prompt_state(model, b=2, n=37):
    prompt = torch.randint(0, 256, (b, n), generator=torch.Generator().manual_seed(1))
    logits, state = model(prompt, return_state=True)
    return logits[:, -1], state


@pytest.mark.parametrize("case", list(CONSTANT))
@torch.no_grad()
def test_the_static_step_gives_the_logits_of_step_and_reads_nothing_on_the_host(case):
    model = _model(*CONSTANT[case])
    logits, state = _prompt_state(model)
    tok = logits.argmax(-1)
    graph = StepGraph(model._advance, state, tok, capture=False, name=case)
    for _ in range(6):
        want, state = model.step(state, tok)
        with HostReads() as mode:
            got = graph.step(tok)
        assert mode.reads == [], case
        assert torch.equal(got, want), case
        tok = want.argmax(-1)
    with HostReads() as mode:  # the detector sees the host read that step's checks make
        model.step(state, tok)
    assert mode.reads


@pytest.mark.parametrize("case", list(CONSTANT))
@torch.no_grad()
def test_the_static_step_starts_from_the_empty_state_too(case):
    """From ``init_state`` (whose entries a step may return in another order): the same logits as ``step``."""
    model = _model(*CONSTANT[case])
    state, tok = model.init_state(2), torch.tensor([3, 200])
    graph = StepGraph(model._advance, state, tok, capture=False, name=case)
    for _ in range(3):
        want, state = model.step(state, tok)
        assert torch.equal(graph.step(tok), want), case
        tok = want.argmax(-1)


class EagerGraph(StepGraph):
    """generate's graph path on the CPU: the static buffers without the capture."""

    devices = ("cuda", "cpu")
    made = 0

    def __init__(self, *args, **kwargs):
        EagerGraph.made += 1
        super().__init__(*args, **kwargs, capture=False)


@pytest.mark.parametrize("new_tokens", [0, 1, 2, 7])
def test_generate_through_the_graph_path_gives_the_tokens_of_the_eager_steps(monkeypatch, new_tokens):
    """Greedy and sampled: the same tokens (one state advance per token, none after the last); the graph is
    built once, at the second token (the first comes from the prompt's logits)."""
    import lambdanet.models.lm as lm

    model = _model("lambda_lm_nano", {})
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    greedy = model.generate(prompt, new_tokens, top_k=1)
    sampled = model.generate(prompt, new_tokens, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(lm, "StepGraph", EagerGraph)
    EagerGraph.made = 0
    assert torch.equal(model.generate(prompt, new_tokens, top_k=1, cuda_graph=True), greedy)
    assert EagerGraph.made == (1 if new_tokens > 1 else 0)
    assert torch.equal(model.generate(prompt, new_tokens, generator=torch.Generator().manual_seed(5),
                                      cuda_graph=True), sampled)  # fmt: skip


@torch.no_grad()
def test_the_static_step_runs_the_recurrent_kernel_as_step_does():
    """With the layers in ``fused_chunk`` mode the step is the recurrent Triton kernel (one launch per layer):
    the static step runs it on its buffers alike (under the interpreter here)."""
    if not FC.available("cpu")[0]:
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    model = _model("lambda_lm_nano", {})
    for block in model.blocks:
        block.mixer.mode = "fused_chunk"
    logits, state = _prompt_state(model, n=21)
    tok = logits.argmax(-1)
    graph = StepGraph(model._advance, state, tok, capture=False)
    for _ in range(3):
        want, state = model.step(state, tok)
        assert torch.equal(graph.step(tok), want)
        tok = want.argmax(-1)


def test_the_buffers_take_the_steps_dtypes_and_survive_aliasing_views():
    """A toy step whose new state is a transposed view of the old buffer (the copy back must not read what it
    has overwritten) and whose state comes in float32 but leaves in float64 (the buffers take the step's)."""

    def advance(state, tokens):
        m = state["m"].double()  # the buffer itself once it is float64
        return m.sum(1) + tokens[:, 0], {"m": m.t()}

    m0 = torch.arange(4.0).view(2, 2)
    graph = StepGraph(advance, {"m": m0}, torch.zeros(2, dtype=torch.long), capture=False)
    assert graph.state["m"].dtype == torch.float64 and torch.equal(graph.state["m"], m0.double())
    out1 = graph.step(torch.tensor([10, 20])).clone()
    assert torch.equal(out1, torch.tensor([11.0, 25.0], dtype=torch.float64))  # rows of m0 summed, plus the tokens
    assert torch.equal(graph.state["m"], m0.double().t())
    graph.step(torch.tensor([0, 0]))
    assert torch.equal(graph.state["m"], m0.double())
    assert torch.equal(m0, torch.arange(4.0).view(2, 2))  # the caller's state untouched


def test_leaves_that_swap_buffers_are_copied_from_their_values_before_the_step():
    """A step whose new ``a`` is the old ``b`` and whose new ``b`` is the old ``a``: copying ``a`` first must
    not change what ``b`` receives."""

    def advance(state, tokens):
        return state["a"] + tokens[:, 0], {"a": state["b"], "b": state["a"]}

    graph = StepGraph(advance, {"a": torch.zeros(2), "b": torch.ones(2)}, torch.zeros(2, dtype=torch.long),
                      capture=False)  # fmt: skip
    graph.step(torch.zeros(2, dtype=torch.long))
    assert torch.equal(graph.state["a"], torch.ones(2)) and torch.equal(graph.state["b"], torch.zeros(2))


def test_states_that_change_a_python_value_or_never_settle_their_dtypes_are_refused():
    tokens = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"holds a Python value that changes \(3 -> 4\)"):
        StepGraph(lambda s, t: (t.float(), {"n": s["n"] + 1}), {"n": 3}, tokens, capture=False, name="toy")
    flip = {torch.float32: torch.float64, torch.float64: torch.float32}
    with pytest.raises(ValueError, match="toy's keep changing"):
        StepGraph(lambda s, t: (t.float(), {"x": s["x"].to(flip[s["x"].dtype])}), {"x": torch.zeros(2)}, tokens,
                  capture=False, name="toy")  # fmt: skip


@pytest.mark.parametrize("name", ["transformer_lm_nano", "hybrid_lm_nano"])
@torch.no_grad()
def test_a_growing_state_is_refused_in_one_line(name):
    model = _model(name, {})
    logits, state = _prompt_state(model)
    with pytest.raises(ValueError, match=f"keeps its size .*{name}'s grows") as err:
        StepGraph(model._advance, state, logits.argmax(-1), capture=False, name=name)
    assert "\n" not in str(err.value)


def test_generate_with_cuda_graph_on_the_cpu_or_a_bad_value_is_a_one_line_error():
    model = _model("lambda_lm_nano", {})
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="cuda_graph=True needs the model and tokens on a CUDA device, got cpu"):
        model.generate(prompt, 4, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be True or False, got 'yes'"):
        model.generate(prompt, 4, cuda_graph="yes")
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraph(model._advance, model.init_state(1), prompt[:, 0])


def test_a_layer_continuing_a_state_compiles_without_graph_breaks():
    """``step`` and ``forward(x, state)`` under ``torch.compile(fullgraph=True)`` (the state checks and the copy of
    inference-mode states are eager-only Python), equal to eager."""
    from lambdanet.layers.causal_lambda import CausalLambdaLayer

    torch.manual_seed(0)
    layer = CausalLambdaLayer(16, heads=2, dim_k=4, r=5, short_conv=3, decay="gate")
    x = torch.randn(2, 9, 16)
    _, state = layer(x[:, :8], return_state=True)
    step = torch.compile(lambda s, t: layer.step(s, t)[0], fullgraph=True, backend="aot_eager")
    more = torch.compile(lambda s, t: layer(t, s), fullgraph=True, backend="aot_eager")
    eager = layer.step(state, x[:, 8])[0]
    assert torch.allclose(step(state, x[:, 8]), eager, atol=1e-6)  # the same ops in the same order: float32 rounding
    assert torch.allclose(more(state, x[:, 8:])[:, 0], eager, atol=1e-5)


@pytest.mark.parametrize("name", ["transformer_lm_nano", "hybrid_lm_nano"])
def test_a_graph_asked_of_a_model_with_attention_is_refused_before_the_prompt(monkeypatch, capsys, tmp_path, name):
    """The families whose state grows (the transformer's cache, the hybrid's attention blocks) are refused at once,
    before the prompt's pass (it was at the first step, after it), and ``lm sample --cuda-graph`` names its flag.
    (A CUDA device is pretended: the refusal does not depend on it.)"""
    import lambdanet.tasks.lm.task as lm_task
    from lambdanet.cli import main

    monkeypatch.setattr(StepGraph, "check_device", staticmethod(lambda device: None))
    model = _model(name, {})
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(1))
    with pytest.raises(ValueError, match="^cuda_graph=True needs a state that keeps its size .* attention blocks"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 4, cuda_graph=True)
    assert passes == []
    model.lm_cfg = {}
    monkeypatch.setattr(lm_task, "load_lm", lambda path, device: model)
    monkeypatch.setattr("lambdanet.cli.common.check_device", lambda device: None)
    (tmp_path / "config.yaml").write_text(f"model: {name}\nvocab_size: 256\n")  # what check_run_task reads
    assert main(["lm", "sample", "--checkpoint", str(tmp_path), "--prompt", "ab", "--cuda-graph"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cuda-graph needs a state" in err and "without --cuda-graph" in err
