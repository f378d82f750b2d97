"""The two terms of the causal lambda apart (``lambdanet.ops.lambda_terms``, issue 37's key normalisations and
position-only lambdas): the chunked forms against the definitions at awkward lengths and chunk sizes, gradients
included, state continuation, the definitions against the fused op's own reference and the invariances each
normalisation implies.

Tolerances: in float64 the chunked forms and the definitions differ only in summation order, a relative error of
``~ n eps ~ 1e-13`` for the longest (500) sequences; the tests allow ``1e-10``. float32 inputs are compared with
the float64 definition at the issue's ``1e-4``: a sum of at most ``n = 500`` products rounded at ``u = 6e-8`` each
is off by at most ``n u = 3e-5`` of the sum of the terms' magnitudes (every rounding the same way); the random-sign
inputs here cancel, so the output is ``~ sqrt(n)`` times smaller than that sum, and the roundings, of random sign
too, add up to ``~ sqrt(n) u ~ 1.3e-6`` of the output (measured: 2e-7 for the content term, 9e-8 for the position
term over five seeds). ``1e-4`` leaves almost two orders of magnitude over that estimate; the strict worst case
relative to the output (``n u sqrt(n) ~ 7e-4``, every rounding aligned) is not what these sums of random signs do.
"""

from __future__ import annotations

import pytest
import torch

from lambdanet.functional.causal import causal_lambda_reference
from lambdanet.ops.lambda_terms import (
    content_lambda,
    init_content_state,
    naive_content_lambda,
    naive_position_lambda,
    position_lambda,
)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def inputs(n, b=2, h=3, k=4, v=5, u=2, r=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, keys, values = (torch.randn(*s, generator=g, dtype=dtype) for s in ((b, n, h, k), (b, n, k, u), (b, n, v, u)))
    return q, keys, values, torch.randn(r, k, u, generator=g, dtype=dtype)


@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 16), (63, 1), (130, 64), (500, 37)])
@pytest.mark.parametrize("key_norm", ["l2", "none"])
def test_content_equals_its_definition(n, chunk, key_norm):
    q, keys, values, _ = inputs(n)
    want = naive_content_lambda(q, keys, values, key_norm)
    assert rel(content_lambda(q, keys, values, key_norm=key_norm, chunk_size=chunk), want) < 1e-10


@pytest.mark.parametrize("n,chunk,r", [(1, 64, 7), (63, 16, 7), (63, 5, 20), (130, 64, 1), (500, 37, 64)])
def test_position_equals_its_definition(n, chunk, r):
    q, _, values, emb = inputs(n, r=r)
    assert rel(position_lambda(q, values, emb, chunk_size=chunk), naive_position_lambda(q, values, emb)) < 1e-10


def test_the_definitions_add_up_to_the_fused_ops_reference():
    """``softmax`` content + position = the causal lambda as the fused op defines it (an independent reference)."""
    q, keys, values, emb = inputs(40)
    both = naive_content_lambda(q, keys, values, "softmax") + naive_position_lambda(q, values, emb)
    assert rel(both, causal_lambda_reference(q, keys, values, emb)) < 1e-12
    assert rel(naive_content_lambda(q, keys, values, "softmax"), causal_lambda_reference(q, keys, values)) < 1e-12


@pytest.mark.parametrize("key_norm", ["l2", "none"])
def test_gradients_equal_the_definitions(key_norm):
    q, keys, values, emb = (t.requires_grad_() for t in inputs(63, r=9))
    dy = torch.randn(2, 63, 3, 5, dtype=torch.float64)
    for f, g in ((lambda: content_lambda(q, keys, values, key_norm=key_norm, chunk_size=16),
                  lambda: naive_content_lambda(q, keys, values, key_norm)),
                 (lambda: position_lambda(q, values, emb, chunk_size=16),
                  lambda: naive_position_lambda(q, values, emb))):  # fmt: skip
        got = torch.autograd.grad(f(), (q, keys, values, emb), dy, allow_unused=True)
        want = torch.autograd.grad(g(), (q, keys, values, emb), dy, allow_unused=True)
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or rel(a, b) < 1e-10)


@pytest.mark.parametrize("split", [1, 17, 64])
def test_a_state_continues_the_sequence(split):
    q, keys, values, emb = inputs(100)
    whole = content_lambda(q, keys, values, chunk_size=16) + position_lambda(q, values, emb, chunk_size=16)
    a, sc = content_lambda(q[:, :split], keys[:, :split], values[:, :split], chunk_size=16, output_final_state=True)
    b, sp = position_lambda(q[:, :split], values[:, :split], emb, chunk_size=16, output_final_state=True)
    steps = [a + b]
    for t in range(split, 100):  # the rest one position at a time: the generation path
        a, sc = content_lambda(q[:, t : t + 1], keys[:, t : t + 1], values[:, t : t + 1], initial_state=sc,
                               output_final_state=True)  # fmt: skip
        b, sp = position_lambda(q[:, t : t + 1], values[:, t : t + 1], emb, initial_state=sp, output_final_state=True)
        steps.append(a + b)
    assert rel(torch.cat(steps, dim=1), whole) < 1e-10
    assert sc["S"].shape == (2, 2, 4, 5) and sc["ss"].shape == (2, 2, 4) and sp["window"].shape == (2, 2, 6, 5)
    assert sc.keys() == init_content_state(2, 4, 5, 2).keys()


def test_each_normalisation_keeps_its_invariance():
    """L2 over the prefix: scaling a key channel by a positive constant changes nothing. None: the output is
    linear in the keys. Position lambdas: the keys do not enter at all (nothing to pass)."""
    q, keys, values, _ = inputs(50)
    scale = torch.rand(1, 1, 4, 2, dtype=torch.float64) * 10 + 0.1
    l2 = content_lambda(q, keys, values, key_norm="l2")
    assert rel(content_lambda(q, keys * scale, values, key_norm="l2"), l2) < 1e-12
    none = content_lambda(q, keys, values, key_norm="none")
    assert rel(content_lambda(q, 3 * keys, values, key_norm="none"), 3 * none) < 1e-12


def test_float32_against_the_float64_definition():
    q, keys, values, emb = inputs(500)
    f32 = [t.float() for t in (q, keys, values, emb)]
    got = content_lambda(*f32[:3], key_norm="l2", chunk_size=64)
    assert got.dtype == torch.float32 and rel(got.double(), naive_content_lambda(q, keys, values, "l2")) < 1e-4
    got = position_lambda(f32[0], f32[2], f32[3])
    assert rel(got.double(), naive_position_lambda(q, values, emb)) < 1e-4


def test_bad_arguments_are_one_line_errors():
    q, keys, values, emb = inputs(8)
    for call, match in ((lambda: content_lambda(q, keys, values, key_norm="softmax"),
                         r"key_norm must be one of \['l2', 'none'\], got 'softmax'"),
                        (lambda: content_lambda(q, keys, values, chunk_size=0), "chunk_size must be a positive int"),
                        (lambda: position_lambda(q, values, emb[:, :2]), r"emb must be \[r, k=4, u=2\] with r >= 1"),
                        (lambda: position_lambda(q, values[:, :5], emb), "q and v must be"),
                        (lambda: naive_content_lambda(q, keys, values, "max"), "key_norm must be")):  # fmt: skip
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
