"""The fused attention path (``impl="sdpa"``, ``F.scaled_dot_product_attention``) against the reference math
path (``impl="math"``) in every attention baseline: outputs and gradients of the input and of every parameter,
float64 and float32, non-square maps, sizes that are not multiples of the block, stride 2, rows whose every
key is masked, timm's HaloNet conventions; the dispatch policy; tracing and export of the default path.

Tolerance (Higham, Accuracy and Stability, Sec. 3.1): both paths compute the same function with differently
ordered rounded sums (SDPA's math backend scales ``q`` and ``k`` by ``sqrt(scale)`` each; its CPU kernel
accumulates blockwise), so each result is off from the exact one by at most about ``n eps`` times the
magnitudes summed, ``n`` the total length of the accumulations on its path: the input projection (``C``
channels), the logit (``d <= C``), the softmax normaliser and the weighted sum (at most ``H W`` keys each)
and, for the parameter gradients, the sum over the ``B H W`` positions. Magnitudes: the largest entry of
the reference result stands for the magnitudes summed (the outputs are convex combinations of values);
``SLACK`` covers the ratio. A wrong result (a lost mask, bias or gradient) is off by O(1) instead.
"""

import pytest
import torch

from lambdanet.layers import (
    AxialAttention,
    HaloAttention,
    LocalSelfAttention,
    RelativeSelfAttention,
    local_attention,
)
from lambdanet.layers.local_attention import BlockedLocalAttention
from lambdanet.layers.relative_attention import AttentionAugmentedConv
from lambdanet.layers.relative_position import (
    ATTENTION_IMPLS,
    attend,
    attend_math,
    attend_sdpa,
    attention_impl,
    auto_attention_impl,
    use_attention_impl,
)

SLACK = 4.0

# name -> (layer factory, input shape [B, C, H, W])
LAYERS = {
    "global_full": (lambda: RelativeSelfAttention(8, 8, feat_size=(5, 7), heads=2), (2, 8, 5, 7)),
    "global_half_cropped_stride2": (
        lambda: RelativeSelfAttention(8, 8, feat_size=(6, 7), heads=2, rel_split="half", stride=2), (2, 8, 5, 6)),
    "attention_augmented_conv": (
        lambda: AttentionAugmentedConv(8, 32, feat_size=(5, 6), heads=2, stride=2), (2, 8, 5, 6)),
    "halo": (lambda: HaloAttention(8, 16, block_size=4, halo_size=1, heads=2), (2, 8, 7, 9)),
    "halo_stride2": (lambda: HaloAttention(8, 16, block_size=4, halo_size=1, heads=2, stride=2), (2, 8, 7, 10)),
    "halo_pixel_centered": (  # padded queries whose window is all padding: rows with no key
        lambda: HaloAttention(8, 16, block_size=4, halo_size=1, heads=2, pixel_centered=True), (1, 8, 5, 9)),
    "halo_timm": (  # timm's checkpoint conventions, stride 2 by pooling
        lambda: HaloAttention(8, 16, block_size=4, halo_size=1, heads=2, stride=2, downsample="pool",
                              rel_split="full", rel_geometry="window", mask_padding=False), (2, 8, 7, 9)),
    "blocked_window_dim_qk": (
        lambda: BlockedLocalAttention(8, 8, block_size=3, halo_size=2, heads=2, dim_qk=12, window=3), (1, 8, 7, 5)),
    "sasa": (  # 9 = 8 + 1 rows: the padded queries of rows 11-15 see only padding
        lambda: LocalSelfAttention(8, 16, kernel_size=5, heads=2, block_size=8), (1, 8, 9, 6)),
    "sasa_stride2": (lambda: LocalSelfAttention(8, 16, kernel_size=3, heads=2, block_size=4, stride=2), (2, 8, 6, 7)),
    "axial": (lambda: AxialAttention(8, 16, feat_size=(5, 7), heads=2), (2, 8, 5, 7)),
    "axial_cropped_stride2": (lambda: AxialAttention(8, 16, feat_size=(6, 7), heads=2, stride=2), (2, 8, 5, 6)),
}


def n_terms(shape) -> int:
    """Accumulation lengths on a result's path: projection, logit, softmax sum, weighted sum, position sum."""
    b, c, h, w = shape
    return c + c + 2 * h * w + b * h * w


def run(layer: torch.nn.Module, x: torch.Tensor, impl: str) -> list[torch.Tensor]:
    """Output and the gradients of a fixed random projection of it w.r.t. the input and every parameter."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    with use_attention_impl(impl):
        out = layer(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * weights.to(out.dtype)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def assert_within(results, references, dtype, terms) -> None:
    eps = torch.finfo(dtype).eps
    for i, (res, ref) in enumerate(zip(results, references, strict=True)):
        assert res.dtype == ref.dtype == dtype
        bound = SLACK * terms * eps * ref.abs().max().item()
        err = (res - ref).abs().max().item()
        assert err <= bound, f"result {i}: max |sdpa - math| = {err:.3g} > {bound:.3g} ({terms} terms)"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LAYERS))
def test_sdpa_equals_math_with_gradients(name, dtype):
    build, shape = LAYERS[name]
    layer = build().to(dtype)
    x = torch.randn(shape, dtype=dtype)
    reference = run(layer, x, "math")
    assert all(g is not None for g in reference)
    assert_within(run(layer, x, "sdpa"), reference, dtype, n_terms(shape))


@pytest.mark.parametrize("name", ["global_full", "halo_pixel_centered", "halo_timm", "sasa", "axial"])
def test_sdpa_equals_math_without_grad(name):
    """Inference (no tensor requires grad): SDPA runs its fused (flash) CPU kernel instead of its math one."""
    build, shape = LAYERS[name]
    layer = build().double().eval()
    x = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        with use_attention_impl("math"):
            reference = layer(x)
        with use_attention_impl("sdpa"):
            out = layer(x)
    assert_within([out], [reference], torch.float64, n_terms(shape))


@pytest.mark.parametrize("name", ["halo_pixel_centered", "sasa"])
def test_layer_cases_reach_rows_with_no_key(name, monkeypatch):
    """The configurations above do hand attend a query row whose every key is masked (a padded query)."""
    masks = []

    def recording_attend(q, k, v, bias=None, mask=None, scale=1.0):
        masks.append(mask)
        return attend(q, k, v, bias, mask, scale)

    monkeypatch.setattr(local_attention, "attend", recording_attend)
    build, shape = LAYERS[name]
    build()(torch.randn(shape))
    assert len(masks) == 1 and (~masks[0].any(dim=-1)).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attend_rows_with_no_key_are_uniform_averages_with_zero_query_and_bias_gradients(dtype):
    q = torch.randn(2, 3, 6, 4, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 5, 4, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 3, 5, 3, dtype=dtype, requires_grad=True)
    bias = torch.randn(2, 3, 6, 5, dtype=dtype, requires_grad=True)
    mask = torch.rand(6, 5) > 0.4
    mask[0], mask[4] = False, True  # a row with no key, a row with every key
    results = {}
    for impl in ("math", "sdpa"):
        out = attend(q, k, v, bias, mask, scale=0.5, impl=impl)
        results[impl] = [out.detach(), *torch.autograd.grad((out * out.detach()).sum(), (q, k, v, bias))]
    assert_within(results["sdpa"], results["math"], dtype, 4 + 2 * 5)
    out, grad_q, _, _, grad_bias = results["sdpa"]
    mean_error = (out[:, :, 0] - v.detach().mean(dim=-2)).abs().max().item()
    assert mean_error <= SLACK * 5 * torch.finfo(dtype).eps * v.abs().max().item()  # a 5-term average
    assert not grad_q[:, :, 0].any() and not grad_bias[:, :, 0].any()
    assert torch.isfinite(torch.cat([t.flatten() for t in results["sdpa"]])).all()


def test_bfloat16_sdpa_keeps_float32_reductions_even_when_half_reductions_are_allowed():
    """SDPA's math backend reduces half inputs in half precision once the switch allows it (on CPU too);
    attend_sdpa then upcasts itself (autocast, which would cast back, off), so the result equals the default
    float32-reduction one."""
    q, k, v = (torch.randn(2, 2, 40, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 2, 40, 40, dtype=torch.bfloat16, requires_grad=True)
    default = attend_sdpa(q, k, v, bias, scale=8 ** -0.5)
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        upcast = attend_sdpa(q, k, v, bias, scale=8 ** -0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            upcast_autocast = attend_sdpa(q, k, v, bias, scale=8 ** -0.5)
        in_half = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=8 ** -0.5)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    assert upcast.dtype == torch.bfloat16
    assert torch.equal(upcast, default) and torch.equal(upcast_autocast, default)
    assert not torch.equal(in_half, default)  # the switch does change SDPA's own reductions


def test_policy_picks_sdpa_on_cuda_and_for_half_inputs_and_math_on_cpu():
    assert auto_attention_impl("cpu", torch.float32) == "math"
    assert auto_attention_impl("cpu", torch.float64) == "math"
    assert auto_attention_impl("cpu", torch.bfloat16) == "sdpa"
    assert auto_attention_impl("cpu", torch.float16) == "sdpa"
    assert auto_attention_impl(torch.device("cuda", 0), torch.float32) == "sdpa"
    assert auto_attention_impl("cuda", torch.float64) == "sdpa"
    q = torch.randn(1, 2, 3)
    assert attention_impl(q) == "math"
    with use_attention_impl("sdpa"):
        assert attention_impl(q) == "sdpa"
        assert attention_impl(q, "math") == "math"  # an explicit impl wins over the forced one
        with use_attention_impl("auto"):
            assert attention_impl(q) == "math"
        assert attention_impl(q) == "sdpa"
    assert attention_impl(q) == "math"
    assert set(ATTENTION_IMPLS) == {"auto", "math", "sdpa"}


def test_default_cpu_path_is_the_math_code_bit_for_bit():
    build, shape = LAYERS["halo"]
    layer = build()
    x = torch.randn(shape)
    with use_attention_impl("math"):
        reference = layer(x)
    assert torch.equal(layer(x), reference)
    q, k, v = torch.randn(2, 5, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 3)
    assert torch.equal(attend(q, k, v, scale=0.5), attend_math(q, k, v, scale=0.5))


@pytest.mark.parametrize("bad", ["flash", "flex", "", None])
def test_unknown_impl_raises_value_error_naming_impl(bad):
    q = torch.randn(1, 2, 3)
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', 'math', 'sdpa'\]"):
        attend(q, q, q, impl=bad)
    with pytest.raises(ValueError, match="impl must be one of"), use_attention_impl(bad):
        pass


@pytest.mark.parametrize("impl", ["auto", "sdpa"])
@pytest.mark.parametrize("name", ["global_full", "sasa", "axial"])
def test_trace_and_export_equal_eager(name, impl):
    """The default path (math on CPU) and the SDPA path both trace and export; the graphs replay eager."""
    build, shape = LAYERS[name]
    layer = build().eval()
    x = torch.randn(shape)
    with use_attention_impl(impl), torch.no_grad():
        eager = layer(x)
        traced = torch.jit.trace(layer, x, check_trace=False)
        exported = torch.export.export(layer, (x,)).module()
    with torch.no_grad():  # the trace and the program replay the implementation recorded while tracing
        assert_within([traced(x), exported(x)], [eager, eager], torch.float32, n_terms(shape))


def test_sdpa_path_compiles_without_graph_breaks():
    """torch.compile (GPU benchmarks, training) sees one graph: the policy, the half-precision switch and the
    kernel selection are all resolved while tracing."""
    build, shape = LAYERS["sasa"]
    layer = build().to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with use_attention_impl("sdpa"):
        out = torch.compile(layer, fullgraph=True, backend="eager")(x)
        out.float().sum().backward()
        torch.testing.assert_close(out, layer(x), rtol=0, atol=0)
    torch._dynamo.reset()
