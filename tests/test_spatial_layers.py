"""Baseline spatial layers against naive per-pixel references, invariances and the registry contract."""

import inspect

import pytest
import torch

from lambdanet.layers import (
    AxialAttention,
    DoubleAttention,
    EfficientAttention,
    HaloAttention,
    LambdaLayer,
    LocalSelfAttention,
    RelativeSelfAttention,
    create_spatial_layer,
    list_spatial_layers,
    spatial_layer_info,
)
from lambdanet.layers.linear_attention import ConvPlusAttention
from lambdanet.layers.local_attention import BlockedLocalAttention

DTYPES = [torch.float32, torch.float64]

# Forward error of a chain of rounded accumulations (Higham, Accuracy and Stability, Sec. 3.1): a sum of ``n``
# rounded products is off by at most ``n eps`` times the sum of their magnitudes. Every output here is an
# average (softmax weights sum to 1) of projected values no larger than a few times the largest output, and
# the O(1) logits pass through ``exp`` (relative error ``|l| eps``): SLACK covers these magnitude ratios.
SLACK = 4.0


def assert_close_to_reference(out, ref, terms):
    """``max |out - ref| <= SLACK * eps(out.dtype) * terms * max |ref|``; ``terms`` counts the accumulated
    products along the computation (projection depth + logit depth + number of keys, ...)."""
    assert out.shape == ref.shape
    bound = SLACK * torch.finfo(out.dtype).eps * terms * ref.double().abs().max().item()
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= bound, f"max |out - ref| = {err:.3g} exceeds {bound:.3g} ({out.dtype}, {terms} terms)"


def project(conv, x):
    """A 1x1 convolution as a matrix product: [B, C, H, W] -> [B, H, W, C_out]."""
    out = torch.einsum("oc,bchw->bhwo", conv.weight[:, :, 0, 0].double(), x.double())
    if conv.bias is not None:
        out = out + conv.bias.double()
    return out


def naive_attention_at(q, ks, vs, rel_terms, scale):
    """softmax over an explicit list of keys: q [d], ks [K, d], vs [K, dv], rel_terms [K]."""
    logits = ks @ q * scale + rel_terms
    return torch.softmax(logits, dim=0) @ vs


def rel_term(q, layer_rel, da, dc):
    """Relative logit for offsets (da, dc) with the layer's factorised tables."""
    oh, ow = layer_rel.max_offset
    th, tw = layer_rel.rel_h.double(), layer_rel.rel_w.double()
    ia, ic = min(max(da + oh, 0), 2 * oh), min(max(dc + ow, 0), 2 * ow)
    if layer_rel.split == "full":
        return q @ th[ia] + q @ tw[ic]
    half = th.shape[1]
    return q[:half] @ th[ia] + q[half:] @ tw[ic]


def naive_neighbourhood_attention(layer, qconv, kvconv, x, neighbours, dim_qk, dim_out, heads, query_stride=1):
    """Per query pixel: attention over ``neighbours(i, j)`` (a list of (a, c) image positions)."""
    b, _, hh, ww = x.shape
    q = project(qconv, x[..., ::query_stride, ::query_stride])  # b hq wq dqk
    kv = project(kvconv, x)
    k, v = kv[..., :dim_qk], kv[..., dim_qk:]
    dk, dv = dim_qk // heads, dim_out // heads
    hq, wq = q.shape[1:3]
    out = torch.zeros(b, dim_out, hq, wq, dtype=torch.float64)
    for bi in range(b):
        for i in range(hq):
            for j in range(wq):
                pi, pj = i * query_stride, j * query_stride
                nb = neighbours(pi, pj)
                for hd in range(heads):
                    qv = q[bi, i, j, hd * dk:(hd + 1) * dk]
                    ks = torch.stack([k[bi, a, c, hd * dk:(hd + 1) * dk] for a, c in nb])
                    vs = torch.stack([v[bi, a, c, hd * dv:(hd + 1) * dv] for a, c in nb])
                    rel = torch.stack([rel_term(qv, layer.rel, a - pi, c - pj) for a, c in nb])
                    out[bi, hd * dv:(hd + 1) * dv, i, j] = naive_attention_at(qv, ks, vs, rel, dk ** -0.5)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_relative_attention_matches_naive_loop(dtype):
    layer = RelativeSelfAttention(6, 8, feat_size=(5, 7), heads=2, dim_qk=6).to(dtype)
    x = torch.randn(2, 6, 4, 6, dtype=dtype)  # smaller than feat_size: cropped relative tables
    hh, ww = 4, 6
    allpos = [(a, c) for a in range(hh) for c in range(ww)]
    qconv = torch.nn.Conv2d(6, 6, 1, bias=False, dtype=dtype)
    kvconv = torch.nn.Conv2d(6, 14, 1, bias=False, dtype=dtype)
    w = layer.qkv.weight
    qconv.weight.data, kvconv.weight.data = w[:6].clone(), w[6:].clone()
    ref = naive_neighbourhood_attention(layer, qconv, kvconv, x, lambda i, j: allpos, 6, 8, 2)
    out = layer(x)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, terms=6 + 3 + hh * ww)  # projection, logit depth, keys
    layer2 = RelativeSelfAttention(6, 8, feat_size=(5, 7), heads=2, dim_qk=6, stride=2).to(dtype)
    layer2.load_state_dict(layer.state_dict())
    pooled = torch.nn.functional.avg_pool2d(out, 2, 2, ceil_mode=True)
    assert_close_to_reference(layer2(x), pooled, terms=4)  # the same attention, then 2x2 means


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [3, 4, 8])
def test_sasa_equals_per_pixel_window_attention(block_size, dtype):
    """Every pixel attends to the k x k window centred on it (clipped at the border), whatever the block."""
    k = 3
    layer = LocalSelfAttention(4, 8, kernel_size=k, heads=2, block_size=block_size).to(dtype)
    x = torch.randn(2, 4, 5, 7, dtype=dtype)

    def window(i, j):
        return [(a, c) for a in range(i - k // 2, i + k // 2 + 1) for c in range(j - k // 2, j + k // 2 + 1)
                if 0 <= a < 5 and 0 <= c < 7]

    ref = naive_neighbourhood_attention(layer.attn, layer.attn.q, layer.attn.kv, x, window, 8, 8, 2)
    out = layer(x)
    assert out.dtype == dtype
    # the blocked layer sums over the whole padded (block + 2 halo)^2 window (masked keys add exact zeros)
    assert_close_to_reference(out, ref, terms=4 + 4 + (block_size + 2 * (k // 2)) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stride,shape", [(1, (9, 10)), (2, (9, 10)), (1, (8, 8)), (2, (12, 7))])
def test_halo_attention_matches_naive_block_neighbourhoods(stride, shape, dtype):
    bs, hs = 4, 1
    layer = HaloAttention(4, 8, block_size=bs, halo_size=hs, heads=2, stride=stride).to(dtype)
    x = torch.randn(1, 4, *shape, dtype=dtype)
    hh, ww = shape

    def neighbourhood(i, j):  # the block containing (i, j) plus its halo, clipped to the image
        r0, c0 = (i // bs) * bs, (j // bs) * bs
        return [(a, c) for a in range(r0 - hs, r0 + bs + hs) for c in range(c0 - hs, c0 + bs + hs)
                if 0 <= a < hh and 0 <= c < ww]

    ref = naive_neighbourhood_attention(layer, layer.q, layer.kv, x, neighbourhood, 8, 8, 2, query_stride=stride)
    out = layer(x)
    assert out.shape == (1, 8, -(-hh // stride), -(-ww // stride)) and out.dtype == dtype
    assert_close_to_reference(out, ref, terms=4 + 4 + (bs + 2 * hs) ** 2)


def test_halo_with_one_block_equals_global_attention_with_same_weights():
    side = 6
    halo = HaloAttention(4, 8, block_size=side, halo_size=0, heads=2)
    glob = RelativeSelfAttention(4, 8, feat_size=side, heads=2, rel_split="half")
    with torch.no_grad():
        glob.qkv.weight.copy_(torch.cat([halo.q.weight, halo.kv.weight]))
        glob.rel.rel_h.copy_(halo.rel.rel_h)
        glob.rel.rel_w.copy_(halo.rel.rel_w)
    x = torch.randn(2, 4, side, side)
    assert_close_to_reference(halo(x), glob(x), terms=2 * (4 + 4 + side * side))  # two rounded computations


def _shift_pair(layer, shift, size=16, channels=4):
    x1 = torch.zeros(1, channels, size, size)
    x2 = x1.clone()
    pat = torch.randn(1, channels, 4, 5)
    x1[..., 5:9, 4:9] = pat
    x2[..., 5 + shift[0]:9 + shift[0], 4 + shift[1]:9 + shift[1]] = pat
    return torch.roll(layer(x1), shifts=shift, dims=(2, 3)), layer(x2)


def test_masked_halo_is_translation_equivariant_and_unmasked_is_not():
    torch.manual_seed(1)
    terms = 2 * (4 + 4 + (4 + 2 * 2) ** 2)  # two rounded computations over (block + 2 halo)^2 windows
    masked = HaloAttention(4, 8, block_size=4, halo_size=2, heads=2, pixel_centered=True)
    a, b = _shift_pair(masked, (1, 3))
    assert_close_to_reference(a, b, terms)
    unmasked = HaloAttention(4, 8, block_size=4, halo_size=2, heads=2)
    a, b = _shift_pair(unmasked, (1, 3))
    assert (a - b).abs().max() > 1e-3  # only equivariant to shifts by multiples of the block
    assert (a - b).abs().max() > 0.1 * b.abs().max()  # a change of the order of the outputs, not rounding


def test_sasa_is_translation_equivariant():
    layer = LocalSelfAttention(4, 8, kernel_size=5, heads=2, block_size=4)
    a, b = _shift_pair(layer, (2, 1))
    assert_close_to_reference(a, b, terms=2 * (4 + 4 + (4 + 2 * 2) ** 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_axial_attention_matches_naive_loop(dtype):
    layer = AxialAttention(4, 6, feat_size=(5, 6), heads=2).to(dtype)
    x = torch.randn(1, 4, 4, 5, dtype=dtype)

    def axis_attention(mod, inp, axis):
        b, _, hh, ww = inp.shape
        qkv = project(mod.qkv, inp)  # b H W 3C
        q, k, v = qkv.split(mod.dim_out, dim=-1)
        h, d = mod.heads, mod.dim_out // mod.heads
        out = torch.zeros(b, mod.dim_out, hh, ww, dtype=torch.float64)
        table = mod.rel.rel.double()
        o = mod.rel.max_offset
        for i in range(hh):
            for j in range(ww):
                line = [(a, j) for a in range(hh)] if axis == 2 else [(i, c) for c in range(ww)]
                for hd in range(h):
                    sl = slice(hd * d, (hd + 1) * d)
                    qv = q[0, i, j, sl]
                    ks = torch.stack([k[0, a, c, sl] for a, c in line])
                    vs = torch.stack([v[0, a, c, sl] for a, c in line])
                    offs = [(a - i) if axis == 2 else (c - j) for a, c in line]
                    rel = torch.stack([qv @ table[off + o] for off in offs])
                    out[0, sl, i, j] = naive_attention_at(qv, ks, vs, rel, d ** -0.5)
        return out

    mid = axis_attention(layer.height, x, 2)
    ref = axis_attention(layer.width, mid.to(dtype), 3)  # the layer rounds its intermediate to dtype too
    out = layer(x)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref, terms=(4 + 3 + 4) + (6 + 3 + 5))  # height pass + width pass


@pytest.mark.parametrize("dtype", DTYPES)
def test_efficient_attention_matches_naive_loop(dtype):
    layer = EfficientAttention(6, dim_k=4, dim_v=6, heads=2).to(dtype)
    x = torch.randn(2, 6, 3, 4, dtype=dtype)
    qkv = project(layer.qkv, x).reshape(2, 12, -1)  # b n c
    q, k, v = qkv[..., :4], qkv[..., 4:8], qkv[..., 8:]
    out = torch.zeros(2, 12, 6, dtype=torch.float64)
    for bi in range(2):
        for hd in range(2):
            qh = q[bi, :, hd * 2:(hd + 1) * 2].softmax(dim=1)  # per position over channels
            kh = k[bi, :, hd * 2:(hd + 1) * 2].softmax(dim=0)  # per channel over positions
            vh = v[bi, :, hd * 3:(hd + 1) * 3]
            for n in range(12):  # y_n = sum_j qbar_n[j] sum_m kbar_m[j] v_m
                out[bi, n, hd * 3:(hd + 1) * 3] = sum(qh[n, j] * sum(kh[m, j] * vh[m] for m in range(12))
                                                     for j in range(2))
    proj = layer.proj.weight[:, :, 0, 0].double()
    ref = x.double() + (torch.einsum("oc,bnc->bon", proj, out) + layer.proj.bias.double()[:, None]).view(2, 6, 3, 4)
    y = layer(x)
    assert y.dtype == dtype
    assert_close_to_reference(y, ref, terms=6 + 12 + 2 + 6 + 1)  # qkv, context over n, k, proj, residual


@pytest.mark.parametrize("dtype", DTYPES)
def test_double_attention_matches_naive_loop(dtype):
    layer = DoubleAttention(6, c_m=3, c_n=2).to(dtype)
    x = torch.randn(1, 6, 3, 3, dtype=dtype)
    abv = project(layer.conv_abv, x).reshape(1, 9, -1)[0]  # n c
    a, bm, v = abv[:, :3], abv[:, 3:5], abv[:, 5:]
    att_maps = bm.softmax(dim=0)  # over positions, per descriptor
    g = sum(torch.outer(a[m], att_maps[m]) for m in range(9))  # c_m c_n global descriptors
    z = torch.stack([g @ v[n].softmax(dim=0) for n in range(9)])  # n c_m
    proj = layer.proj.weight[:, :, 0, 0].double()
    ref = x.double() + (z @ proj.t() + layer.proj.bias.double()).t().reshape(1, 6, 3, 3)
    y = layer(x)
    assert y.dtype == dtype
    assert_close_to_reference(y, ref, terms=6 + 9 + 2 + 3 + 1)  # abv, gather over n, distribute, proj, residual


def test_attention_augmented_conv_concatenates_conv_and_projected_attention():
    layer = create_spatial_layer("attention_augmented_conv", 16, 40, feat_size=6, heads=4)
    x = torch.randn(2, 16, 6, 6)
    y = layer(x)
    dv = layer.proj.out_channels
    assert y.shape == (2, 40, 6, 6) and 0 < dv < 40 and dv % 4 == 0
    assert_close_to_reference(y[:, : 40 - dv], layer.conv(x), terms=1)  # the same computations
    assert_close_to_reference(y[:, 40 - dv:], layer.proj(layer.attn(x)), terms=1)


def test_registry_builds_the_documented_layers():
    assert set(list_spatial_layers()) >= {
        "conv", "conv_se", "linear_attention", "double_attention", "relative_self_attention",
        "attention_augmented_conv", "local_self_attention", "axial_self_attention", "halo_attention",
        "lambda", "lambda_conv"}
    lam = create_spatial_layer("lambda", 16, 32, feat_size=8)
    assert isinstance(lam, LambdaLayer) and lam.r is None and lam.feat_size == (8, 8)
    conv = create_spatial_layer("lambda_conv", 16, 32, r=7)
    assert isinstance(conv, LambdaLayer) and conv.r == 7
    assert isinstance(create_spatial_layer("double_attention", 8, 8, c_m=2), ConvPlusAttention)


@pytest.mark.parametrize("name", list_spatial_layers())
@pytest.mark.parametrize("stride", [1, 2])
def test_every_layer_shapes_gradients_and_bf16(name, stride):
    kwargs = {"heads": 2} if name in ("relative_self_attention", "local_self_attention", "axial_self_attention",
                                      "halo_attention", "attention_augmented_conv") else {}
    if name == "lambda_conv":
        kwargs["r"] = 5
    layer = create_spatial_layer(name, 16, 32, stride=stride, feat_size=(10, 13), **kwargs)
    x = torch.randn(2, 16, 10, 13)  # non-square, not a multiple of any block size
    y = layer(x)
    assert y.shape == (2, 32, -(-10 // stride), -(-13 // stride))
    (y.float() ** 2).mean().backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, (name, pname)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = layer(x * 20)
    assert torch.isfinite(yb.float()).all()


@pytest.mark.parametrize("name", list_spatial_layers())
def test_every_layer_rejects_wrong_channels(name):
    layer = create_spatial_layer(name, 16, 32, feat_size=8)
    with pytest.raises(ValueError, match="16"):
        layer(torch.randn(1, 12, 8, 8))


@pytest.mark.parametrize("name", ["relative_self_attention", "axial_self_attention", "attention_augmented_conv",
                                  "lambda"])
def test_global_layers_need_and_check_feat_size(name):
    with pytest.raises(ValueError, match="feat_size"):
        create_spatial_layer(name, 16, 32)
    layer = create_spatial_layer(name, 16, 32, feat_size=8)
    with pytest.raises(ValueError, match="feat_size"):
        layer(torch.randn(1, 16, 9, 8))


@pytest.mark.parametrize(
    "build,needle",
    [
        (lambda: create_spatial_layer("nope", 8), "unknown spatial layer 'nope'; valid names: attention_augmented"),
        (lambda: create_spatial_layer("conv", 8, kernel=3), "does not take ['kernel']; it accepts: kernel_size"),
        (lambda: create_spatial_layer("local_self_attention", 8, kernel_size=4), "kernel_size must be a positive odd"),
        (lambda: create_spatial_layer("halo_attention", 8, block_size=0), "block_size must be a positive int"),
        (lambda: create_spatial_layer("halo_attention", 8, block_size=6, stride=4), "stride=4 must divide block"),
        (lambda: create_spatial_layer("halo_attention", 8, halo_size=-1), "halo_size must be a non-negative"),
        (lambda: create_spatial_layer("halo_attention", 8, pixel_centered="yes"),
         "pixel_centered must be True or False, got 'yes'"),
        (lambda: create_spatial_layer("halo_attention", 8, mask_padding=0),
         "mask_padding must be True or False, got 0"),
        (lambda: BlockedLocalAttention(8, 8, block_size=4, halo_size=1, heads=2, rel_max_offset=-1),
         "rel_max_offset must be a non-negative int or None, got -1"),
        (lambda: create_spatial_layer("halo_attention", 32, heads=5), "heads=5 must divide"),
        (lambda: create_spatial_layer("conv", 8, kernel_size=2), "kernel_size must be a positive odd"),
        (lambda: create_spatial_layer("attention_augmented_conv", 8, 8, feat_size=4), "too small"),
        (lambda: create_spatial_layer("relative_self_attention", 8, 8, feat_size=4, stride=3), "stride must be"),
        (lambda: create_spatial_layer("conv_se", 8, rd_ratio=2.0), "rd_ratio must be in (0, 1]"),
    ],
)
def test_bad_arguments_raise_value_error_naming_argument(build, needle):
    with pytest.raises(ValueError) as err:
        build()
    assert needle in str(err.value)


def test_integer_sizes_of_any_integer_type_build_the_same_layer():
    """A numpy integer (a size read from an array) is an int: the halo builds the layer a Python int builds."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    plain = BlockedLocalAttention(16, 16, block_size=4, halo_size=2, heads=2, rel_max_offset=5)
    torch.manual_seed(0)
    numpy_sized = BlockedLocalAttention(16, 16, block_size=np.int64(4), halo_size=np.int64(2), heads=2,
                                        rel_max_offset=np.int64(5))  # fmt: skip
    x = torch.randn(1, 16, 8, 8)
    assert numpy_sized.halo_size == 2 and torch.equal(numpy_sized(x), plain(x))


def test_drop_path_drops_whole_examples_and_rescales_the_rest():
    """Per example, all or nothing: the survivors scaled by ``1 / (1 - p)``, so the mean is kept; ``p = 1`` gives
    zeros (timm's drop_path), not ``0 / 0``; in eval mode the input itself; a rate outside its range is one line."""
    from lambdanet.layers.drop import DropPath, drop_path

    torch.manual_seed(0)
    x = torch.ones(4000, 3)
    y = drop_path(x, 0.25, True)
    kept = y[:, 0] != 0
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert torch.equal(y[~kept], torch.zeros_like(y[~kept]))
    assert abs(kept.float().mean().item() - 0.75) < 5 * (0.75 * 0.25 / 4000) ** 0.5  # 5 standard deviations
    assert torch.equal(drop_path(x, 1.0, True), torch.zeros_like(x)) and drop_path(x, 0.9, False) is x
    with pytest.raises(ValueError, match=r"^p must be in \[0, 1\] \(the probability of dropping an example\), "
                                         r"got 1.5$"):
        drop_path(x, 1.5, True)
    for bad in (1.0, -0.1, "0.1", float("nan")):
        with pytest.raises(ValueError, match=r"^p must be (a finite number )?in \[0, 1\) \(the drop path rate"):
            DropPath(bad)
    assert DropPath(np_float(0.5)).p == 0.5


def test_drop_path_compiles_as_one_graph_when_its_rate_varies():
    """A rate that changes between calls is a symbolic float to the compiler: the range check (Python's
    ``math.isfinite``) is left to eager calls, so the compiled step has no graph break."""
    from lambdanet.layers.drop import DropPath, drop_path

    torch.manual_seed(0)
    x = torch.randn(64, 3)
    compiled = torch.compile(lambda x, p: drop_path(x, p, True), fullgraph=True, backend="eager")
    for p in (0.2, 0.3, 0.6):
        y = compiled(x, p)
        kept = y[:, 0] != 0
        assert torch.equal(y[kept], x[kept] / (1 - p)) and torch.equal(y[~kept], torch.zeros_like(y[~kept]))
    layer = DropPath(0.2).train()
    step = torch.compile(layer, fullgraph=True, backend="eager")
    step(x)
    layer.p = 0.3
    assert step(x).shape == x.shape


def np_float(value: float):
    np = pytest.importorskip("numpy")
    return np.float32(value)


GRADCHECK_KWARGS = {
    "halo_attention": {"block_size": 2, "halo_size": 1, "heads": 2},
    "local_self_attention": {"kernel_size": 3, "block_size": 2, "heads": 2},
    "relative_self_attention": {"heads": 2},
    "attention_augmented_conv": {"heads": 2},
    "axial_self_attention": {"heads": 2},
    "linear_attention": {"heads": 2},
    "double_attention": {},
}


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("name", list(GRADCHECK_KWARGS))
def test_attention_baselines_compute_in_float64_and_pass_gradcheck(name, stride):
    """float64 in, float64 through (no float32 softmax): analytic gradients of the input and of every
    parameter match central differences (gradcheck's float64 tolerances)."""
    layer = create_spatial_layer(name, 4, 8, stride=stride, feat_size=(5, 6), **GRADCHECK_KWARGS[name]).double()
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in layer.named_parameters()]
    x = torch.randn(1, 4, 5, 6, dtype=torch.float64, requires_grad=True)

    def fn(inp, *weights):
        return torch.func.functional_call(layer, dict(zip(names, weights)), (inp,))

    assert fn(x, *params).dtype == torch.float64
    assert torch.autograd.gradcheck(fn, (x, *params), fast_mode=True)


@pytest.mark.parametrize("name", list_spatial_layers())
def test_feat_size_reaches_exactly_the_layers_that_take_it(name):
    """One mechanism: the spec's ``feat_size_use``. A constructor has a ``feat_size`` parameter iff the registry
    passes it one (no layer accepts feat_size and ignores it), and every global layer takes it."""
    spec = spatial_layer_info(name)
    takes = "feat_size" in inspect.signature(spec.cls.__init__).parameters
    assert spec.takes_feat_size == takes
    assert spec.takes_feat_size or not spec.needs_feat_size
    layer = create_spatial_layer(name, 16, 32, feat_size=8)  # models pass feat_size to every layer
    assert layer(torch.randn(1, 16, 8, 8)).shape == (1, 32, 8, 8)


def test_lambda_conv_forwards_an_optional_feat_size():
    glob = create_spatial_layer("lambda_conv", 16, 32, feat_size=8, r=None)
    assert glob.r is None and glob.feat_size == (8, 8)
    with pytest.raises(ValueError, match="feat_size"):
        create_spatial_layer("lambda_conv", 16, 32, r=None)


def test_argument_errors_name_what_the_user_gave_or_the_default_they_did_not():
    """``HaloAttention(0)`` named ``dim_out`` (checked first, from ``dim``); a width that the default heads
    (``dim_out // 16``) do not divide said "heads=3 must divide dim_out=56" to a user who never passed ``heads``.
    ``CausalLambdaLayer`` takes numpy's integers for ``r`` and ``short_conv``, as ``LambdaLayer`` does."""
    import numpy as np

    from lambdanet.layers import CausalLambdaLayer, HaloAttention

    with pytest.raises(ValueError, match=r"^dim must be a positive int, got 0$"):
        HaloAttention(0)
    with pytest.raises(ValueError, match=r"^heads \(by default dim_out // 16 = 3\) must divide dim_out=56; pass"):
        create_spatial_layer("halo_attention", 64, 56)
    assert create_spatial_layer("halo_attention", 64, 56, heads=4)(torch.randn(1, 64, 8, 8)).shape == (1, 56, 8, 8)
    layer = CausalLambdaLayer(32, r=np.int64(5), short_conv=np.int64(4))
    assert (layer.r, layer.short_conv) == (5, 4) and type(layer.r) is int
    x = torch.randn(1, 7, 32)
    torch.manual_seed(0)
    same = CausalLambdaLayer(32, r=5, short_conv=4)
    same.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), same(x))
