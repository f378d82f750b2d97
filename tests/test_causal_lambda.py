"""Causal (masked, App. B.2) lambdas over sequences: the chunked training form and the recurrent step against
the definition computed position by position in float64.

Tolerances: in float64 each output is a sum of at most ``n + r`` products of ``k u`` terms; reassociating it
(chunks, running sums rescaled by ``exp(c_old - c_new)``) changes it by at most ``~(n + r + k u) eps`` relative
to the terms' magnitude. With ``n <= 500`` and outputs not much smaller than their terms (random inputs) that
is ``< 1e-12``; the tests allow ``1e-10`` (the issue's figure). Float32 runs are compared with ``2e-5`` against
the definition on the same (float32-rounded) inputs, so that only the arithmetic counts: ``(n + r + k u) * 2^-24
= (300 + 7 + 4) * 2^-24 ~ 1.9e-5`` at worst, in practice far below (errors are random, not aligned: ~1e-7).
Against the unrounded float64 inputs the rounding of the keys would count too: keys of ``scale = 200`` reach
``|key| ~ 800``, whose rounding moves a logit by up to ``800 * 2^-24 ~ 5e-5``, the outputs by up to twice that.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lambdanet.functional.causal import (MAX_SPREAD, causal_lambda, causal_lambda_reference, causal_lambda_step,
                                         init_causal_lambda_state)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against ``b`` (absolute when ``b`` is zero)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300)) if b.norm() > 0 else float((a - b).norm())


def inputs(n, b=2, h=3, k=4, v=5, u=1, r=7, scale=3.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, k, generator=g, dtype=dtype)
    keys = scale * torch.randn(b, n, k, u, generator=g, dtype=dtype)
    values = torch.randn(b, n, v, u, generator=g, dtype=dtype)
    emb = torch.randn(r, k, u, generator=g, dtype=dtype) if r else None
    return q, keys, values, emb


@pytest.mark.parametrize("n", [1, 63, 500])
@pytest.mark.parametrize("u", [1, 2])
def test_chunked_equals_the_definition_content_position_and_both(n, u):
    q, keys, values, emb = inputs(n, u=u)
    both = causal_lambda(q, keys, values, emb, chunk=16)
    content = causal_lambda(q, keys, values, None, chunk=16)
    assert rel(both, causal_lambda_reference(q, keys, values, emb)) < 1e-10
    assert rel(content, causal_lambda_reference(q, keys, values, None)) < 1e-10
    position = causal_lambda_reference(q, keys, values, emb) - causal_lambda_reference(q, keys, values, None)
    assert rel(both - content, position) < 1e-10


@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 64), (500, 64), (37, 5)])
def test_chunked_gradients_equal_the_definitions(n, chunk):
    q, keys, values, emb = (t.requires_grad_() for t in inputs(n, u=2))
    upstream = torch.randn(2, n, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = torch.autograd.grad(causal_lambda_reference(q, keys, values, emb), (q, keys, values, emb), upstream)
    got = torch.autograd.grad(causal_lambda(q, keys, values, emb, chunk=chunk), (q, keys, values, emb), upstream)
    for name, a, b in zip(("q", "keys", "values", "emb"), got, ref):
        # at n = 1 the keys' gradient is exactly zero (a softmax over one position): compare absolutely
        assert rel(a, b) < 1e-10, name


def test_chunked_backward_passes_gradcheck():
    q, keys, values, emb = (t.requires_grad_() for t in inputs(9, b=1, h=2, k=3, v=2, u=2, r=3, scale=1.0))
    assert torch.autograd.gradcheck(lambda *t: causal_lambda(*t, chunk=4), (q, keys, values, emb))


@pytest.mark.parametrize("n", [1, 63, 130])
def test_recurrent_steps_equal_the_definition(n):
    q, keys, values, emb = inputs(n, u=2)
    state = init_causal_lambda_state(2, 4, 5, 2, 7, dtype=torch.float64)
    sizes = {key: t.shape for key, t in state.items()}
    out = []
    for t in range(n):
        y, state = causal_lambda_step(q[:, t], keys[:, t], values[:, t], emb, state)
        out.append(y)
        assert {key: t.shape for key, t in state.items()} == sizes  # the state never grows
    assert rel(torch.stack(out, dim=1), causal_lambda_reference(q, keys, values, emb)) < 1e-10


def test_a_returned_state_continues_the_sequence():
    q, keys, values, emb = inputs(100)
    whole = causal_lambda(q, keys, values, emb, chunk=16)
    first, state = causal_lambda(q[:, :41], keys[:, :41], values[:, :41], emb, chunk=16, return_state=True)
    rest = causal_lambda(q[:, 41:], keys[:, 41:], values[:, 41:], emb, chunk=7, state=state)
    assert rel(torch.cat([first, rest], dim=1), whole) < 1e-10


def test_an_empty_sequence_gives_an_empty_output_and_keeps_the_state():
    q, keys, values, emb = inputs(30)
    first, state = causal_lambda(q, keys, values, emb, chunk=8, return_state=True)
    y, same = causal_lambda(q[:, :0], keys[:, :0], values[:, :0], emb, state=state, return_state=True)
    assert y.shape == (2, 0, 3, 5)
    assert all(torch.equal(same[key], state[key]) for key in state)


@pytest.mark.parametrize("scale", [200.0, 2.0 * MAX_SPREAD])
def test_keys_of_any_range_stay_finite_and_exact_in_float32(scale):
    """Keys spread far beyond float32's exp range (e^200) use the exact chunk form; the result is the float64
    definition's to float32 accuracy, both in the chunked and the recurrent form."""
    q32, k32, v32, e32 = (t.float() for t in inputs(300, scale=scale))
    ref = causal_lambda_reference(*(t.double() for t in (q32, k32, v32, e32)))  # the module docstring
    y = causal_lambda(q32, k32, v32, e32, chunk=64)
    assert torch.isfinite(y).all() and rel(y.double(), ref) < 2e-5
    state, out = init_causal_lambda_state(2, 4, 5, 1, 7), []
    for t in range(300):
        yt, state = causal_lambda_step(q32[:, t], k32[:, t], v32[:, t], e32, state)
        out.append(yt)
    assert rel(torch.stack(out, dim=1).double(), ref) < 2e-5


def test_half_inputs_compute_in_float32():
    q, keys, values, emb = inputs(40, dtype=torch.float32)
    y = causal_lambda(*(t.bfloat16() for t in (q, keys, values, emb)), chunk=16)
    assert y.dtype == torch.float32
    # the reference takes the same bf16-rounded inputs, so only the float32 arithmetic remains: (n + r + k u) 2^-24
    # = (40 + 7 + 4) 2^-24 ~ 3e-6 at worst; arithmetic in bf16 would be off by ~2^-9 ~ 2e-3
    assert rel(y.double(), causal_lambda_reference(*(t.bfloat16().double() for t in (q, keys, values, emb)))) < 1e-5


def test_bad_shapes_and_chunks_are_one_line_errors():
    q, keys, values, emb = inputs(10)
    with pytest.raises(ValueError, match="disagree"):
        causal_lambda(q, keys[:, :9], values, emb)
    with pytest.raises(ValueError, match=r"emb must be \[r, k=4, u=1\]"):
        causal_lambda(q, keys, values, emb[:, :3])
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        causal_lambda(q, keys, values, emb, chunk=0)
    with pytest.raises(ValueError, match="^q must be a floating-point tensor, got torch.int64"):
        causal_lambda(q.long(), keys, values, emb)
    with pytest.raises(ValueError, match="^emb must be a floating-point tensor or None, got list"):
        causal_lambda(q, keys, values, [[1.0]])


@pytest.mark.parametrize("kwargs", [{}, {"decay": "gate", "short_conv": 4}])
def test_the_causal_layer_runs_on_meta_and_fake_tensors(kwargs):
    """Shapes without values (a model sized on the meta device, export's and compile's fake tensors): the PyTorch
    form takes its exact branch instead of reading the keys' spread on the host (``Tensor.item() cannot be called
    on meta tensors``); the shape is the real call's. The non-causal layer already ran so."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lambdanet.layers import CausalLambdaLayer

    torch.manual_seed(0)
    layer = CausalLambdaLayer(16, heads=2, dim_k=4, r=5, **kwargs)
    x = torch.randn(2, 70, 16)  # two chunks of 64 and a part
    real = layer(x)
    on_meta = copy.deepcopy(layer).to("meta")(x.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == real.shape
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = layer(x)
    assert fake.shape == real.shape and fake.dtype == real.dtype
