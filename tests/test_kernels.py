"""The fused Triton kernels of the lambda layer (lambdanet.ops.position_lambda), run without a GPU in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when CUDA is absent), against the plain PyTorch
computation of the same function in float64.

Tolerances come from the standard bound for a sum of ``t`` terms in floating point: ``|error| <= t * eps *
sum |terms|``. ``sum |terms|`` of every output and gradient element is the same computation on the absolute
values of the inputs (all terms are then positive), so each element gets its own bound: ``(terms + 4) * eps *
ref(|q|, |V|, |R|)``, with ``terms`` the length of the longest dot product behind that element.
"""

import pytest
import torch

from lambdanet.layers import LambdaLayer
from lambdanet.ops.position_lambda import kernels_available, lambda_position_output, lambda_position_output_reference

pytestmark = pytest.mark.skipif(not kernels_available("cpu")[0] and not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = torch.finfo(torch.float32).eps

# (spatial, table extent, centre, u, heads, k, v): global 2s-1 tables, banded local scopes (larger and smaller
# than the map, off-centre), a causal 1-d table, non-square maps, heads and v not powers of two
CASES = {
    "global-5x7-u1": ((5, 7), (9, 13), (4, 6), 1, 4, 8, 16),
    "local3-6x9-u2": ((6, 9), (3, 3), (1, 1), 2, 3, 4, 12),
    "local9-4x5-cropped": ((4, 5), (9, 9), (4, 4), 1, 2, 8, 16),
    "causal-1d-13": ((13,), (5,), (4,), 1, 4, 4, 16),
    "global-1d-u2": ((10,), (19,), (9,), 2, 2, 4, 8),
}


def _inputs(case, dtype=torch.float32, b=2):
    spatial, ext, center, u, h, k, v = case
    n = 1
    for s in spatial:
        n *= s
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, h, k, generator=g).to(DEVICE, dtype)
    vals = torch.randn(b, n, v, u, generator=g).to(DEVICE, dtype)
    table = torch.randn(k, u, *ext, generator=g).to(DEVICE, dtype)
    return q, vals, table, center, spatial


def _terms(q, vals, table):
    """The longest dot product behind any output or gradient element (per context position and u, the k
    products of S, then the sum over positions, heads and v)."""
    b, n, h, k = q.shape
    v, u = vals.shape[2:]
    return k + n * u * max(h, 1) + v


@pytest.mark.parametrize("name", CASES)
def test_forward_and_gradients_match_the_float64_reference(name):
    q, vals, table, center, spatial = _inputs(CASES[name])
    args = [t.double().requires_grad_() for t in (q, vals, table)]
    ref = lambda_position_output_reference(*args, center, spatial)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, args, grad)
    absolute = [t.detach().abs().requires_grad_() for t in args]
    bound_y = lambda_position_output_reference(*absolute, center, spatial)
    bound_grads = torch.autograd.grad(bound_y, absolute, grad.abs())
    t = _terms(q, vals, table) + 4

    ins = [x.clone().requires_grad_() for x in (q, vals, table)]
    y = lambda_position_output(*ins, center, spatial)
    grads = torch.autograd.grad(y, ins, grad.float())
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= t * EPS32 * bound_y + 1e-30).all()
    for got, want, bound, label in zip(grads, ref_grads, bound_grads, ("q", "values", "table")):
        assert got.shape == want.shape, label
        assert ((got.double() - want).abs() <= t * EPS32 * bound + 1e-30).all(), label
    # an independent sanity check of the bound itself: it is far below the outputs' scale
    assert (t * EPS32 * bound_y).max() < 1e-3 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    """Half-precision operands: each product and partial sum is fp32; what remains is the rounding of the
    half-precision logits fed to the dot (at most one unit roundoff ``u`` of each term) and of the output
    (``u`` of it): ``|y - ref| <= 2 u sum|terms| + u |ref|`` with u = eps / 2 (eps for truncation)."""
    q, vals, table, center, spatial = _inputs(CASES["local3-6x9-u2"], dtype)
    ref = lambda_position_output_reference(q.double(), vals.double(), table.double(), center, spatial)
    bound = lambda_position_output_reference(q.double().abs(), vals.double().abs(), table.double().abs(), center,
                                             spatial)
    y = lambda_position_output(q, vals, table, center, spatial)
    eps = torch.finfo(dtype).eps
    assert y.dtype == dtype
    assert ((y.double() - ref).abs() <= 2 * eps * bound + eps * ref.abs() + 1e-6).all()


LAYERS = {
    "global": (dict(r=None, feat_size=(6, 7)), (2, 16, 5, 7)),
    "local-u2": (dict(r=5, dim_u=2), (2, 16, 6, 9)),
    "local-stride2": (dict(r=3), (2, 16, 6, 6)),
    "causal-1d": (dict(r=7, causal=True), (2, 16, 11)),
}


@pytest.mark.parametrize("name", LAYERS)
def test_lambda_layer_triton_equals_einsum_with_gradients(name):
    """``impl="triton"`` computes the layer ``impl="einsum"`` computes (float64 weights and input; the kernel's
    fp32 arithmetic bounds the difference): outputs and the gradients of the input and every parameter."""
    kwargs, shape = LAYERS[name]
    stride = 2 if "stride2" in name else 1
    ref = LambdaLayer(16, 32, dim_k=8, heads=4, impl="einsum", stride=stride, **kwargs).double().to(DEVICE)
    fused = LambdaLayer(16, 32, dim_k=8, heads=4, impl="triton", stride=stride, **kwargs).double().to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    assert fused.plan(shape[2:]).position == "triton"
    x = torch.randn(*shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    y_ref, y = ref(x), fused(x)
    grad = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad(y_ref, [x, *ref.parameters()], grad)
    g = torch.autograd.grad(y, [x, *fused.parameters()], grad)
    # the kernel runs in fp32 on float64 inputs: relative error ~ terms * eps32 (terms <= 16 + 63 * 2 * 4 + 8)
    tol = 1000 * EPS32
    assert (y - y_ref).abs().max() <= tol * y_ref.abs().max()
    for (pn, _), a, b in zip([("x", None), *ref.named_parameters()], g, g_ref):
        assert (a - b).abs().max() <= tol * b.abs().max() + 1e-12, pn


def test_the_op_exports_and_passes_opcheck():
    """The custom op carries fake and autograd registrations: torch.library.opcheck and torch.export see it."""
    q, vals, table, center, spatial = _inputs(CASES["local3-6x9-u2"])
    op = torch.ops.lambdanet.lambda_position_output.default
    torch.library.opcheck(op, (q, vals, table, center[0], center[1], *spatial),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    layer = LambdaLayer(16, 32, dim_k=8, heads=4, r=5, impl="triton").eval()
    ep = torch.export.export(layer, (torch.randn(2, 16, 6, 9),))
    assert any("lambda_position_output" in str(n.target) for n in ep.graph.nodes)
    x = torch.randn(2, 16, 6, 9)
    torch.testing.assert_close(ep.module()(x), layer(x), rtol=0, atol=0)


def test_triton_impl_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match="impl='triton' needs a multi-query layer"):
        LambdaLayer(16, 32, impl="triton", multihead=True)
    with pytest.raises(ValueError, match="impl='triton' needs a multi-query layer"):
        LambdaLayer(16, 32, impl="triton", r=3, spatial_dims=3)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = kernels_available("cpu")
    assert not ok and "CUDA" in why and "TRITON_INTERPRET=1" in why


def test_kernels_compile_for_hopper_without_spills():
    """The interpreter cannot tell whether the kernels compile for a GPU: compile them ahead of time for
    compute capability 9.0 (H100 / H200) with Triton's bundled ptxas, in fp32 and bf16, in a process without
    TRITON_INTERPRET. None may spill to local memory; the bf16 kernels must use the matrix units (mma / wgmma
    instructions); fp32 ones multiply in full fp32 (FMAs: TF32 only when PyTorch's allow_tf32 says so)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from lambdanet.ops.position_lambda.triton_position import compile_report; "
            "print(json.dumps(compile_report()))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas is not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["dtype"]) for r in rows} == {(k, d) for k in ("forward", "backward_q", "backward_kv")
                                                         for d in ("fp32", "bf16")}
    for r in rows:
        assert r["local_loads"] == 0 and r["local_stores"] == 0 and r["cubin_bytes"] > 0, r
        assert (r["mma"] > 0) == (r["dtype"] == "bf16"), r
