"""LambdaLayer module: a naive re-computation from its own weights, invariances, errors, autocast,
compile, ONNX and memory behaviour."""

import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lambdanet import LambdaLayer, RelativePositionEmbedding


def randomize_norms(layer):
    """Give the BatchNorms non-trivial eval statistics so the reference must get them right."""
    for bn in (layer.norm_q, layer.norm_v):
        if isinstance(bn, torch.nn.BatchNorm1d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.3, 0.3)
    return layer


def naive_layer_forward(layer, x):
    """Eq. 1-2 for every query position, from the layer's weights, with explicit loops (eval mode)."""
    b, _, *spatial = x.shape
    n = math.prod(spatial)
    h, k, u, v, g = layer.heads, layer.dim_k, layer.dim_u, layer.dim_v, layer.groups
    tokens = x.flatten(2).transpose(1, 2).double()  # b n d
    w = layer.qkv.weight.double()
    qkv = tokens @ w.t()
    q, keys, vals = qkv.split([h * k, layer.dim_keys_total, g * v * u], dim=-1)

    def bn(t, mod):
        return (t - mod.running_mean.double()) / torch.sqrt(mod.running_var.double() + mod.eps) \
            * mod.weight.double() + mod.bias.double()

    q, vals = bn(q, layer.norm_q), bn(vals, layer.norm_v)
    q = q.view(b, n, h, k)
    vals = vals.view(b, n, g, v, u)
    kbar = keys.view(b, n, g, k, u).softmax(dim=1)
    positions = list(itertools.product(*[range(s) for s in spatial]))
    R = layer.embedding.table.double()  # g k u *K
    center = layer.embedding.center
    out = torch.zeros(b, n, h, v, dtype=torch.float64)
    for bi in range(b):
        for ni, pn in enumerate(positions):
            lam = torch.zeros(g, k, v, dtype=torch.float64)
            for mi, pm in enumerate(positions):
                t = tuple(a - c + ce for a, c, ce in zip(pm, pn, center))
                inside = all(0 <= ti < ks for ti, ks in zip(t, R.shape[3:]))
                e = R[(slice(None),) * 3 + t] if inside else torch.zeros(g, k, u, dtype=torch.float64)
                lam += torch.einsum("gku,gvu->gkv", kbar[bi, mi] + e, vals[bi, mi])
            for hi in range(h):
                out[bi, ni, hi] = lam[hi if g > 1 else 0].t() @ q[bi, ni, hi]
    return out.reshape(b, *spatial, h * v).movedim(-1, 1)


@pytest.mark.parametrize(
    "kwargs,shape",
    [
        (dict(dim=8, dim_out=12, dim_k=3, heads=3, r=3), (2, 8, 4, 5)),
        (dict(dim=8, dim_k=2, heads=2, r=None, feat_size=(4, 5)), (2, 8, 4, 5)),
        (dict(dim=8, dim_k=2, heads=2, r=None, feat_size=(5, 6)), (2, 8, 3, 4)),  # smaller than feat_size
        (dict(dim=6, dim_k=2, heads=2, dim_u=3, r=5), (1, 6, 4, 3)),
        (dict(dim=8, dim_k=2, heads=2, r=5, multihead=True), (2, 8, 3, 4)),
        (dict(dim=4, dim_k=2, heads=2, r=3, spatial_dims=1), (2, 4, 9)),
        (dict(dim=4, dim_k=2, heads=2, r=3, spatial_dims=3), (1, 4, 3, 3, 4)),
    ],
)
def test_module_equals_naive_per_query_loop(kwargs, shape):
    layer = randomize_norms(LambdaLayer(**kwargs)).eval()
    x = torch.randn(*shape)
    ref = naive_layer_forward(layer, x)
    for impl in ("conv", "depthwise_conv", "einsum", "einsum_qe"):
        layer.impl = impl
        torch.testing.assert_close(layer(x).double(), ref, atol=2e-4, rtol=1e-4, msg=impl)


@pytest.mark.parametrize("kwargs", [dict(r=3), dict(r=None, feat_size=4), dict(r=3, dim_u=2, multihead=True),
                                    dict(r=3, causal=True, spatial_dims=1)])
def test_gradcheck_in_float64(kwargs):
    """Autograd's numerical gradient check of the whole layer (float64 inputs keep a float64 core)."""
    layer = LambdaLayer(4, dim_k=2, heads=2, qv_norm=None, **kwargs).double()
    shape = (2, 4, 5) if kwargs.get("causal") else (2, 4, 4, 3)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-5)


def test_param_count_closed_form_paper_defaults():
    # Q: d k h, K: d k u, V: d v u, BN(Q): 2 k h, BN(V): 2 v u, E: r^2 k u (dim 64, k 16, h 4, u 1, r 23)
    d, k, h, u, r = 64, 16, 4, 1, 23
    v = d // h
    closed = d * k * h + d * k * u + d * v * u + 2 * k * h + 2 * v * u + r * r * k * u
    assert closed == 14768
    assert sum(p.numel() for p in LambdaLayer(64).parameters()) == closed


@pytest.mark.parametrize("d,dout,k,h,u,r,multihead", [(32, 48, 8, 4, 2, 7, False), (64, 64, 16, 4, 1, 5, True),
                                                      (40, 40, 4, 8, 4, 3, False)])
def test_param_count_closed_form_general(d, dout, k, h, u, r, multihead):
    v = dout // h
    g = h if multihead else 1
    closed = d * k * h + d * k * u * g + d * v * u * g + 2 * k * h + 2 * v * u * g + r * r * k * u * g
    layer = LambdaLayer(d, dout, dim_k=k, heads=h, dim_u=u, r=r, multihead=multihead)
    assert sum(p.numel() for p in layer.parameters()) == closed


def test_initialisation_follows_appendix_e1():
    d, k = 256, 16
    layer = LambdaLayer(d, dim_k=k, heads=4, r=23)
    w = layer.qkv.weight
    nq = k * 4
    assert abs(w[:nq].std().item() - (d * k) ** -0.5) < 0.1 * (d * k) ** -0.5
    assert abs(w[nq:].std().item() - d ** -0.5) < 0.1 * d ** -0.5
    assert abs(layer.embedding.weight.std().item() - 1.0) < 0.05
    assert layer.qkv.bias is None


@pytest.mark.parametrize("kwargs", [dict(r=7), dict(r=None, feat_size=20), dict(r=5, dim_u=2)])
def test_translation_equivariance(kwargs):
    """A pattern in a zero background, shifted: the output shifts the same (eval mode)."""
    layer = LambdaLayer(8, dim_k=4, heads=2, **kwargs).eval()
    x = torch.zeros(1, 8, 20, 20)
    pattern = torch.randn(1, 8, 5, 4)
    x1, x2 = x.clone(), x.clone()
    x1[..., 4:9, 5:9] = pattern
    x2[..., 4 + 3:9 + 3, 5 + 6:9 + 6] = pattern
    y1, y2 = layer(x1), layer(x2)
    torch.testing.assert_close(torch.roll(y1, shifts=(3, 6), dims=(2, 3)), y2, atol=1e-4, rtol=1e-4)


def test_translation_equivariance_1d_and_3d():
    for dims, size in ((1, (30,)), (3, (8, 9, 10))):
        layer = LambdaLayer(4, dim_k=2, heads=2, r=3, spatial_dims=dims).eval()
        x1 = torch.zeros(1, 4, *size)
        x2 = x1.clone()
        sl = tuple(slice(2, 5) for _ in size)
        sl2 = tuple(slice(3, 6) for _ in size)
        pat = torch.randn(1, 4, *(3,) * dims)
        x1[(slice(None), slice(None)) + sl] = pat
        x2[(slice(None), slice(None)) + sl2] = pat
        y1 = torch.roll(layer(x1), shifts=(1,) * dims, dims=tuple(range(2, 2 + dims)))
        torch.testing.assert_close(y1, layer(x2), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(r=5), dict(r=None, feat_size=12), dict(r=None, feat_size=12,
                                    position_embedding="absolute"), dict(r=3, key_norm="l2"),
                                    dict(r=3, content=False), dict(r=3, position=False), dict(r=3, dim_u=2)])
@pytest.mark.parametrize("train", [False, True])
def test_causal_layer_ignores_the_future(kwargs, train):
    layer = LambdaLayer(8, dim_k=4, heads=2, causal=True, **kwargs).train(train)
    x = torch.randn(2, 8, 12, requires_grad=True)
    t = 6
    y = layer(x)
    y[..., t].sum().backward()
    assert x.grad[..., t + 1:].abs().max() == 0  # no gradient from the future
    assert x.grad[..., : t + 1].abs().max() > 0
    if not train:
        x2 = x.detach().clone()
        x2[..., t + 1:] = torch.randn_like(x2[..., t + 1:]) * 5
        torch.testing.assert_close(layer(x2)[..., : t + 1], y[..., : t + 1].detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "einsum"])
def test_causal_layer_ignores_a_loud_future(impl):
    """A later token 60x louder (its keys ~100 nats above the rest): the per-query path (below the causal op's
    1024 positions) shifted the keys by the whole sequence's maximum, so earlier outputs changed by O(1)."""
    layer = LambdaLayer(8, dim_k=4, heads=2, r=3, causal=True, impl=impl).eval()
    x = torch.randn(1, 8, 16)
    x2 = x.clone()
    x2[..., 10] *= 1000.0  # keys some 1000 nats above the rest, whatever the seed (float32's exp spans ~87)
    with torch.no_grad():
        torch.testing.assert_close(layer(x2)[..., :10], layer(x)[..., :10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(r=5), dict(r=None, feat_size=12), dict(r=3, dim_u=2),
                                    dict(r=4, position=False), dict(r=5, query_softmax=True)])
def test_causal_auto_runs_the_causal_op_and_equals_the_per_query_lambdas(kwargs, monkeypatch, set_policy):
    """``impl="auto"`` runs a causal layer's masked lambda in lambdanet.ops.causal_lambda (linear in ``n``, nothing
    per query stored) from the policy's ``causal_op_positions`` on; an explicit impl runs the layer's own
    per-query lambdas: the same function (float64, sums in another order: ~n eps), gradients included."""
    from lambdanet.layers import lambda_layer
    import dataclasses

    from lambdanet.ops.position_lambda.policy import DEFAULT_IMPL_POLICY, ImplPolicy

    assert LambdaLayer(8, dim_k=4, heads=2, causal=True, **kwargs).choose_impl((11,)) != "causal_op"  # CPU: 1024
    assert LambdaLayer(8, dim_k=4, heads=2, causal=True, **kwargs).choose_impl((1024,)) == "causal_op"
    set_policy("cpu", dataclasses.replace(DEFAULT_IMPL_POLICY, causal_op_positions=0))

    calls = []
    real = lambda_layer.causal_lambda
    monkeypatch.setattr(lambda_layer, "causal_lambda", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    torch.manual_seed(0)
    auto = LambdaLayer(8, dim_k=4, heads=2, causal=True, **kwargs).double()
    own = LambdaLayer(8, dim_k=4, heads=2, causal=True, impl="einsum", **kwargs).double()
    own.load_state_dict(auto.state_dict())
    assert auto.choose_impl((11,)) == "causal_op"
    assert own.choose_impl((11,)) == ("none" if kwargs.get("position") is False else "einsum")
    x = torch.randn(2, 8, 11, dtype=torch.float64, requires_grad=True)
    y, y_own = auto(x), own(x)
    with pytest.raises(ValueError, match="^causal_op_positions must be a non-negative int, got -1$"):
        ImplPolicy(causal_op_positions=-1)
    assert len(calls) == 1 and (calls[0] is None) == (kwargs.get("position") is False)
    torch.testing.assert_close(y, y_own, rtol=1e-10, atol=1e-12)
    g = torch.autograd.grad(y.square().sum(), [x, *auto.parameters()])
    g_own = torch.autograd.grad(y_own.square().sum(), [x, *own.parameters()])
    for a, b in zip(g, g_own):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_causal_layer_equals_masked_reference():
    """Causal softmax keys normalised per query and position lambdas over the r positions ending at t."""
    layer = LambdaLayer(6, dim_k=3, heads=2, r=4, causal=True, qv_norm=None).eval()
    x = torch.randn(2, 6, 9)
    b, n = 2, 9
    h, k, v = 2, 3, 3
    qkv = x.transpose(1, 2) @ layer.qkv.weight.t()
    q, keys, vals = qkv.split([h * k, k, v], dim=-1)
    q = q.view(b, n, h, k)
    R = layer.embedding.table[0, :, 0]  # k r, last entry = offset 0
    out = torch.zeros(b, n, h, v)
    for t in range(n):
        kbar = keys[:, : t + 1].softmax(dim=1)  # b m k
        lam = torch.einsum("bmk,bmv->bkv", kbar, vals[:, : t + 1])
        for m in range(max(0, t - 3), t + 1):
            lam += torch.einsum("k,bv->bkv", R[:, m - t + 3], vals[:, m])
        out[:, t] = torch.einsum("bhk,bkv->bhv", q[:, t], lam)
    torch.testing.assert_close(layer(x), out.reshape(b, n, h * v).transpose(1, 2), atol=1e-4, rtol=1e-4)


def test_shared_embeddings_are_one_parameter():
    emb = RelativePositionEmbedding.local(16, 7)
    l1, l2 = LambdaLayer(32, r=7, embedding=emb), LambdaLayer(64, r=7, embedding=emb)
    model = torch.nn.Sequential(l1, torch.nn.Conv2d(32, 64, 1), l2)
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    assert sum(p is emb.weight for p in model.parameters()) == 1
    unshared = torch.nn.Sequential(LambdaLayer(32, r=7), torch.nn.Conv2d(32, 64, 1), LambdaLayer(64, r=7))
    n_shared = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in unshared.parameters()) - n_shared == emb.weight.numel()
    model(torch.randn(2, 32, 9, 9)).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0


def test_shared_global_embedding_serves_smaller_inputs():
    emb = RelativePositionEmbedding.global_context(8, 10)
    layer = LambdaLayer(16, dim_k=8, r=None, embedding=emb)
    assert layer(torch.randn(2, 16, 7, 10)).shape == (2, 16, 7, 10)


VARIANTS = [
    dict(r=5), dict(r=None, feat_size=8), dict(r=5, dim_u=2), dict(r=5, multihead=True),
    dict(r=None, feat_size=8, position_embedding="absolute"), dict(r=5, content=False), dict(r=5, position=False),
    dict(r=5, key_norm="l2", query_softmax=True), dict(r=5, key_norm="none", qv_norm=None),
    dict(r=5, qv_norm="layer"), dict(r=5, stride=2), dict(r=3, spatial_dims=3),
]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_every_parameter_gets_a_gradient(kwargs):
    layer = LambdaLayer(8, 16, dim_k=4, heads=4, **kwargs)
    shape = (2, 8, 6, 6, 6) if kwargs.get("spatial_dims") == 3 else (2, 8, 8, 8)
    y = layer(torch.randn(*shape))
    assert torch.isfinite(y).all()
    (y ** 2).mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_dim_out_and_stride_shapes():
    layer = LambdaLayer(16, 32, r=5, stride=2).eval()
    x = torch.randn(2, 16, 9, 12)
    y = layer(x)
    assert y.shape == (2, 32, 5, 6)
    layer.stride = 1
    pooled = torch.nn.functional.avg_pool2d(layer(x), 3, 2, 1)  # 3x3 average pool of stride 2 after the layer
    torch.testing.assert_close(y, pooled)


def test_channels_last_input_gives_same_result_and_format():
    layer = LambdaLayer(16, r=5).eval()
    x = torch.randn(2, 16, 10, 7)
    y = layer(x)
    y_cl = layer(x.contiguous(memory_format=torch.channels_last))
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    assert y.is_contiguous()
    torch.testing.assert_close(y, y_cl)
    strided = LambdaLayer(8, dim_k=4, heads=2, r=3, spatial_dims=3, stride=2).eval()  # 3-d, pooled
    v = torch.randn(2, 8, 6, 6, 6)
    v_cl = strided(v.contiguous(memory_format=torch.channels_last_3d))
    assert v_cl.is_contiguous(memory_format=torch.channels_last_3d)  # avg_pool3d on the CPU returned NCDHW
    torch.testing.assert_close(v_cl, strided(v))


@pytest.mark.parametrize("kwargs", [dict(r=5), dict(r=None, feat_size=8), dict(r=3, causal=True)])
def test_bf16_autocast_is_finite_and_close(kwargs):
    dims = 1 if kwargs.get("causal") else 2
    layer = LambdaLayer(32, dim_k=8, **kwargs).eval()
    x = torch.randn(2, 32, *(8,) * dims) * 30  # large activations
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.isfinite(y).all()
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.05


BAD = [
    (dict(dim=16, r=4), "r must be a positive odd int"),
    (dict(dim=16, r=0), "r must be a positive odd int"),
    (dict(dim=16, r=-3), "r must be a positive odd int"),
    (dict(dim=16, dim_out=30, heads=4), "heads=4 must divide dim_out=30"),
    (dict(dim=16, r=None), "needs feat_size"),
    (dict(dim=16, causal=True, spatial_dims=2), "causal=True needs 1-d inputs"),
    (dict(dim=16, stride=3), "stride must be one of"),
    (dict(dim=16, impl="fft"), "impl must be one of"),
    (dict(dim=16, key_norm="max"), "key_norm must be one of"),
    (dict(dim=16, dim_k=0), "dim_k must be a positive int"),
    (dict(dim=16, content=False, position=False), "cannot both be False"),
    (dict(dim=16, content="no"), "content must be True or False, got 'no'"),
    (dict(dim=16, position=1), "position must be True or False, got 1"),
    (dict(dim=16, causal="no"), "causal must be True or False, got 'no'"),  # was a causal 1-d layer
    (dict(dim=16, multihead="no"), "multihead must be True or False, got 'no'"),  # was multi-head
    (dict(dim=16, query_softmax=1), "query_softmax must be True or False, got 1"),
    (dict(dim=16, position_bias="yes"), "position_bias must be True or False, got 'yes'"),
    (dict(dim=16, position_embedding="absolute", r=5, feat_size=4), "needs feat_size and r=None"),
    (dict(dim=16, feat_size=(4, 4, 4), r=None, spatial_dims=2), "feat_size must have 2 entries"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_constructor_arguments_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=None) as err:
        LambdaLayer(**kwargs)
    assert needle in str(err.value)


def test_bad_inputs_raise_value_error():
    layer = LambdaLayer(16, r=5)
    with pytest.raises(ValueError, match=r"^LambdaLayer's parameters are float32 but its input is float64: cast"):
        layer(torch.randn(2, 16, 6, 6, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts both itself
        assert layer(torch.randn(2, 16, 6, 6, dtype=torch.bfloat16)).shape == (2, 16, 6, 6)
    with pytest.raises(ValueError, match="dim=16 input channels, got input with 8 channels"):
        layer(torch.randn(2, 8, 6, 6))
    with pytest.raises(ValueError, match=r"rank 4 \[B, C, H, W\]"):
        layer(torch.randn(2, 16, 6))
    glob = LambdaLayer(16, r=None, feat_size=8)
    with pytest.raises(ValueError, match="larger than feat_size"):
        glob(torch.randn(2, 16, 9, 8))
    causal = LambdaLayer(16, r=5, causal=True)
    with pytest.raises(ValueError, match=r"rank 3 \[B, C, L\]"):
        causal(torch.randn(2, 16, 6, 6))
    absolute = LambdaLayer(16, r=None, feat_size=6, position_embedding="absolute")
    with pytest.raises(ValueError, match="absolute position embeddings were built for feat_size"):
        absolute(torch.randn(2, 16, 5, 6))
    emb = RelativePositionEmbedding.local(16, 7)
    with pytest.raises(ValueError, match="does not match the shared embedding"):
        LambdaLayer(16, r=5, embedding=emb)
    with pytest.raises(ValueError, match="shared embedding has dim_k=16"):
        LambdaLayer(16, dim_k=8, r=7, embedding=emb)


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("impl", ["einsum", "einsum_qe", "conv", "depthwise_conv"])
def test_no_batch_by_positions_by_context_tensor(impl):
    """Table 2: space Theta(k n m + b n k v); no b x n x m tensor (forward and backward)."""
    b, side, k, dout = 16, 24, 2, 8  # v = 2
    n = side * side
    layer = LambdaLayer(8, dout, dim_k=k, heads=4, r=None, feat_size=side, impl=impl)
    x = torch.randn(b, 8, side, side, requires_grad=True)
    with _MaxNumel() as mode:
        layer(x).sum().backward()
    assert mode.max_numel < b * n * n // 4, mode.shape


def test_global_scope_beyond_852_positions_builds_embedding_rows_per_chunk(monkeypatch):
    """Past App. E.1's 852 positions the queries-first path never holds a k x n x m embedding tensor and
    still equals the lambda convolution (values and input gradients)."""
    from lambdanet.ops.position_lambda import fast as LF

    calls = []
    original = LF.relative_position_output_qe
    monkeypatch.setattr(LF, "relative_position_output_qe", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    k, spatial = 2, (30, 29)
    n = math.prod(spatial)
    assert n > 852
    torch.manual_seed(0)
    layer = randomize_norms(LambdaLayer(8, dim_k=k, heads=2, r=None, feat_size=30)).eval().double()
    assert layer.choose_impl(spatial) == "einsum_qe"
    x = torch.randn(2, 8, *spatial, dtype=torch.float64, requires_grad=True)
    with _MaxNumel() as mode:
        out = layer(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
    assert calls, "the chunked relative path was not taken"
    assert mode.max_numel < k * n * n // 4, mode.shape
    layer.impl = "depthwise_conv"
    x_ref = x.detach().clone().requires_grad_()
    ref = layer(x_ref)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), x_ref)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, grad_ref)


def test_lambda_convolution_memory_is_linear_in_positions():
    peaks = []
    for side in (16, 32, 64):
        layer = LambdaLayer(8, dim_k=4, heads=4, r=7, impl="depthwise_conv")
        with _MaxNumel() as mode:
            layer(torch.randn(2, 8, side, side, requires_grad=True)).sum().backward()
        peaks.append(mode.max_numel / (side * side))
    assert max(peaks) <= 1.05 * min(peaks)  # the largest tensor per position is constant


def test_torch_compile_has_no_graph_breaks():
    import torch._dynamo

    cases = [(dict(r=5), (2, 16, 8, 8)), (dict(r=None, feat_size=8), (2, 16, 8, 8)),
             (dict(r=3, causal=True), (2, 16, 8)),
             (dict(r=None, feat_size=30), (1, 16, 30, 29))]  # > 852 positions: E rows per chunk, checkpointed
    for kwargs, shape in cases:
        torch._dynamo.reset()
        layer = LambdaLayer(16, dim_k=4, **kwargs)
        x = torch.randn(*shape)
        explanation = torch._dynamo.explain(layer)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


def test_torch_compile_matches_eager():
    layer = LambdaLayer(16, dim_k=4, r=5).eval()
    x = torch.randn(2, 16, 8, 8)
    compiled = torch.compile(layer)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-4, rtol=1e-4)


def test_onnx_export_matches_eager(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    layer = LambdaLayer(16, dim_k=4, r=5).eval()
    x = torch.randn(2, 16, 8, 8)
    path = tmp_path / "lambda.onnx"
    torch.onnx.export(layer, (x,), str(path), dynamo=True)
    sess = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), layer(x), atol=1e-4, rtol=1e-4)


def test_inference_caches_the_embeddings_until_the_weights_change():
    layer = LambdaLayer(8, dim_k=4, heads=2, r=5).eval()
    emb = layer.embedding
    with torch.no_grad():
        e1, e2 = emb.embeddings((6, 6)), emb.embeddings((6, 6))
        assert e1 is e2  # reused without autograd
        x = torch.randn(1, 8, 6, 6)
        y1 = layer(x)
        emb.weight.mul_(2.0)  # an in-place update (as an optimiser step) bumps the version counter
        assert emb.embeddings((6, 6)) is not e1
        torch.testing.assert_close(emb.embeddings((6, 6)), 2 * e1)
        y2 = layer(x)
    assert not torch.allclose(y1, y2)
    assert emb.embeddings((6, 6)).requires_grad  # with autograd: rebuilt, differentiable
    with torch.no_grad():  # a write through .data (EMA teachers: p.data.mul_(m).add_(...)) moves no version counter
        e3 = emb.embeddings((6, 6))
        emb.weight.data.mul_(3.0)
        torch.testing.assert_close(emb.embeddings((6, 6)), 3 * e3)
        fresh = LambdaLayer(8, dim_k=4, heads=2, r=5).eval()
        fresh.load_state_dict(layer.state_dict())
        torch.testing.assert_close(layer(x), fresh(x))


@pytest.mark.parametrize("kwargs,other", [
    (dict(r=5, heads=4, dim_u=2, multihead=True), dict(r=7, heads=4, dim_u=2, multihead=True)),
    (dict(r=None, feat_size=6, position_embedding="absolute"),
     dict(r=None, feat_size=5, position_embedding="absolute")),
])
def test_weights_saved_with_shaped_position_tables_still_load(kwargs, other):
    """Checkpoints from before the tables were stored flat hold ``[g, k, u, *K]`` (``[g, k, u, n, m]``);
    they load unchanged in value, and a table of the wrong size is still refused."""
    layer = LambdaLayer(32, **kwargs)
    legacy = {k: v.clone() for k, v in layer.state_dict().items()}
    legacy["embedding.weight"] = layer.embedding.table.detach().clone()
    assert legacy["embedding.weight"].dim() == 5
    fresh = LambdaLayer(32, **kwargs)
    fresh.load_state_dict(legacy)
    torch.testing.assert_close(fresh.embedding.table, layer.embedding.table)
    x = torch.randn(2, 32, 6, 6)
    torch.testing.assert_close(fresh.eval()(x), layer.eval()(x))
    with pytest.raises(RuntimeError, match="size mismatch"):
        LambdaLayer(32, **other).load_state_dict(legacy)


# ------------------------------------------------------------------------------------------ plan and policy
PLAN_CASES = [(dict(r=5), (2, 8, 8, 8)), (dict(r=23), (2, 8, 20, 20)), (dict(r=None, feat_size=8), (2, 8, 8, 8)),
              (dict(r=None, feat_size=30), (1, 8, 30, 29)), (dict(r=5, dim_u=2), (2, 8, 8, 8)),
              (dict(r=5, multihead=True), (2, 8, 6, 6)), (dict(r=5, position=False), (2, 8, 6, 6)),
              (dict(r=None, feat_size=6, position_embedding="absolute"), (2, 8, 6, 6)),
              (dict(r=3, causal=True), (2, 8, 12)), (dict(r=3, spatial_dims=3), (1, 8, 4, 5, 6))]


def _record_position_functions(monkeypatch):
    """Which functional position implementation each forward call ran, in choose_impl's vocabulary (the
    outermost call only: ``position_lambdas(..., "einsum")`` calls ``einsum_position_lambdas`` in turn)."""
    from lambdanet.ops.position_lambda import fast as LF

    ran, depth = [], [0]

    def recorded(fn, name_of):
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                ran.append(name_of(args, kwargs))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    fixed = {"position_output_qe": "einsum_qe", "relative_position_output_qe": "einsum_qe",
             "token_position_lambdas": "depthwise_conv", "einsum_position_lambdas": "einsum"}
    for fn_name, impl in fixed.items():
        monkeypatch.setattr(LF, fn_name, recorded(getattr(LF, fn_name), lambda a, kw, _i=impl: _i))
    monkeypatch.setattr(LF, "position_lambdas", recorded(LF.position_lambdas, lambda a, kw: kw.get("impl", a[-1])))
    return ran


@pytest.mark.parametrize("kwargs,shape", PLAN_CASES, ids=lambda c: str(c))
def test_forward_plans_once_and_runs_what_choose_impl_reports(kwargs, shape, monkeypatch):
    plans = []
    original = LambdaLayer.plan
    monkeypatch.setattr(LambdaLayer, "plan", lambda self, *a, **kw: plans.append(a) or original(self, *a, **kw))
    ran = _record_position_functions(monkeypatch)
    for impl in ("auto", "conv", "depthwise_conv", "einsum", "einsum_qe"):
        layer = LambdaLayer(8, dim_k=2, heads=2, impl=impl, **kwargs)
        expected = layer.choose_impl(shape[2:])
        plans.clear()
        ran.clear()
        layer(torch.randn(*shape)).sum().backward()
        assert len(plans) == 1, (impl, plans)
        # "causal_op": the masked lambda in lambdanet.ops.causal_lambda, none of the position functions
        assert ran == ([] if expected in ("none", "causal_op") else [expected]), (impl, expected, ran)


@pytest.fixture
def set_policy():
    """``set_impl_policy`` for one test; the policies registered before are restored afterwards."""
    from lambdanet.layers.lambda_layer import set_impl_policy

    saved = {}

    def apply(device_type, policy):
        previous = set_impl_policy(device_type, policy)
        saved.setdefault(device_type, previous)

    yield apply
    for device_type, previous in saved.items():
        set_impl_policy(device_type, previous)


def test_policy_numbers_move_the_auto_choice_where_the_cost_model_says(set_policy):
    """A local r=5 layer at the paper's depths (k=16, h=4, v=16) on a 16x16 map: n = 256 positions, 25 taps.
    Queries-first costs n h (k + v) = 32768 multiply-adds per context position, the convolution taps k v =
    6400: einsum_qe needs gemm_speedup >= 32768 / 6400 = 5.12; the lambdas-first einsum needs
    n / taps = 10.24 positions per tap; E has n^2 k = 1048576 elements."""
    from lambdanet.layers.lambda_layer import ImplPolicy

    layer = LambdaLayer(64, dim_k=16, heads=4, r=5)
    size = (16, 16)
    assert layer.choose_impl(size) == "depthwise_conv"  # the defaults: 2.5 < 5.12, 2 < 10.24
    for policy, want in [
        (ImplPolicy(gemm_speedup=5.13), "einsum_qe"), (ImplPolicy(gemm_speedup=5.11), "depthwise_conv"),
        (ImplPolicy(gemm_speedup=6.0, max_whole_positions=255), "depthwise_conv"),  # no whole E: factor 1
        (ImplPolicy(gemm_speedup=6.0, max_whole_elements=256 * 256 * 16 - 1), "depthwise_conv"),
        (ImplPolicy(gemm_speedup=6.0, max_whole_elements=256 * 256 * 16), "einsum_qe"),
        (ImplPolicy(einsum_positions_per_tap=10.25), "einsum"), (ImplPolicy(einsum_positions_per_tap=10.23),
                                                                "depthwise_conv"),
    ]:
        set_policy("cpu", policy)
        assert layer.choose_impl(size) == want, policy


def test_dense_conv_window_and_speedup_move_the_auto_choice_where_the_cost_model_says(set_policy):
    """The detector's c4 layer (k=16, h=4, v=16, r=23) on a 32x32 map: n = 1024 > 852, so E's rows are rebuilt
    per chunk and no GEMM factor applies. Queries-first costs n h (k + v) = 131072 multiply-adds per context
    position, the lambda convolution taps k v = 529 * 256 = 135424: the depthwise form loses (ratio 1.033), the
    dense form (529 taps, inside the default window) wins once counted 135424 / 131072 = 1.0332x cheaper."""
    from lambdanet.layers.lambda_layer import ImplPolicy

    layer = LambdaLayer(64, dim_k=16, heads=4, r=23)
    size = (32, 32)
    assert layer.choose_impl(size) == "conv"  # default: 196 <= 529 <= 2304, 1.5 > 1.0332
    for policy, want in [
        (ImplPolicy(dense_conv_speedup=1.034), "conv"), (ImplPolicy(dense_conv_speedup=1.033), "einsum_qe"),
        (ImplPolicy(dense_conv_taps=(529, 529)), "conv"), (ImplPolicy(dense_conv_taps=(530, 2304)), "einsum_qe"),
        (ImplPolicy(dense_conv_taps=(0, 528)), "einsum_qe"),
    ]:
        set_policy("cpu", policy)
        assert layer.choose_impl(size) == want, policy
    # a scope below the window keeps the depthwise form: r=5 on 40x40 (25 taps, n = 1600 > 852)
    set_policy("cpu", None)
    assert LambdaLayer(64, dim_k=16, heads=4, r=5).choose_impl((40, 40)) == "depthwise_conv"
    # with the whole E the GEMM factor is shared with the dense form: 24x24 (n = 576), 529 taps; queries-first
    # 73728 <= 2.5 / 1.5 * 135424 keeps einsum_qe; a GEMM factor below 1.5 * 73728 / 135424 = 0.817 hands it to
    # the lambdas-first forms: the einsum at 2 positions per tap (576 <= 1058), the dense convolution at 1
    assert layer.choose_impl((24, 24)) == "einsum_qe"
    for policy, want in [(ImplPolicy(gemm_speedup=0.82), "einsum_qe"), (ImplPolicy(gemm_speedup=0.81), "einsum"),
                         (ImplPolicy(gemm_speedup=0.81, einsum_positions_per_tap=1.0), "conv")]:
        set_policy("cpu", policy)
        assert layer.choose_impl((24, 24)) == want, policy


def test_dense_conv_auto_choice_runs_the_dense_convolution_and_matches_the_depthwise_output(monkeypatch):
    """What auto picks for a 15x15 scope on a 22x22 map (225 taps, n = 484 > 2 * 225 for the lambdas-first einsum;
    u = 4 rules out queries-first) is the dense lambda convolution, and it equals the depthwise form: both sum
    the same taps k v products per position, so they differ by float64 rounding only."""
    torch.manual_seed(0)
    layer = randomize_norms(LambdaLayer(16, dim_k=4, heads=2, dim_u=4, r=15)).eval().double()
    assert layer.choose_impl((22, 22)) == "conv"
    ran = _record_position_functions(monkeypatch)
    x = torch.randn(2, 16, 22, 22, dtype=torch.float64)
    dense = layer(x)
    layer.impl = "depthwise_conv"
    depthwise = layer(x)
    assert ran == ["conv", "depthwise_conv"]
    # sums of at most 225 * 4 products of magnitude ~|E||v| ~ 1: float64 rounding ~ 1e3 * 1e-16
    torch.testing.assert_close(dense, depthwise, atol=1e-11 * depthwise.abs().max().item(), rtol=0)


def test_policy_is_per_device_type_and_forward_follows_it(set_policy, monkeypatch):
    """A global 16x16 layer (taps 31^2 = 961): queries-first at any policy; its whole E (n = 256) is used up to
    max_whole_positions, then rows per chunk. Same output either way, up to float64 rounding."""
    from lambdanet.layers.lambda_layer import DEFAULT_IMPL_POLICY, ImplPolicy, impl_policy

    layer = randomize_norms(LambdaLayer(16, dim_k=4, heads=4, r=None, feat_size=16)).eval().double()
    size = (16, 16)
    set_policy("cuda", ImplPolicy(max_whole_positions=255))
    assert impl_policy("cpu") == DEFAULT_IMPL_POLICY
    assert layer.plan(size).position == "einsum_qe_whole"
    assert layer.plan(size, "cuda").position == "einsum_qe_chunked"
    ran = _record_position_functions(monkeypatch)
    x = torch.randn(2, 16, *size, dtype=torch.float64)
    whole = layer(x)
    set_policy("cpu", ImplPolicy(max_whole_positions=255))
    assert layer.plan(size).position == "einsum_qe_chunked"
    chunked = layer(x)
    assert ran == ["einsum_qe", "einsum_qe"]
    # float64 rounding of sums over m = 256 terms of size ~|q||E||v| ~ 2: at most ~(m + k) eps 2 m ~ 3e-11
    # (random-walk far less), against |y| ~ 30-100
    torch.testing.assert_close(chunked, whole, atol=1e-12 * whole.abs().max().item(), rtol=0)


def test_bad_policies_raise_value_error():
    from lambdanet.layers.lambda_layer import ImplPolicy, set_impl_policy

    with pytest.raises(ValueError, match="max_whole_positions must be a positive int"):
        ImplPolicy(max_whole_positions=0)
    with pytest.raises(ValueError, match="gemm_speedup must be a non-negative number"):
        ImplPolicy(gemm_speedup=-1.0)
    with pytest.raises(ValueError, match="dense_conv_speedup must be a positive number"):
        ImplPolicy(dense_conv_speedup=0)
    with pytest.raises(ValueError, match="dense_conv_taps must be"):
        ImplPolicy(dense_conv_taps=(300, 200))
    with pytest.raises(ValueError, match="dense_conv_taps must be"):
        ImplPolicy(dense_conv_taps=200)
    with pytest.raises(ValueError, match="qe_chunk_fraction must be a positive number"):
        ImplPolicy(qe_chunk_fraction=0)
    with pytest.raises(ValueError, match="policy must be an ImplPolicy or None"):
        set_impl_policy("cpu", {"gemm_speedup": 3.0})
    with pytest.raises(ValueError, match="device_type must be"):
        set_impl_policy(torch.device("cpu"), None)


def test_qe_chunk_fraction_sets_the_query_chunks_not_the_values(set_policy, monkeypatch):
    """A global 14x14 layer (n = 196, h = 4, k = 16, v = 16): chunks of q . E hold at most ``fraction`` of
    lambda^p's b n k v elements, i.e. ``fraction n k v / (h m)`` queries: 16 at the CPU's 0.25, 64 at 1.0
    (four times fewer GEMMs); the output is the same function (float64 rounding only)."""
    from lambdanet.ops.position_lambda import fast
    from lambdanet.layers.lambda_layer import ImplPolicy

    layer = randomize_norms(LambdaLayer(64, dim_k=16, heads=4, r=None, feat_size=14)).eval().double()
    x = torch.randn(2, 64, 14, 14, dtype=torch.float64)
    chunks = []
    original = fast._qe_chunk
    monkeypatch.setattr(fast, "_qe_chunk", lambda *a, **kw: chunks.append(original(*a, **kw)) or chunks[-1])
    outputs = {}
    for fraction in (0.25, 1.0):
        set_policy("cpu", ImplPolicy(qe_chunk_fraction=fraction))
        assert layer.plan((14, 14)).qe_chunk_fraction == fraction
        outputs[fraction] = layer(x)
    assert chunks == [16, 64]
    # sums over m = 196 products ~|q||E||v|: float64 rounding far below 1e-12 of the output's size
    torch.testing.assert_close(outputs[1.0], outputs[0.25], atol=1e-12 * outputs[0.25].abs().max().item(), rtol=0)


def test_cuda_policy_picks_within_1_2x_of_the_fastest_measured_on_an_h100():
    """The registered CUDA policy against the H100 measurement it was fitted to (docs/bench/gpu/impls.json,
    BENCHMARKS.md section 8): at every measured point the implementation ``auto`` now picks on "cuda" took at
    most 1.2x the fastest's time there (the documented claim), and never the depthwise convolution."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).parent.parent / "docs/bench/gpu/impls.json").read_text())
    points = {(r["batch"], r["channels"], r["side"], r["scope"]) for r in rows}
    assert len(points) == 12
    for b, c, side, scope in sorted(points):
        r = None if scope == "global" else int(scope.split("x")[0])
        picked = LambdaLayer(c, dim_k=16, heads=4, r=r, feat_size=side).choose_impl((side, side), "cuda")
        here = [x for x in rows if (x["batch"], x["channels"], x["side"], x["scope"]) == (b, c, side, scope)]
        at = {x["impl"]: x["slowdown_vs_fastest"] for x in here}
        assert picked != "depthwise_conv" and at[picked] <= 1.21, (b, c, side, scope, picked, at)


def test_compiled_layer_under_bf16_autocast_trains_like_eager():
    """torch.compile (AOTAutograd, which traces the backward without autocast) of a queries-first layer under
    bf16 autocast: its backward once mixed bf16 and fp32 operands in one GEMM (seen on an H100). It now runs
    and gives eager's gradients: the same ops, so differences come only from a bf16 rounding flipped by
    reordered fp32 sums, a few units of 2^-8 in a few elements (relative norm well under 1e-2)."""
    torch.manual_seed(0)
    layer = LambdaLayer(32, dim_k=16, heads=4, r=None, feat_size=8)
    assert layer.choose_impl((8, 8), "cpu") == "einsum_qe"
    x = torch.randn(2, 32, 8, 8)
    grads = []
    for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(xi)
        y.float().square().sum().backward()
        grads.append([xi.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for eager, compiled in zip(*grads):
        assert torch.isfinite(compiled).all()
        assert (compiled - eager).norm() <= 1e-2 * eager.norm()


# ------------------------------------------------------------------------------------------ measured auto (issue 39)
# r=5 on a 6x6 map, k=2, h=2, v=4: n = 36, 25 taps; multiply-adds per query and context position: einsum_qe
# n h (k + v) = 432, einsum n k v = 288, both convolutions 25 k v = 200; all within the tuner's factor 4 of the
# cheapest, so all four are timed. The static policy picks einsum_qe (432 <= 2.5 * 200).
TUNED_IMPLS = ("einsum_qe", "einsum", "conv", "depthwise_conv")


def tuned_layer(**kwargs):
    return LambdaLayer(8, dim_k=2, heads=2, r=5, **kwargs)


def fake_timer(fastest, calls=None, seconds=1.0, others=2.0):
    """A timer that runs each call (the candidates really execute) and reports ``seconds`` for ``fastest``,
    ``others`` for the rest; the implementations it was asked to time go to ``calls``."""

    def timer(impl, run):
        run()
        if calls is not None:
            calls.append(impl)
        return seconds if impl == fastest else others

    return timer


def refuse_timing(impl, run):
    raise AssertionError(f"{impl} was timed where nothing may be timed")


@pytest.mark.parametrize("fastest", TUNED_IMPLS)
def test_auto_runs_the_implementation_the_timer_finds_fastest(fastest, monkeypatch):
    from lambdanet.ops.position_lambda.tuning import auto_choice, isolated_tuning

    layer = tuned_layer()
    assert layer.choose_impl((6, 6)) == "einsum_qe"
    ran = _record_position_functions(monkeypatch)
    calls = []
    with isolated_tuning("measure", timer=fake_timer(fastest, calls)):
        x = torch.randn(2, 8, 6, 6, requires_grad=True)
        layer(x).sum().backward()
        assert calls[0] == "einsum_qe" and set(calls) == set(TUNED_IMPLS)  # the static pick first, then the rest
        assert auto_choice(layer, x) == fastest
    assert ran[-1] == fastest  # the call itself ran the winner, after the timed candidates


def test_auto_keeps_the_static_pick_unless_another_is_clearly_faster():
    """A candidate at 0.97x the static pick's time is noise on a busy machine: the static pick stays; at 0.9x
    the other one wins."""
    from lambdanet.ops.position_lambda.tuning import auto_choice, isolated_tuning

    x = torch.randn(2, 8, 6, 6)
    for seconds, want in ((0.97, "einsum_qe"), (0.9, "conv")):
        with isolated_tuning("measure", timer=fake_timer("conv", seconds=seconds, others=1.0)):
            layer = tuned_layer()
            layer(x)
            assert auto_choice(layer, x) == want, seconds


def test_auto_times_once_per_key_and_forward_only_without_autograd(monkeypatch):
    from lambdanet.ops.position_lambda.tuning import isolated_tuning, tuned_impls

    grads = []
    original = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: grads.append(1) or original(*a, **kw))
    calls = []
    layer = tuned_layer()
    with isolated_tuning("measure", timer=fake_timer("conv", calls)):
        layer(torch.randn(2, 8, 6, 6)).sum().backward()
        timed, backwards = len(calls), len(grads)
        assert timed >= len(TUNED_IMPLS) and backwards == timed  # training: every timed call runs its backward
        layer(torch.randn(2, 8, 6, 6)).sum().backward()
        tuned_layer()(torch.randn(2, 8, 6, 6)).sum().backward()  # another layer of the same shape: same key
        assert len(calls) == timed and len(tuned_impls()) == 1
        for shape in ((3, 8, 6, 6), (2, 8, 7, 7)):  # another batch, another map: timed again
            layer(torch.randn(*shape)).sum().backward()
            assert len(calls) > timed, shape
            timed = len(calls)
        grads.clear()
        with torch.no_grad():  # its own key, timed forward only
            layer(torch.randn(2, 8, 6, 6))
        assert len(calls) > timed and grads == [] and len(tuned_impls()) == 4


def test_auto_times_nothing_under_compile_export_tracing_or_a_dispatch_mode():
    """Where a compiler, exporter, tracer or dispatch mode (a FLOP counter) sees the call, or deterministic
    algorithms are asked for, nothing is timed (the timer raises) and the static plan runs, with no graph break;
    a winner measured in eager mode before is what torch.compile and torch.export then take."""
    import torch._dynamo
    from torch.utils.flop_counter import FlopCounterMode

    from lambdanet.ops.position_lambda.tuning import isolated_tuning, set_impl_timer, tuned_impls

    layer = tuned_layer().eval()
    x = torch.randn(2, 8, 6, 6)

    def has_conv(graph_module):  # a convolution anywhere in the graph or its subgraphs (autograd Functions)
        graphs = [m.graph for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        return any("conv" in str(node.target) for graph in graphs for node in graph.nodes)

    with isolated_tuning("measure", timer=refuse_timing):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(layer)(x)
        assert explanation.graph_break_count == 0 and not has_conv(explanation.graphs[0])  # einsum_qe: GEMMs
        assert not has_conv(torch.export.export(layer, (x,)).graph_module)
        with pytest.warns((FutureWarning, DeprecationWarning)):  # torch.jit.trace is deprecated (2.11: Deprecation)
            torch.jit.trace(layer, (x,), check_trace=False)
        with FlopCounterMode(display=False):
            layer(x)
        torch.use_deterministic_algorithms(True)
        try:
            layer(x)
        finally:
            torch.use_deterministic_algorithms(False)
        assert tuned_impls() == {}
        set_impl_timer(fake_timer("conv"))
        layer(x)  # eager: measured, the dense convolution wins
        set_impl_timer(refuse_timing)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(layer)(x)
        assert explanation.graph_break_count == 0 and has_conv(explanation.graphs[0])
        assert has_conv(torch.export.export(layer, (x,)).graph_module)


def test_auto_resolves_a_known_key_without_rebuilding_it_until_the_winners_change(monkeypatch, set_policy):
    """The winner of a key is resolved once per generation of the winners (the key's Python costs a few percent of
    a small layer's call): later calls of the key take the memo, a new batch size is a new key, and
    ``clear_impl_cache`` makes the next call measure again and run the new winner."""
    import copy
    import dataclasses

    from lambdanet.layers import clear_impl_cache
    from lambdanet.ops.position_lambda import tuning as impl_tuning
    from lambdanet.ops.position_lambda.tuning import impl_policy, isolated_tuning, set_impl_timer

    built = []
    real = impl_tuning._plans
    monkeypatch.setattr(impl_tuning, "_plans", lambda *a: built.append(a[1]) or real(*a))
    layer, x = tuned_layer().eval(), torch.randn(2, 8, 6, 6)
    ran = _record_position_functions(monkeypatch)
    with isolated_tuning("measure", timer=fake_timer("conv")):
        with torch.no_grad():
            layer(x)
            assert len(built) == 1 and ran[-1] == "conv"
            for _ in range(3):
                layer(x)
            assert len(built) == 1 and ran[-1] == "conv"  # the memo: no key rebuilt, the same winner
            layer(x[:1])
            assert len(built) == 2  # another batch size: another key
            clear_impl_cache()
            set_impl_timer(fake_timer("depthwise_conv"))
            layer(x)
            assert len(built) == 3 and ran[-1] == "depthwise_conv"
            set_policy("cpu", dataclasses.replace(impl_policy("cpu")))  # an equal policy, but another one
            layer(x)
            assert len(built) == 4  # resolved again under the policy now in force
            assert impl_tuning._MEMOS.get(layer) and copy.deepcopy(layer) not in impl_tuning._MEMOS  # not copied


def test_static_mode_and_the_environment_switch_timing_off(monkeypatch):
    from lambdanet.layers import impl_tuning_mode, set_impl_tuning
    from lambdanet.ops.position_lambda.tuning import isolated_tuning, tuned_impls

    with isolated_tuning("static", timer=refuse_timing):
        layer = tuned_layer()
        layer(torch.randn(2, 8, 6, 6)).sum().backward()
        assert tuned_impls() == {}
    previous = impl_tuning_mode()
    try:
        for value, mode in (("0", "static"), ("off", "static"), ("1", "measure"), ("", "measure")):
            monkeypatch.setenv("LAMBDANET_AUTOTUNE", value)
            set_impl_tuning(None)  # back to the environment's choice
            assert impl_tuning_mode() == mode, value
    finally:
        set_impl_tuning(previous)
    with pytest.raises(ValueError, match=r"^mode must be one of \['measure', 'static'\], got 'fast'$"):
        set_impl_tuning("fast")


@pytest.mark.parametrize("winner", TUNED_IMPLS)
def test_measured_auto_trains_exactly_like_the_implementation_it_picked(winner):
    """The same function as impl=winner, bit for bit (same ops on the same inputs), gradients included; timing
    the candidates consumed no random numbers, wrote no parameter gradient and left the BatchNorm statistics
    with the one update of the call itself."""
    from lambdanet.ops.position_lambda.tuning import isolated_tuning

    torch.manual_seed(0)
    auto = tuned_layer()
    explicit = tuned_layer(impl=winner)
    explicit.load_state_dict(auto.state_dict())
    x = torch.randn(2, 8, 6, 6)
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with isolated_tuning("measure", timer=fake_timer(winner)):
        rng = torch.get_rng_state()
        ya = auto(xa)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in auto.parameters())
        ya.square().sum().backward()
    ye = explicit(xe)
    ye.square().sum().backward()
    assert torch.equal(ya, ye) and torch.equal(xa.grad, xe.grad)
    for (name, pa), pe in zip(auto.named_parameters(), explicit.parameters()):
        assert torch.equal(pa.grad, pe.grad), name
    for (name, ba), be in zip(auto.named_buffers(), explicit.buffers()):
        assert torch.equal(ba, be), name  # running statistics, num_batches_tracked == 1


def test_measured_auto_in_eval_leaves_the_embedding_cache_as_it_was():
    """Timing einsum_qe in inference fills the eval cache of E; with another winner the cache is restored."""
    from lambdanet.ops.position_lambda.tuning import isolated_tuning

    layer = tuned_layer().eval()
    with isolated_tuning("measure", timer=fake_timer("conv")), torch.no_grad():
        layer(torch.randn(2, 8, 6, 6))
    assert not layer.embedding.__dict__.get("_cache")


def test_measured_winners_survive_in_the_cache_file_and_a_corrupt_file_is_ignored(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from lambdanet.ops.position_lambda.tuning import _Tuner, auto_choice, isolated_tuning

    path = tmp_path / "tuning" / "impls.json"
    layer, x = tuned_layer(), torch.randn(2, 8, 6, 6)
    with isolated_tuning("measure", timer=fake_timer("conv"), cache_file=path):
        layer(x)
    assert list(json.loads(path.read_text())["winners"].values()) == ["conv"]
    with isolated_tuning("measure", timer=refuse_timing, cache_file=path):  # as a new process: read, not timed
        layer(x)
        assert auto_choice(layer, x) == "conv"
    path.write_text('{"version": 1, "winners": ')  # a write cut short
    with isolated_tuning("measure", timer=fake_timer("depthwise_conv"), cache_file=path):
        with pytest.warns(RuntimeWarning, match="ignoring the impl tuning cache .*impls.json"):
            layer(x)
        assert auto_choice(layer, x) == "depthwise_conv"
    assert list(json.loads(path.read_text())["winners"].values()) == ["depthwise_conv"]  # rewritten whole
    monkeypatch.setenv("LAMBDANET_AUTOTUNE_CACHE", str(path))
    assert _Tuner().file == path
    monkeypatch.setenv("LAMBDANET_AUTOTUNE_CACHE", "1")
    assert _Tuner().file == (Path("~") / ".cache/lambdanet/impl_tuning.json").expanduser()


def test_static_cpu_policy_takes_einsum_qe_at_issue_39s_point():
    """B=8 C=256 16x16 r=9 (issue 39; BENCHMARKS.md section 1): einsum_qe trained in 19 ms there against 368 ms
    for the depthwise convolution, so the static fallback must not pick the latter; and the tuner times all four
    implementations there (n h (k + v) = 81920, taps k v = 82944, n k v = 262144: within its factor 4)."""
    from lambdanet.ops.position_lambda.tuning import candidate_plans, impl_policy

    layer = LambdaLayer(256, dim_k=16, heads=4, r=9)
    assert layer.choose_impl((16, 16), "cpu") == "einsum_qe"
    assert layer.plan((16, 16), "cpu").position == "einsum_qe_whole"
    assert set(candidate_plans(layer, (16, 16), impl_policy("cpu"), "einsum_qe")) == set(TUNED_IMPLS)


def test_measured_auto_trains_under_activation_checkpointing():
    """The first call's timing saves tensors of its own: they must not reach the saved-tensor hooks of activation
    checkpointing (which recomputes the forward and checks that it saves the same tensors)."""
    from lambdanet.ops.position_lambda.tuning import isolated_tuning
    from lambdanet.models import create_model

    torch.manual_seed(0)
    model = create_model("lambda_resnet26", stem="cifar", img_size=16, num_classes=10)
    plain = create_model("lambda_resnet26", stem="cifar", img_size=16, num_classes=10)
    plain.load_state_dict(model.state_dict())
    model.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 16, 16)
    with isolated_tuning("measure"):
        model(x).sum().backward()
    with isolated_tuning("static"):
        plain(x).sum().backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def test_training_runs_choose_implementations_by_the_static_policy(monkeypatch, tmp_path):
    """A run's ranks and its resumption must compute the same function: the engine pins the static policy for the
    run (a measured winner depends on the machine's load) and gives the caller's mode back afterwards."""
    from lambdanet.ops.position_lambda.tuning import isolated_tuning
    import types

    import lambdanet.engine.task as engine_task
    from lambdanet.ops.position_lambda.tuning import impl_tuning_mode

    seen = []
    monkeypatch.setattr(engine_task, "_run", lambda task: seen.append(impl_tuning_mode()) or {})
    cfg = types.SimpleNamespace(device="cpu", out=tmp_path / "run")
    with isolated_tuning("measure"):
        engine_task.run(lambda *args: None, cfg)
        assert impl_tuning_mode() == "measure"
    assert seen == ["static"]


@pytest.mark.parametrize("impl", ["conv", "depthwise_conv", "einsum", "einsum_qe", "auto"])
@pytest.mark.parametrize("r,size,dim_u", [(23, 4, 1), (5, 6, 1), (7, 5, 2)])
def test_an_empty_batch_runs_forward_and_backward_in_every_implementation(impl, r, size, dim_u):
    """A batch of 0 images (a data loader's empty last shard, ``bench --batch-size 0``): the empty output and zero
    gradients, as any PyTorch layer gives (a reshape with an inferred size failed in ``einsum_qe``'s backward)."""
    if impl == "einsum_qe" and dim_u > 1:
        pytest.skip("einsum_qe serves u = 1")
    layer = LambdaLayer(64, dim_k=16, heads=4, r=r, dim_u=dim_u, impl=impl)
    x = torch.randn(0, 64, size, size, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 64, size, size)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters() if p.requires_grad)


@pytest.mark.parametrize("impl", ["auto", "einsum", "einsum_qe", "depthwise_conv"])
def test_torch_func_transforms_run_the_layers(impl):
    """torch.func.grad / vmap (per-sample gradients) took no Function without setup_context: the layers' Python
    Functions give way to plain ops there. Against autograd and the unbatched call, float64 (rounding ~1e-15)."""
    torch.manual_seed(0)
    layers = [LambdaLayer(8, dim_k=4, heads=2, r=3, impl=impl).double().eval()]
    if impl == "auto":  # the causal layer on the chunked op (its scan and host read of the keys' spread)
        from lambdanet.layers import CausalLambdaLayer

        layers.append(CausalLambdaLayer(8, heads=2, dim_k=4, r=3, chunk=4).double().eval())
    for layer in layers:
        x = torch.randn(2, 8, 5, 5, dtype=torch.float64) if isinstance(layer, LambdaLayer) else \
            torch.randn(2, 10, 8, dtype=torch.float64)  # fmt: skip
        params = {k: v.detach() for k, v in layer.named_parameters()}

        def loss(p, x):
            return torch.func.functional_call(layer, p, (x,)).square().sum()

        got = torch.func.grad(loss)(params, x)
        want = torch.autograd.grad(loss(dict(layer.named_parameters()), x), list(layer.parameters()))
        for (name, g), w in zip(got.items(), want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(torch.func.vmap(layer)(x[:, None])[:, 0], layer(x), rtol=1e-10, atol=1e-12)


def test_torch_func_without_autograd_and_traces_do_not_go_through_the_embedding_cache():
    """Ensembles by vmap over stacked parameters under no_grad (the cache used to keep a functorch tensor: the
    next call failed), a global layer past 852 positions (chunks checkpointed with saved-tensor hooks, which
    torch.func refuses) and a trace after a warm cache (it baked E in as a constant)."""
    torch.manual_seed(0)
    layers = [LambdaLayer(8, dim_k=4, heads=2, r=3, impl="einsum_qe").double().eval() for _ in range(2)]
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    stacked = {k: torch.stack([dict(m.named_parameters())[k].detach() for m in layers]) for k, _ in
               layers[0].named_parameters()}  # fmt: skip
    buffers = {k: torch.stack([dict(m.named_buffers())[k] for m in layers]) for k, _ in layers[0].named_buffers()}

    def run(p, b):
        return torch.func.functional_call(layers[0], (p, b), (x,))

    with torch.no_grad():
        for _ in range(2):
            got = torch.func.vmap(run)(stacked, buffers)
            for i, m in enumerate(layers):
                torch.testing.assert_close(got[i], m(x), rtol=1e-10, atol=1e-12)
    wide = LambdaLayer(8, dim_k=4, heads=2, r=None, feat_size=30, impl="einsum_qe").double().eval()
    y = torch.randn(1, 8, 30, 30, dtype=torch.float64)
    params = {k: v.detach() for k, v in wide.named_parameters()}
    got = torch.func.grad(lambda p: torch.func.functional_call(wide, p, (y,)).square().sum())(params)
    want = torch.autograd.grad(wide(y).square().sum(), list(wide.parameters()))
    for (name, g), w in zip(got.items(), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    layer = layers[0]
    with torch.no_grad():
        layer(x)  # a warm cache
        traced = torch.jit.trace(layer, x, check_trace=False)
        layer.embedding.weight.mul_(2.0)
        torch.testing.assert_close(traced(x), layer(x), rtol=1e-10, atol=1e-12)  # the trace reads the table


def test_torch_jit_trace_runs_the_causal_layer():
    """A trace hands call_mode 0-d tensors as shapes (it failed on int.bit_length) and saves no Python Function:
    the traced layer equals the eager one at the traced length (float32 rounding, outputs ~1)."""
    import warnings

    from lambdanet.layers import CausalLambdaLayer

    layer = CausalLambdaLayer(8, heads=2, dim_k=4, r=3).eval()
    x = torch.randn(2, 9, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace's own warnings about Python values
        traced = torch.jit.trace(layer, x)
    torch.testing.assert_close(traced(x), layer(x), rtol=1e-5, atol=1e-5)


def test_layers_built_on_the_meta_device_reset_to_their_own_initialisation():
    """Meta construction, to_empty, then each module's reset_parameters through ``apply`` (children first, then
    the layer, as large-model loaders do): every
    parameter the layers own gets its initialisation back (position_bias 0; the causal layer's table, identity
    convolution and decay rates), not the uninitialised memory to_empty leaves."""
    from lambdanet.layers import CausalLambdaLayer

    for make in (lambda: LambdaLayer(8, dim_k=4, heads=2, r=3, position_bias=True),
                 lambda: CausalLambdaLayer(8, heads=2, dim_k=4, r=3, short_conv=3, decay="fixed"),
                 lambda: CausalLambdaLayer(8, heads=2, dim_k=4, r=3, decay="gate")):  # fmt: skip
        fresh = make()
        with torch.device("meta"):
            layer = make()
        layer = layer.to_empty(device="cpu")
        for p in layer.parameters():
            torch.nn.init.constant_(p, 7.0)  # what to_empty may leave
        layer.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        for name, p in layer.named_parameters():
            assert (p != 7.0).any(), name
        if isinstance(layer, CausalLambdaLayer):  # the deterministic parts equal a fresh layer's
            mine, theirs = dict(layer.named_parameters()), dict(fresh.named_parameters())
            for name in ("conv.weight", "decay_rate", "gate.weight", "gate.bias"):
                if name in theirs:
                    torch.testing.assert_close(mine[name], theirs[name])
            torch.manual_seed(3)
            layer.reset_parameters()  # the table: the same draws as the constructor's N(0, 1 / (r k))
            torch.manual_seed(3)
            torch.testing.assert_close(layer.emb.detach(), torch.randn(3, 4, 1) / math.sqrt(3 * 4))
        else:
            assert torch.equal(layer.position_bias, torch.zeros(4))


def test_the_2x2_stride_pool_rounds_an_odd_side_up_as_a_strided_shortcut_does():
    """``stride_pool=2`` on a 7 x 5 map: a 4 x 3 output, the shape of a 1x1 stride-2 convolution's (a block's
    shortcut, which it is added to), each window the mean of the positions it covers (the last row and column:
    of the one or two there are)."""
    torch.manual_seed(0)
    layer = LambdaLayer(32, dim_k=8, heads=4, r=5, stride=2, stride_pool=2).eval()
    plain = LambdaLayer(32, dim_k=8, heads=4, r=5).eval()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 32, 7, 5)
    with torch.no_grad():
        y, full = layer(x), plain(x).double()
    assert y.shape == torch.nn.Conv2d(32, 32, 1, stride=2)(x).shape == (2, 32, 4, 3)
    expected = torch.stack([torch.stack([full[:, :, i : i + 2, j : j + 2].mean((2, 3)) for j in range(0, 5, 2)], -1)
                            for i in range(0, 7, 2)], -2)  # fmt: skip
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)  # float32 sums of <= 4 terms of O(1)
