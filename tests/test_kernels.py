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
    # five query tiles, a context span per tile (16 + 40 - 1) wider than BLOCK_M: the table gradient's loop
    "causal-1d-70": ((70,), (40,), (39,), 1, 2, 4, 8),
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
    """The longest dot product behind an output, ``dq`` or ``dV`` element (per context position and u, the k
    products of S, then the sum over positions, heads and v): a sum of sums has the error bound of one sum as
    long as both."""
    b, n, h, k = q.shape
    v, u = vals.shape[2:]
    return k + n * u * max(h, 1) + v


def _table_terms(q, vals, splits: int | None = None):
    """The same for a table-gradient element: ``dS`` sums over v, then ``q^T dS`` over the batch, positions and
    heads, in ``splits`` partial sums added at the end (at most one per batch element and query tile of 16,
    the default)."""
    b, n, h, k = q.shape
    return vals.shape[2] + b * n * max(h, 1) + (b * -(-n // 16) if splits is None else splits)


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
        terms = _table_terms(q, vals) + 4 if label == "table" else t
        assert got.shape == want.shape, label
        assert ((got.double() - want).abs() <= terms * EPS32 * bound + 1e-30).all(), label
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_accumulate_in_fp32(dtype):
    """The backward on half-precision operands: ``dS = dy V^T`` accumulates in fp32; the dot products of
    ``dV = S^T dy`` and of the table's ``dR = q^T dS`` take ``S`` and ``dS`` rounded to the half type (one
    unit roundoff ``u`` of each term, as the forward's ``S V``; fp16's ``dS`` takes TF32, whose ``u`` is fp16's
    with float32's range), and each gradient is rounded to the input's type at the end (``u`` of it, ``eps`` for
    a truncating rounding, as the forward's test allows): ``|g - ref| <= eps sum|terms| + eps |ref|``
    (``eps = 2 u``), plus the fp32 sums' ``terms * eps32 * sum|terms|``."""
    q, vals, table, center, spatial = _inputs(CASES["causal-1d-70"], dtype)
    args = [t.double().requires_grad_() for t in (q, vals, table)]
    ref = lambda_position_output_reference(*args, center, spatial)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    ref_grads = torch.autograd.grad(ref, args, grad.double())
    absolute = [t.detach().abs().requires_grad_() for t in args]
    bound_y = lambda_position_output_reference(*absolute, center, spatial)
    bound_grads = torch.autograd.grad(bound_y, absolute, grad.double().abs())
    ins = [x.clone().requires_grad_() for x in (q, vals, table)]
    grads = torch.autograd.grad(lambda_position_output(*ins, center, spatial), ins, grad)
    eps = torch.finfo(dtype).eps
    for got, want, bound, label in zip(grads, ref_grads, bound_grads, ("q", "values", "table")):
        t = (_table_terms(q, vals) if label == "table" else _terms(q, vals, table)) + 4
        assert got.dtype == dtype, label
        limit = (eps + t * EPS32) * bound + eps * want.abs() + 1e-6
        assert ((got.double() - want).abs() <= limit).all(), label


def test_the_fp16_table_gradient_keeps_float32_range_for_ds():
    """fp16 under a loss scale: ``dS = dy V^T`` (here ~ 16 x 300 x 30 = 1.4e5) exceeds fp16's largest value
    (65504) while the table gradient ``q^T dS`` (small queries) does not: rounding ``dS`` to fp16 for the
    product would make it inf. The fp16 kernel takes ``dS`` in TF32 (fp16's precision, float32's range): finite,
    and within the half-precision bound of the test above."""
    q, vals, table, center, spatial = _inputs(CASES["causal-1d-70"], torch.float32)
    q, vals = (q * 1e-3).half(), (vals * 30).clamp(-60, 60).half()
    table = table.half()
    grad = (torch.randn(q.shape[:3] + (vals.shape[2],), generator=torch.Generator().manual_seed(3)) * 300).half()
    args = [t.double().requires_grad_() for t in (q, vals, table)]
    ref = lambda_position_output_reference(*args, center, spatial)
    want = torch.autograd.grad(ref, args[2], grad.double())[0]
    absolute = [t.detach().abs().requires_grad_() for t in args]
    bound = torch.autograd.grad(lambda_position_output_reference(*absolute, center, spatial), absolute[2],
                                grad.double().abs())[0]
    ins = [x.clone().requires_grad_() for x in (q, vals, table)]
    got = torch.autograd.grad(lambda_position_output(*ins, center, spatial), ins[2], grad)[0]
    ds = torch.einsum("bnhv,bmvu->bnmhu", grad.double(), vals.double())  # dS of every pair
    n = torch.arange(q.shape[1])
    band = (n[None, :] - n[:, None] + center[0] >= 0) & (n[None, :] - n[:, None] + center[0] < table.shape[-1])  # n m
    assert ds[:, band].abs().max() > 65504 and want.abs().max() < 6e4  # dS out of fp16's range, dR inside
    eps, t = torch.finfo(torch.float16).eps, _table_terms(q, vals) + 4
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= (eps + t * EPS32) * bound + eps * want.abs() + 1e-6).all()


@pytest.mark.parametrize("splits", [1, 2, 4, 7, 10])
def test_the_table_gradient_is_the_same_however_the_batch_is_split(monkeypatch, splits):
    """The table gradient's programs each own a partial sum over a range of (batch, query tile) items,
    summed after the launch: one range, uneven ranges (10 items in 4 splits: 3, 3, 3, 1), empty ones (7 splits
    of 2: the last two hold none, their programs write zeros into the uninitialised buffer) and one item per
    split give the float64 gradient within the same bound."""
    from lambdanet.ops.position_lambda import triton_position

    monkeypatch.setattr(triton_position, "table_splits", lambda items, programs, device: min(items, splits))
    q, vals, table, center, spatial = _inputs(CASES["causal-1d-70"])
    ref_args = [t.double().requires_grad_() for t in (q, vals, table)]
    ref = lambda_position_output_reference(*ref_args, center, spatial)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    want = torch.autograd.grad(ref, ref_args[2], grad)[0]
    absolute = [t.detach().abs().requires_grad_() for t in ref_args]
    bound = torch.autograd.grad(lambda_position_output_reference(*absolute, center, spatial), absolute[2],
                                grad.abs())[0]
    table_in = table.clone().requires_grad_()
    got = torch.autograd.grad(lambda_position_output(q, vals, table_in, center, spatial), table_in, grad.float())[0]
    assert q.shape[0] * -(-q.shape[1] // 16) == 10  # the items: 2 batch elements x 5 query tiles of 16
    assert ((got.double() - want).abs() <= (_table_terms(q, vals, splits) + 4) * EPS32 * bound + 1e-30).all()


def test_no_kernel_program_reads_or_writes_what_another_of_its_launch_writes(reverse_grid):
    """A launch's programs run at the same time on a GPU, one after another in grid order in Triton's interpreter
    (tests/test_ops_causal.py has the same check): in the reverse order the forward, the query gradient (each
    program adds into its own rows of dq), the value gradient and the table gradient (three splits of partial
    sums) give the same bits, on a 2-d map with u = 2 and on five query tiles of a 1-d causal table."""

    def call(name):
        q, vals, table, center, spatial = _inputs(CASES[name])
        xs = [t.clone().requires_grad_() for t in (q, vals, table)]
        y = lambda_position_output(*xs, center, spatial)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE))
        return [y, *(t.grad for t in xs)]

    names = ("local3-6x9-u2", "causal-1d-70")
    in_order = [call(name) for name in names]
    reverse_grid()
    for name, before in zip(names, in_order):
        for a, b in zip(before, call(name), strict=True):
            assert torch.equal(a, b), name


def _far_apart(x: torch.Tensor, stride: int) -> torch.Tensor:
    """``x`` copied into a tensor whose batch elements lie ``stride`` elements apart: the storage is reserved,
    not written (the pages between the elements are never touched), so 2^31 float32 elements cost a few KB."""
    try:
        far = torch.empty_strided(x.shape, (stride, *x.stride()[1:]), dtype=x.dtype, device=x.device)
    except RuntimeError as err:  # a host that refuses to reserve more than it has (strict overcommit)
        gib = (x.shape[0] - 1) * stride * x.element_size() / 2**30
        pytest.skip(f"cannot reserve {gib:.0f} GiB of address space here ({err})")
    return far.copy_(x)


@pytest.mark.skipif(DEVICE != "cpu", reason="the storage is reserved, not used, on the CPU only")
def test_batch_offsets_past_two_to_the_31_elements_are_addressed_in_int64():
    """A batch element 2^31 elements or more from the first (a large batch of large maps) is addressed with
    int64 offsets: in int32, ``b * stride`` wraps and the kernels read and write outside the tensors (under the
    interpreter, as on a GPU: a crash or wrong numbers). Every kernel, forward and backward, on tensors whose
    three batch elements lie 2^30 elements apart gives what it gives on the same values stored contiguously,
    bit for bit (each batch element's arithmetic is the same; the table gradient's items are split alike)."""
    from lambdanet.ops.position_lambda.triton_position import launch_backward, launch_forward

    q, vals, table, center, spatial = _inputs(CASES["causal-1d-13"], b=3)
    grad = torch.randn(*q.shape[:3], vals.shape[2], generator=torch.Generator().manual_seed(3))
    stride = 2**30  # below 2^31, so Triton passes it as int32; the third element starts at 2^31
    results = []
    for place in (lambda x: x.contiguous(), lambda x: _far_apart(x, stride)):
        qq, vv, gg = place(q), place(vals), place(grad)
        out = place(torch.zeros_like(grad))
        dq, dv = place(torch.zeros_like(q)), place(torch.zeros_like(vals))
        dtable = torch.zeros_like(table)
        launch_forward(qq, vv, table, center, spatial, out)
        launch_backward(gg, qq, vv, table, center, spatial, dq, dv, dtable)
        results.append([t.clone() for t in (out, dq, dv, dtable)])
        del qq, vv, gg, out, dq, dv
    for near, far, label in zip(*results, ("output", "q", "values", "table")):
        assert torch.equal(near, far), label


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


@pytest.mark.slow  # (20-35 s of ptxas: a change to the kernels runs -m slow, CONTRIBUTING.md)
def test_kernels_compile_for_hopper_and_the_table_gradient_does_not_spill():
    """The interpreter cannot tell whether the kernels compile for a GPU: compile them ahead of time for
    compute capability 9.0 (H100 / H200) with Triton's bundled ptxas, in fp32, bf16 and fp16, in a process
    without TRITON_INTERPRET, and read the register spills in the machine code (LDL / STL). Half-precision
    kernels use the matrix units (mma / wgmma); fp32 ones multiply in full fp32 (FMAs: TF32 only when
    PyTorch's allow_tf32 says so). No spills: the table gradient in every dtype at 4 heads x 64 channels, and
    in bf16 and fp16 at 8 x 256 (fp32 there: 2 loads and 4 stores); the forward and the query gradient in bf16
    (training's dtype). The others spill (BENCHMARKS.md section 8: fp32, and 8 heads x 256 channels, are what
    the GPU tuning has still to fix). The counter itself: the table kernel
    at 4 warps with 64-channel slices spills in fp32, and it must see that."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from lambdanet.ops.position_lambda.report import compile_report as c; "
            "print(json.dumps([c(dtypes=('fp32', 'bf16', 'fp16')), "
            "c(block_h=8, block_v=256, dtypes=('bf16', 'fp16'), kernels=('backward_table',)), "
            "c(num_warps=4, table_vc=64, kernels=('backward_table',), dtypes=('fp32',))]))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and any(tool in proc.stderr for tool in ("ptxas", "nvdisasm")) and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas / nvdisasm are not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    default, wide, control = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels = ("forward", "backward_q", "backward_kv", "backward_table")
    assert {(r["kernel"], r["dtype"]) for r in default} == {(k, d) for k in kernels for d in ("fp32", "bf16", "fp16")}
    for r in default + wide:
        assert r["cubin_bytes"] > 0 and (r["mma"] > 0) == (r["dtype"] != "fp32"), r
        if r["kernel"] == "backward_table" or (r["dtype"] == "bf16" and r["kernel"] in ("forward", "backward_q")):
            assert r["spill_loads"] == 0 and r["spill_stores"] == 0, r
        # Triton 3.6's ptxas alone gave the float32 query gradient 32 registers and 1,026 local loads (3.8's: 255):
        # it launches with maxnreg
        assert r["registers"] > 32, r
    assert control[0]["spill_stores"] > 0, control


def test_shapes_that_do_not_fit_each_other_are_one_line_errors_before_any_kernel():
    """The kernels index q, the values and the table by the sizes the arguments give: a table of another k or u,
    values or a spatial size of another n, or a centre outside the table would read other entries (on a GPU past
    the buffers). Each is refused, naming the argument, before a kernel runs."""
    q, vals, table = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 3, 1), torch.randn(4, 1, 3, 3)
    lambda_position_output(q, vals, table, (1, 1), (2, 3))  # fits
    for args, needle in (((q, vals, torch.randn(6, 1, 3, 3), (1, 1), (2, 3)), "table needs [k, u, ...]"),
                         ((q, vals, torch.randn(4, 2, 3, 3), (1, 1), (2, 3)), "table needs [k, u, ...]"),
                         ((q, torch.randn(1, 8, 3, 1), table, (1, 1), (2, 4)), "n = prod(spatial) = 8"),
                         ((q, vals, table, (1, 1), (2, 2)), "n = prod(spatial) = 4"),
                         ((q, vals, table, (1, 3), (2, 3)), "center (1, 3) must index the table's (3, 3)"),
                         ((q, vals, torch.randn(4, 1, 3), (1, 1), (2, 3)), "table [k, u, *T] of 2 table dims"),
                         ((q, vals, table, (1,), (2, 3)), "a center per spatial dim expected"),
                         # the batch on the grids' second axis: at most 65535 programs there on a GPU
                         ((torch.empty(65536, 1, 1, 4), torch.empty(65536, 1, 3, 1), torch.randn(4, 1, 1), (0,),
                           (1,)), "a batch b of at most 65535")):
        with pytest.raises(ValueError, match="^lambda_position_output: ") as err:
            lambda_position_output(*args)
        assert needle in str(err.value) and "\n" not in str(err.value)
