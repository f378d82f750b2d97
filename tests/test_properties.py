"""Property-based tests (hypothesis) over random valid configurations of :class:`LambdaLayer` and of every
spatial layer of the registry (plus the channel gates :class:`SqueezeExcite` and
:class:`EfficientChannelAttention`).

(a) Every implementation computes the function of an independent float64 reference written here from the
    papers' equations (explicit position grids, gathers and masks; no code shared with the layers): outputs and
    the gradients of the input and of every parameter.
    * LambdaLayer: every ``impl`` (``conv``, ``depthwise_conv``, ``einsum``, ``einsum_qe``, ``auto``; ``triton``
      under Triton's interpreter in the slow profile), the whole or row-chunked embeddings, channels-first and
      channels-last inputs, with and without autograd (the cached embeddings); 1-3 spatial dims, odd and
      non-square sizes, local scopes (larger and smaller than the map, causal ones of any length) and global
      contexts (relative, cropped to smaller inputs, or absolute), heads, dim_k, dim_u, multi-query / multi-head,
      content / position, key normalisations, query softmax, BatchNorm (train and eval) / LayerNorm / none,
      stride 1 / 2 with both pools, the position bias.
    * Attention baselines: both attention kernels (``math`` and ``sdpa``) against the reference.
    * Translation equivariance of the local layers (lambda convolution, SASA, pixel-centred halo attention) on
      two windows cropped from one larger image.
(b) Invalid configurations and inputs raise a one-line ``ValueError`` that names the offending argument.

Examples are derandomized (CI is deterministic) and tiny (batch 1-2, a few channels, sides 1-7); the tests
marked ``slow`` draw more and larger examples.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lambdanet.layers import (
    AttentionAugmentedConv,
    AxialAttention,
    EfficientChannelAttention,
    HaloAttention,
    LambdaLayer,
    LocalSelfAttention,
    RelativePositionEmbedding,
    RelativeSelfAttention,
    SqueezeExcite,
    create_spatial_layer,
    list_spatial_layers,
    use_attention_impl,
)
from lambdanet.layers.conv import ConvLayer, ConvSE
from lambdanet.layers.lambda_layer import ImplPolicy, set_impl_policy
from lambdanet.layers.linear_attention import ConvPlusAttention
from lambdanet.layers.local_attention import BlockedLocalAttention

# ---------------------------------------------------------------------------------------------------- settings
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def examples(n: int) -> settings:
    """``n`` derandomized examples, no deadline (the default suite; the ``slow`` tests ask for more)."""
    return settings(max_examples=n, **_COMMON)


# Tolerance of the float64 comparisons, from the forward error of rounded sums (Higham, Accuracy and Stability of
# Numerical Algorithms, Sec. 3.1): a sum of L products computed in floating point is off by at most L u sum|terms|,
# u = 2^-53 ~ 1.1e-16 the float64 unit roundoff; a chain of such sums adds their bounds, and softmax / exp / sqrt /
# division add O(u) relative error each. The longest chain behind any compared entry (slow profile, the larger
# one): projection over d <= 12 channels + BatchNorm statistics over b n <= 250 positions + key normalisation over
# m <= 125 context positions + the lambda over m u <= 500 terms + its application over k <= 4 + a 27-tap pool:
# L < 1000, an error below 1000 u ~ 1.1e-13 of sum|terms|. The terms are O(1) weights, inputs and embeddings
# times softmax weights <= 1, so sum|terms| exceeds the largest compared entry by about sqrt(L) ~ 30 (a sum of L
# random-sign terms), by 10^3 at the very worst: the error bound is 3e-12 (1e-10 worst case) of the largest entry.
# F64_TOL = 1e-10 compares max |got - want| per tensor against that: measured errors stay below 5e-13 (1e-15
# typical; 55k comparisons, both profiles), while every bug injected to try the suite (a causal mask shifted by
# one, a flipped kernel, a wrong centre, an sdpa scale off by 1e-4, a dropped padding mask, a skipped norm, a
# count_include_pad pool, detached multi-head lambdas) is off by 5e-5 or more. A gradient tensor that vanishes
# by cancellation (the key gradient of a one-position softmax) holds rounding noise of the cancelling terms, whose
# scale is that of the other gradients: it is measured against 0.1 x the largest gradient of the computation.
# The bound assumes O(1) conditioning; normalisations divide by sqrt(var + eps) >= sqrt(1e-5) and may amplify the
# noise 316x where a normalised group is constant: those degenerate configurations (LayerNorm over a single
# channel, BatchNorm statistics over fewer than 4 positions) are not drawn.
F64_TOL = 1e-10
# The Triton kernels accumulate in float32 whatever the input dtype (lambdanet.kernels.ops): the same bound with
# the float32 epsilon, 1000 * 1.2e-7 ~ 1.2e-4 of the largest entry (as in tests/test_kernels.py).
F32_KERNEL_TOL = 1000 * torch.finfo(torch.float32).eps


def assert_close_scaled(got, want, label, tol=F64_TOL, scale=None):
    """``max |got - want| <= tol * scale`` with ``scale = max |want|`` unless given."""
    assert got is not None, f"{label}: no gradient"
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() if scale is None else scale
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert err <= tol * scale or err == 0.0, f"{label}: max |error| {err:.3g} > {tol:.1g} * {scale:.3g}"


def assert_grads_close(got, want, labels, tol=F64_TOL):
    """Each gradient within ``tol`` of its reference, measured against max(its own scale, 0.1 x the largest
    gradient of the computation): see F64_TOL for why a cancelling gradient needs the second term."""
    largest = max((w.abs().max().item() for w in want if w is not None and w.numel()), default=0.0)
    for g, w, label in zip(got, want, labels):
        if w is None:
            w = torch.zeros_like(g)
        if g is None:
            g = torch.zeros_like(w)
        own = w.abs().max().item() if w.numel() else 0.0
        assert_close_scaled(g, w, label, tol, scale=max(own, 0.1 * largest))


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Every tensor here is tiny: intra-op threads only add synchronisation (10-100x slower per op when the
    machine's cores are busy), so the module runs single-threaded and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def cpu_policy(policy):
    previous = set_impl_policy("cpu", policy)
    try:
        yield
    finally:
        set_impl_policy("cpu", previous)


# ---------------------------------------------------------------------------------------------------- references
def grid(spatial):
    """``[n, d]`` integer coordinates of the positions of a ``spatial`` map, row-major (``x.flatten(2)``'s order)."""
    return torch.cartesian_prod(*[torch.arange(s) for s in spatial]).reshape(-1, len(spatial))


def reference_norm(mod, t):
    """The q / v normalisation on ``[b, n, c]`` from its definition: BatchNorm over the ``b n`` positions (batch
    statistics in training, running ones in eval), LayerNorm over the channels, or nothing."""
    if isinstance(mod, nn.BatchNorm1d):
        if mod.training:
            flat = t.reshape(-1, t.shape[-1])
            mean, var = flat.mean(0), flat.var(0, unbiased=False)
        else:
            mean, var = mod.running_mean, mod.running_var
        return (t - mean) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias
    if isinstance(mod, nn.LayerNorm):
        mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mean) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias
    assert isinstance(mod, nn.Identity)
    return t


def reference_avg_pool(x, kernel, stride, pad):
    """Average pool over every spatial axis: with padding (the 3x3 pool) counting the zeros (``count_include_pad``),
    floor mode; without (the 2x2 pool) in ceil mode, a window past the end averaging the positions it holds (an odd
    side rounds up, as a block's stride-2 shortcut does)."""
    dims = x.dim() - 2
    x = F.pad(x, [pad] * (2 * dims))
    held = torch.ones_like(x)
    if pad == 0:
        for a in range(dims):
            n = x.shape[2 + a]
            past = (-(-max(n - kernel, 0) // stride)) * stride + kernel - n  # ceil mode: the last window's overhang
            x, held = (F.pad(t.movedim(2 + a, -1), (0, past)).movedim(-1, 2 + a) for t in (x, held))
    for a in range(dims):
        x, held = x.unfold(2 + a, kernel, stride), held.unfold(2 + a, kernel, stride)
    count = held.sum(dim=tuple(range(-dims, 0))) if pad == 0 else kernel**dims
    return x.sum(dim=tuple(range(-dims, 0))) / count


def reference_pool_ceil(x, stride):
    """``stride x stride`` block means in ceil mode: a partial block at the border averages the pixels it holds."""
    if stride == 1:
        return x
    hh, ww = x.shape[2:]
    ho, wo = -(-hh // stride), -(-ww // stride)
    pad = (0, wo * stride - ww, 0, ho * stride - hh)
    sums = F.pad(x, pad).unfold(2, stride, stride).unfold(3, stride, stride).sum((-1, -2))
    counts = F.pad(torch.ones(1, 1, hh, ww, dtype=x.dtype), pad).unfold(2, stride, stride).unfold(
        3, stride, stride).sum((-1, -2))
    return sums / counts


def lambda_reference(layer: LambdaLayer, x):
    """Eq. 1-2 of LambdaNetworks for every query position, from the layer's parameters, with the context of each
    query an explicit mask ``M[n, m]`` (all ones, or ``m <= n`` when causal) and the position embeddings
    ``E[n, m] = R[m - n + centre]`` (zero outside the table, i.e. outside the scope) or the absolute ``E``.

    ``lambda_n = sum_{m,u} (Kbar_n[m] + E[n, m]) V[m]^T`` with ``Kbar_n`` the keys normalised over query ``n``'s
    context; ``y_n = concat_h(lambda_n^T q^h_n)`` (+ ``q_n . b`` with the position bias); then the pool.
    """
    b, _, *spatial = x.shape
    n = math.prod(spatial)
    h, k, u, v, g = layer.heads, layer.dim_k, layer.dim_u, layer.dim_v, layer.groups
    tokens = x.reshape(b, layer.dim, n).transpose(1, 2)  # b n d
    w = layer.qkv.weight
    nk = layer.dim_keys_total
    q = tokens @ w[: h * k].t()
    keys = tokens @ w[h * k: h * k + nk].t()
    vals = tokens @ w[h * k + nk:].t()
    q = reference_norm(layer.norm_q, q).view(b, n, h, k)
    if layer.query_softmax:
        q = q.softmax(dim=-1)
    vals = reference_norm(layer.norm_v, vals).view(b, n, g, v, u)
    mask = torch.ones(n, n, dtype=torch.bool)
    if layer.causal:
        mask = mask.tril()
    lam = torch.zeros(b, n, g, k, v, dtype=x.dtype)  # lambda_n per query
    if layer.content:
        kk = keys.view(b, 1, n, g, k, u).expand(b, n, n, g, k, u)  # b n m g k u
        mk = mask.view(1, n, n, 1, 1, 1)
        if layer.key_norm == "softmax":
            kbar = kk.masked_fill(~mk, -math.inf).softmax(dim=2)
        elif layer.key_norm == "l2":
            kbar = kk * mk / (kk.square() * mk).sum(dim=2, keepdim=True).sqrt().clamp_min(1e-12)
        else:
            kbar = kk * mk
        lam = lam + torch.einsum("bnmgku,bmgvu->bngkv", kbar, vals)
    if layer.position:
        emb = layer.embedding
        if isinstance(emb, RelativePositionEmbedding):
            table = emb.table  # g k u *K
            ksize = tuple(table.shape[3:])
            centre = tuple(s - 1 if layer.causal else s // 2 for s in ksize)
            assert emb.center == centre
            pos = grid(spatial)
            t = pos[None, :, :] - pos[:, None, :] + torch.tensor(centre)  # n m d: table index of offset m - n
            inside = ((t >= 0) & (t < torch.tensor(ksize))).all(-1)  # n m
            t = torch.minimum(t.clamp_min(0), torch.tensor(ksize) - 1)
            flat = torch.zeros(n, n, dtype=torch.long)
            for a, s in enumerate(ksize):
                flat = flat * s + t[..., a]
            e = table.flatten(3)[..., flat] * inside  # g k u n m
        else:
            e = emb.table
        e = e * mask
        lam = lam + torch.einsum("gkunm,bmgvu->bngkv", e, vals)
    if g == 1:
        out = torch.einsum("bnhk,bnkv->bnhv", q, lam[:, :, 0])
    else:
        out = torch.einsum("bnhk,bnhkv->bnhv", q, lam)
    if layer.position_bias is not None:
        out = out + (q @ layer.position_bias).unsqueeze(-1)
    out = out.reshape(b, n, h * v).transpose(1, 2).reshape(b, h * v, *spatial)
    if layer.stride > 1:
        out = reference_avg_pool(out, layer.stride_pool, layer.stride, (layer.stride_pool - 1) // 2)
    return out


def project(conv, x):
    """A 1x1 convolution ``[B, C, *S] -> [B, C_out, *S]`` as a matrix product."""
    out = torch.einsum("oc,bc...->bo...", conv.weight.flatten(1), x)
    if conv.bias is not None:
        out = out + conv.bias.view(1, -1, *([1] * (x.dim() - 2)))
    return out


def reference_conv(conv: nn.Conv2d, x):
    """Zero-padded strided convolution as an explicit sum over taps and channel groups."""
    kh, kw = conv.kernel_size
    s, p, groups = conv.stride[0], conv.padding[0], conv.groups
    b, c, hh, ww = x.shape
    ho, wo = (hh + 2 * p - kh) // s + 1, (ww + 2 * p - kw) // s + 1
    xp = F.pad(x, (p, p, p, p))
    o = conv.out_channels
    ci, co = c // groups, o // groups
    out = torch.zeros(b, o, ho, wo, dtype=x.dtype)
    for di in range(kh):
        for dj in range(kw):
            patch = xp[:, :, di: di + s * (ho - 1) + 1: s, dj: dj + s * (wo - 1) + 1: s]
            for gi in range(groups):
                out[:, gi * co:(gi + 1) * co] += torch.einsum(
                    "oc,bchw->bohw", conv.weight[gi * co:(gi + 1) * co, :, di, dj], patch[:, gi * ci:(gi + 1) * ci])
    if conv.bias is not None:
        out = out + conv.bias.view(1, -1, 1, 1)
    return out


def reference_squeeze_excite(se: SqueezeExcite, x):
    s = x.mean(dim=tuple(range(2, x.dim())))  # b c
    z = torch.relu(s @ se.fc1.weight.flatten(1).t() + se.fc1.bias) @ se.fc2.weight.flatten(1).t() + se.fc2.bias
    return x * torch.sigmoid(z).view(*z.shape, *([1] * (x.dim() - 2)))


def reference_eca(eca: EfficientChannelAttention, x):
    """``gate[c] = sigmoid(sum_j w[j] s[c + j - k // 2])`` over the pooled channels ``s`` (zero outside)."""
    s = x.mean(dim=tuple(range(2, x.dim())))  # b c
    w = eca.conv.weight.view(-1)
    kk, c = w.numel(), s.shape[1]
    sp = F.pad(s, (kk // 2, kk // 2))
    z = sum(w[j] * sp[:, j: j + c] for j in range(kk))
    return x * torch.sigmoid(z).view(*z.shape, *([1] * (x.dim() - 2)))


def reference_efficient_attention(att, x):
    """Shen et al. 2018 per head: ``y_n = sum_j softmax_channels(q_n)[j] sum_m softmax_positions(k)[m, j] v_m``,
    re-projected, plus the input."""
    b, _, hh, ww = x.shape
    h, dk, dv = att.heads, att.dim_k // att.heads, att.dim_v // att.heads
    qkv = project(att.qkv, x).flatten(2)  # b c n
    q, k, v = qkv.split([att.dim_k, att.dim_k, att.dim_v], dim=1)
    q = q.view(b, h, dk, -1).softmax(dim=2)
    k = k.view(b, h, dk, -1).softmax(dim=3)
    v = v.view(b, h, dv, -1)
    out = torch.einsum("bhjn,bhjm,bhvm->bhvn", q, k, v).reshape(b, att.dim_v, hh, ww)
    return x + project(att.proj, out)


def reference_double_attention(att, x):
    """A^2-Nets: gather ``G = A softmax_n(B)^T``, distribute ``z_n = G softmax_c(V_n)``, re-project, residual."""
    b, _, hh, ww = x.shape
    abv = project(att.conv_abv, x).flatten(2)  # b c n
    a, bm, v = abv.split([att.c_m, att.c_n, att.c_n], dim=1)
    gathered = torch.einsum("bin,bjn->bij", a, bm.softmax(dim=2))  # b c_m c_n
    z = torch.einsum("bij,bjn->bin", gathered, v.softmax(dim=1))  # b c_m n
    return x + project(att.proj, z.view(b, att.c_m, hh, ww))


def relative_logit_tables(rel, q, off_h, off_w):
    """``q . r^H[off_h] + q . r^W[off_w]`` (``"full"``) or with the head's channels split between the tables
    (``"half"``); ``q [..., n, d]``, offsets ``[n, m]``, indices clamped to the tables."""
    oh, ow = rel.max_offset
    th = rel.rel_h[(off_h + oh).clamp(0, 2 * oh)]  # n m dh
    tw = rel.rel_w[(off_w + ow).clamp(0, 2 * ow)]  # n m dw
    if rel.split == "full":
        qh = qw = q
    else:
        qh, qw = q[..., : th.shape[-1]], q[..., th.shape[-1]:]
    return torch.einsum("...nd,nmd->...nm", qh, th) + torch.einsum("...nd,nmd->...nm", qw, tw)


def reference_relative_attention(att: RelativeSelfAttention, x, pool=True):
    """Global multi-head attention ``softmax(q k^T / sqrt(dk) + q . (r^H_{a-i} + r^W_{c-j})) v`` over all pixels."""
    b, _, hh, ww = x.shape
    h, dk, dv = att.heads, att.dim_qk // att.heads, att.dim_out // att.heads
    qkv = project(att.qkv, x).flatten(2)  # b c n
    q, k, v = qkv.split([att.dim_qk, att.dim_qk, att.dim_out], dim=1)
    q, k, v = (t.reshape(b, h, -1, hh * ww).transpose(-1, -2) for t in (q, k, v))  # b h n d
    pos = grid((hh, ww))
    off = pos[None, :, :] - pos[:, None, :]  # n m 2: key - query
    logits = q @ k.transpose(-1, -2) * dk ** -0.5 + relative_logit_tables(att.rel, q, off[..., 0], off[..., 1])
    out = (logits.softmax(-1) @ v).transpose(-1, -2).reshape(b, h * dv, hh, ww)
    return reference_pool_ceil(out, att.stride) if pool else out


def reference_attention_augmented(aac: AttentionAugmentedConv, x):
    attn = project(aac.proj, reference_relative_attention(aac.attn, x, pool=False))
    return torch.cat([reference_conv(aac.conv, x), reference_pool_ceil(attn, aac.stride)], dim=1)


def reference_axial(att: AxialAttention, x):
    """Attention down each column with 1-d relative logits ``q_i . r[a - i]``, then along each row."""

    def one_axis(mod, inp):
        b, _, hh, ww = inp.shape
        h, d = mod.heads, mod.dim_out // mod.heads
        qkv = project(mod.qkv, inp).view(b, 3, h, d, hh, ww)
        if mod.axis == 2:  # sequences are columns: b h W H d
            qkv = qkv.permute(1, 0, 2, 5, 4, 3)
        else:  # rows: b h H W d
            qkv = qkv.permute(1, 0, 2, 4, 5, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]
        length = q.shape[-2]
        idx = torch.arange(length)
        off = idx[None, :] - idx[:, None] + mod.rel.max_offset  # i a
        rel = torch.einsum("...id,iad->...ia", q, mod.rel.rel[off])
        out = ((q @ k.transpose(-1, -2)) * d ** -0.5 + rel).softmax(-1) @ v  # b h other L d
        perm = (0, 1, 4, 3, 2) if mod.axis == 2 else (0, 1, 4, 2, 3)
        return out.permute(*perm).reshape(b, mod.dim_out, hh, ww)

    return reference_pool_ceil(one_axis(att.width, one_axis(att.height, x)), att.stride)


def reference_blocked_attention(att: BlockedLocalAttention, x):
    """Per query pixel: its block's ``(b + 2h)^2`` haloed window (Fig. 1-2 of HaloNet), keys outside the image
    masked (``mask_padding``) or zero content and value; with ``window``, only keys within ``window // 2`` pixels
    of the query on both axes. Relative offsets: key pixel - query pixel (``"pixel"``), or window index - the
    query's index in its block (``"window"``, timm's checkpoints)."""
    b, _, hh, ww = x.shape
    bs, hs, s, h = att.block_size, att.halo_size, att.stride, att.heads
    dk, dv = att.dim_qk // h, att.dim_out // h
    win, bq = bs + 2 * hs, bs // s
    hq, wq = -(-hh // s), -(-ww // s)
    q = project(att.q, x[..., ::s, ::s]).reshape(b, h, dk, hq * wq).transpose(-1, -2)  # b h nq dk
    kv = project(att.kv, x)
    big = 2 * (bs + hs)
    kvp = F.pad(kv, (hs, big, hs, big))  # zero content and value outside the image
    qpos = grid((hq, wq)) * s  # nq 2: query pixels
    block0 = qpos // bs * bs - hs  # nq 2: first pixel of the haloed window
    qidx = (qpos - qpos // bs * bs) // s  # nq 2: index of the query inside its (subsampled) block
    wpos = grid((win, win))  # K 2: window indices
    kpix = block0[:, None, :] + wpos[None, :, :]  # nq K 2: key pixels
    inside = (kpix[..., 0] >= 0) & (kpix[..., 0] < hh) & (kpix[..., 1] >= 0) & (kpix[..., 1] < ww)
    keep = inside if att.mask_padding else torch.ones_like(inside)
    if att.window is not None:
        keep = keep & ((kpix - qpos[:, None, :]).abs() <= att.window // 2).all(-1)
    flat = (kpix[..., 0] + hs) * kvp.shape[-1] + (kpix[..., 1] + hs)  # nq K
    kv_g = kvp.flatten(2)[:, :, flat]  # b c nq K
    k = kv_g[:, : att.dim_qk].reshape(b, h, dk, *flat.shape).permute(0, 1, 3, 4, 2)  # b h nq K dk
    v = kv_g[:, att.dim_qk:].reshape(b, h, dv, *flat.shape).permute(0, 1, 3, 4, 2)  # b h nq K dv
    if att.rel_geometry == "pixel":
        off = kpix - qpos[:, None, :]
    else:
        off = wpos[None, :, :] - qidx[:, None, :]
    logits = torch.einsum("bhnd,bhnkd->bhnk", q, k) * dk ** -0.5 + relative_logit_tables(
        att.rel, q, off[..., 0], off[..., 1])
    logits = logits.masked_fill(~keep, -math.inf)
    out = torch.einsum("bhnk,bhnkd->bhnd", logits.softmax(-1), v)  # b h nq dv
    assert bq * s == bs
    return out.transpose(-1, -2).reshape(b, h * dv, hq, wq)


def reference_spatial_layer(layer, x):
    """The reference of any registry layer (and of the channel gates)."""
    if isinstance(layer, LambdaLayer):
        return lambda_reference(layer, x)
    if isinstance(layer, ConvSE):
        return reference_squeeze_excite(layer.se, reference_conv(layer.conv, x))
    if isinstance(layer, ConvLayer):
        return reference_conv(layer.conv, x)
    if isinstance(layer, ConvPlusAttention):
        y = reference_conv(layer.conv.conv, x)
        if hasattr(layer.attn, "qkv"):
            return reference_efficient_attention(layer.attn, y)
        return reference_double_attention(layer.attn, y)
    if isinstance(layer, RelativeSelfAttention):
        return reference_relative_attention(layer, x)
    if isinstance(layer, AttentionAugmentedConv):
        return reference_attention_augmented(layer, x)
    if isinstance(layer, AxialAttention):
        return reference_axial(layer, x)
    if isinstance(layer, LocalSelfAttention):
        return reference_pool_ceil(reference_blocked_attention(layer.attn, x), layer.stride)
    if isinstance(layer, HaloAttention):
        return reference_pool_ceil(reference_blocked_attention(layer, x), layer.pool_stride)
    if isinstance(layer, SqueezeExcite):
        return reference_squeeze_excite(layer, x)
    if isinstance(layer, EfficientChannelAttention):
        return reference_eca(layer, x)
    raise AssertionError(f"no reference for {type(layer).__name__}")


def randomize_(layer):
    """Non-trivial norm statistics and affine parameters, position bias, biases: the reference must use them."""
    with torch.no_grad():
        for mod in layer.modules():
            if isinstance(mod, nn.BatchNorm1d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
            if isinstance(mod, (nn.BatchNorm1d, nn.LayerNorm)):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.3, 0.3)
        if isinstance(layer, LambdaLayer) and layer.position_bias is not None:
            layer.position_bias.normal_()
    return layer


# ---------------------------------------------------------------------------------------------------- (a) LambdaLayer
IMPLS = ("conv", "depthwise_conv", "einsum", "einsum_qe", "auto")


@st.composite
def lambda_configs(draw, big=False, triton=False):
    """A valid LambdaLayer configuration: ``(kwargs, input shape, training, channels_last, chunked)``. Categorical
    choices are drawn from lists weighted towards the rarer paths (causal layers, u = 1 for the queries-first
    einsum, the 2x2 pool) so that a few dozen examples reach every plan step."""
    layout = draw(st.sampled_from(("1d", "1d-causal", "2d") if triton else ("1d", "1d-causal", "2d", "3d")))
    spatial_dims, causal = int(layout[0]), layout.endswith("causal")
    max_side = {1: 12, 2: 7, 3: 4}[spatial_dims] if not big else {1: 24, 2: 11, 3: 5}[spatial_dims]
    spatial = tuple(draw(st.integers(1, max_side)) for _ in range(spatial_dims))
    heads = draw(st.integers(1, 4))
    dim_out = heads * draw(st.integers(1, 3))
    multihead = False if triton else draw(st.sampled_from((False, False, True)))
    dim_u = draw(st.sampled_from((1, 1, 2, 3) if not big else (1, 1, 2, 4)))
    both, content_only, position_only = (True, True), (True, False), (False, True)
    content, position = draw(st.sampled_from([both, position_only] if triton  # triton: the position kernels
                                             else [both, both, content_only, position_only]))
    kwargs = dict(dim=draw(st.integers(1, 8 if not big else 12)), dim_out=dim_out, dim_k=draw(st.integers(1, 4)),
                  heads=heads, dim_u=dim_u, multihead=multihead, content=content, position=position,
                  causal=causal, spatial_dims=spatial_dims, key_norm=draw(st.sampled_from(("softmax", "l2", "none"))),
                  query_softmax=draw(st.booleans()), qv_norm=draw(st.sampled_from(("batch", "layer", "layer", None))))
    groups = heads if multihead else 1
    if kwargs["qv_norm"] == "layer" and min(heads * kwargs["dim_k"], groups * (dim_out // heads) * dim_u) < 2:
        # LayerNorm over a single channel outputs its bias: the gradients through it are rounding noise amplified
        # by 1 / sqrt(eps) ~ 316, beyond F64_TOL's O(1)-conditioning assumption (a valid but degenerate layer)
        kwargs["qv_norm"] = None
    scope = draw(st.sampled_from(("local", "global", "absolute") if not triton else ("local", "global")))
    if scope == "local":  # scopes larger than the map (cropped) included; causal scopes of any length
        r = draw(st.integers(1, 9)) if causal else 2 * draw(st.integers(0, 4)) + 1
        kwargs["r"] = r
    else:
        kwargs["r"] = None
        if scope == "global":  # the input may be smaller than the context
            kwargs["feat_size"] = tuple(s + draw(st.integers(0, 2)) for s in spatial)
        else:
            kwargs["feat_size"], kwargs["position_embedding"] = spatial, "absolute"
    # the pool after a stride-2 layer needs sides >= 2 for the 2x2 pool and, in 3-d, >= 3 for the padded 3x3x3
    # one: smaller inputs crash in torch (test_stride_2_lambda_layer_pools_small_3d_maps and
    # test_stride_pool_2_on_a_one_pixel_side_raises_value_error below)
    need = {2: 2, 3: 3 if spatial_dims == 3 else 1}
    pools = [p for p in (2, 3) if min(spatial) >= need[p]]
    if not causal and pools and draw(st.sampled_from((1, 2, 2))) == 2:
        kwargs["stride"] = 2
        kwargs["stride_pool"] = draw(st.sampled_from(pools))
    if position and not multihead and dim_u == 1 and draw(st.booleans()):
        kwargs["position_bias"] = True
    batch = draw(st.integers(1, 2))
    n = math.prod(spatial)
    # BatchNorm in training needs several positions; 4 keeps the batch variance away from degenerate
    training = kwargs["qv_norm"] == "batch" and batch * n >= 4 and draw(st.sampled_from((False, True, True)))
    if triton:
        kwargs["impl"] = "triton"
    return kwargs, (batch, kwargs["dim"], *spatial), training, draw(st.booleans()), draw(st.booleans())


def _layout(x, channels_last):
    """``x`` with its channels last in memory (a non-contiguous view of the same values) if asked."""
    if not channels_last:
        return x
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


def check_lambda_layer(config, impls, tol=F64_TOL, seed=0):
    kwargs, shape, training, channels_last, chunked = config
    torch.manual_seed(seed)
    kwargs = dict(kwargs)
    dim, dim_out = kwargs.pop("dim"), kwargs.pop("dim_out")
    layer = randomize_(LambdaLayer(dim, dim_out, **kwargs)).double().train(training)
    params = list(layer.parameters())
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    x = _layout(torch.randn(*shape, dtype=torch.float64), channels_last).requires_grad_()
    ref = lambda_reference(layer, x)
    assert ref.dtype == torch.float64
    g_out = torch.randn_like(ref)
    ref_grads = grads(ref, [x, *params], g_out)
    # chunked: E's rows rebuilt per query chunk (einsum_qe beyond max_whole_positions); auto follows the policy too
    with cpu_policy(ImplPolicy(max_whole_positions=1) if chunked else None):
        for impl in impls:
            layer.impl = impl
            label = f"impl={impl} (plan {layer.plan(shape[2:]).position})"
            y = layer(x)
            assert y.dtype == torch.float64
            assert_close_scaled(y, ref.detach(), f"{label} output", tol)
            assert_grads_close(grads(y, [x, *params], g_out), ref_grads, [f"{label} grad {n}" for n in names], tol)
            with torch.no_grad():  # inference: the embeddings are cached (eval) and the chunks not checkpointed
                assert_close_scaled(layer(x), ref.detach(), f"{label} no_grad output", tol)


@examples(150)
@given(config=lambda_configs(), seed=st.integers(0, 2 ** 16))
def test_lambda_layer_every_impl_equals_the_reference_in_float64(config, seed):
    check_lambda_layer(config, IMPLS, seed=seed)


@pytest.mark.slow
@examples(1000)
@given(config=lambda_configs(big=True), seed=st.integers(0, 2 ** 16))
def test_lambda_layer_every_impl_equals_the_reference_in_float64_large(config, seed):
    check_lambda_layer(config, IMPLS, seed=seed)


@pytest.mark.slow
@examples(50)
@given(config=lambda_configs(triton=True), seed=st.integers(0, 2 ** 16))
def test_lambda_layer_triton_equals_the_reference(config, seed):
    """``impl="triton"`` under Triton's interpreter (about a second per example on CPU, hence slow only)."""
    from lambdanet.ops.position_lambda import kernels_available

    if not kernels_available("cpu")[0] and not torch.cuda.is_available():
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    check_lambda_layer(config, ("triton",), tol=F32_KERNEL_TOL, seed=seed)


@examples(15)
@given(config=lambda_configs(), seed=st.integers(0, 2 ** 16))
def test_lambda_layer_reference_agrees_with_the_paper_shaped_functions(config, seed):
    """The reference above against lambdanet.functional's Fig. 3 / 7 / 8 functions (where they apply: softmax
    keys, no causal mask, no pool or bias): two independent transcriptions of the paper agree."""
    from lambdanet import functional as LF

    kwargs, shape, _, _, _ = config
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("stride", "stride_pool", "position_bias")}
    kwargs.update(key_norm="softmax", query_softmax=False, qv_norm=None, content=True, position=True,
                  causal=False)
    if kwargs["r"] is not None:
        kwargs["r"] |= 1  # a non-causal scope is odd
    if kwargs["multihead"]:
        kwargs["dim_u"] = 1  # Fig. 7 has no intra-depth
    layer = LambdaLayer(kwargs.pop("dim"), kwargs.pop("dim_out"), **kwargs).double()
    x = torch.randn(*shape, dtype=torch.float64)
    b, n = shape[0], math.prod(shape[2:])
    h, k, u, v, g = layer.heads, layer.dim_k, layer.dim_u, layer.dim_v, layer.groups
    tokens = x.reshape(b, layer.dim, n).transpose(1, 2)
    w = layer.qkv.weight
    q = (tokens @ w[: h * k].t()).view(b, n, h, k).transpose(1, 2)  # b h n k
    keys = (tokens @ w[h * k: h * k + layer.dim_keys_total].t()).view(b, n, g, k, u)
    vals = (tokens @ w[h * k + layer.dim_keys_total:].t()).view(b, n, g, v, u)
    emb = layer.embedding
    e = emb.embeddings(shape[2:]) if isinstance(emb, RelativePositionEmbedding) else emb.table  # g k u n m
    if g == 1:
        y = LF.lambda_layer(q, keys[:, :, 0], e[0].permute(2, 3, 0, 1), vals[:, :, 0])  # b n (h v)
    else:
        y = LF.multihead_lambda_layer(q, keys[..., 0].transpose(1, 2), e[:, :, 0].permute(0, 2, 3, 1),
                                      vals[..., 0].transpose(1, 2))
    y = y.transpose(1, 2).reshape(b, h * v, *shape[2:])
    assert_close_scaled(y, lambda_reference(layer, x), "paper functions vs reference")


# ---------------------------------------------------------------------------------------------------- (a) baselines
ATTENTION_LAYERS = ("relative_self_attention", "attention_augmented_conv", "local_self_attention",
                    "axial_self_attention", "halo_attention")


@st.composite
def registry_configs(draw, name=None, big=False):
    """``(name, dim, dim_out, stride, feat_size, kwargs, input shape)`` of a valid registry layer."""
    name = draw(st.sampled_from(BASELINES)) if name is None else name
    side = 7 if not big else 10
    hh, ww = draw(st.integers(1, side)), draw(st.integers(1, side))
    dim = draw(st.integers(1, 6))
    feat = None
    kwargs = {}
    if name in ("conv", "conv_se", "linear_attention", "double_attention"):
        stride = draw(st.integers(1, 3))
        dim_out = draw(st.integers(1, 8))
        if name == "conv":
            kwargs["kernel_size"] = draw(st.sampled_from((1, 3, 5)))
            groups = draw(st.sampled_from([gr for gr in range(1, 5) if dim % gr == 0 and dim_out % gr == 0]))
            kwargs["groups"] = groups
        elif name == "conv_se":
            kwargs["kernel_size"] = draw(st.sampled_from((1, 3)))
            kwargs["rd_ratio"] = draw(st.sampled_from((1 / 16, 0.25, 0.5, 1.0)))
        elif name == "linear_attention":
            heads = draw(st.integers(1, 3))
            kwargs.update(heads=heads, dim_k=heads * draw(st.integers(1, 3)), dim_v=heads * draw(st.integers(1, 3)))
        else:
            kwargs.update(c_m=draw(st.integers(1, 4)), c_n=draw(st.integers(1, 4)))
    else:
        stride = draw(st.integers(1, 2))
        heads = draw(st.integers(1, 3))
        dim_out = heads * draw(st.integers(1, 3))
        if name in ("relative_self_attention", "axial_self_attention", "attention_augmented_conv"):
            feat = (hh + draw(st.integers(0, 2)), ww + draw(st.integers(0, 2)))
        if name == "relative_self_attention":
            split = draw(st.sampled_from(("full", "half")))
            dim_qk = heads * draw(st.integers(2 if split == "half" else 1, 3))
            kwargs.update(heads=heads, dim_qk=dim_qk, rel_split=split)
        elif name == "axial_self_attention":
            kwargs.update(heads=heads)
        elif name == "attention_augmented_conv":
            # d_v = heads * max(1, round(v_ratio dim_out / heads)) must stay below dim_out
            dim_out = heads * draw(st.integers(2, 4))
            kwargs.update(heads=heads, k_ratio=draw(st.sampled_from((0.1, 0.5, 1.0))),
                          v_ratio=draw(st.sampled_from((0.1, 0.25, 0.4))),
                          rel_split=draw(st.sampled_from(("full", "half"))))
            dk = max(heads, round(kwargs["k_ratio"] * dim_out / heads) * heads)
            if kwargs["rel_split"] == "half" and dk // heads < 2:
                kwargs["rel_split"] = "full"
        elif name == "local_self_attention":
            kwargs.update(heads=heads, kernel_size=draw(st.sampled_from((1, 3, 5))),
                          block_size=draw(st.integers(1, 4)), dim_qk=heads * draw(st.integers(2, 3)))
        else:  # halo_attention
            block = draw(st.integers(1, 4))
            halo = draw(st.integers(0, 2))
            downsample = draw(st.sampled_from(("subsample", "pool")))
            if downsample == "subsample" and block % stride:
                block = 2 * block  # the subsampled queries of a block: stride must divide block_size
            kwargs.update(heads=heads, block_size=block, halo_size=halo, dim_qk=heads * draw(st.integers(2, 3)),
                          pixel_centered=draw(st.booleans()), downsample=downsample,
                          rel_split=draw(st.sampled_from(("half", "full"))),
                          rel_geometry=draw(st.sampled_from(("pixel", "window"))),
                          mask_padding=draw(st.booleans()))
    batch = draw(st.integers(1, 2))
    return name, dim, dim_out, stride, feat, kwargs, (batch, dim, hh, ww)


def check_against_reference(layer, shape, impls=(None,), tol=F64_TOL):
    layer = layer.double()
    params = list(layer.parameters())
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    ref = reference_spatial_layer(layer, x)
    g_out = torch.randn_like(ref)
    ref_grads = grads(ref, [x, *params], g_out)
    for impl in impls:
        with use_attention_impl(impl) if impl else contextlib.nullcontext():
            y = layer(x)
            label = f"{type(layer).__name__} attention={impl}"
            assert y.dtype == torch.float64
            assert_close_scaled(y, ref.detach(), f"{label} output", tol)
            assert_grads_close(grads(y, [x, *params], g_out), ref_grads, [f"{label} grad {n}" for n in names], tol)


def check_registry_layer(config, seed):
    name, dim, dim_out, stride, feat, kwargs, shape = config
    torch.manual_seed(seed)
    layer = create_spatial_layer(name, dim, dim_out, stride=stride, feat_size=feat, **kwargs)
    hh, ww = shape[2:]
    impls = ("math", "sdpa") if name in ATTENTION_LAYERS else (None,)
    check_against_reference(layer, shape, impls)
    # the registry contract: [B, dim, H, W] -> [B, dim_out, ceil(H / stride), ceil(W / stride)]
    assert layer(torch.randn(*shape, dtype=torch.float64)).shape == (shape[0], dim_out, -(-hh // stride),
                                                                     -(-ww // stride))


BASELINES = [name for name in list_spatial_layers() if name not in ("lambda", "lambda_conv")]  # LambdaLayer: above


@pytest.mark.parametrize("name", BASELINES)
@examples(25)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_every_registry_layer_equals_its_reference_in_float64(name, data, seed):
    check_registry_layer(data.draw(registry_configs(name)), seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", BASELINES)
@examples(120)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_every_registry_layer_equals_its_reference_in_float64_large(name, data, seed):
    check_registry_layer(data.draw(registry_configs(name, big=True)), seed)


@examples(15)
@given(spatial=st.lists(st.integers(1, 5), min_size=1, max_size=3), channels=st.integers(1, 12),
       se=st.booleans(), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_channel_gates_equal_their_reference_in_1d_2d_3d(spatial, channels, se, data, seed):
    torch.manual_seed(seed)
    if se:
        layer = SqueezeExcite(channels, rd_ratio=data.draw(st.sampled_from((1 / 16, 0.25, 1.0))))
    else:
        layer = EfficientChannelAttention(channels, kernel_size=data.draw(st.sampled_from((None, 1, 3, 5))))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()  # ECA's kernel and SE's biases away from their init
    check_against_reference(layer, (data.draw(st.integers(1, 2)), channels, *spatial))


# ---------------------------------------------------------------------------------------------------- equivariance
@st.composite
def equivariance_cases(draw):
    """A local layer of receptive radius ``rho`` and two crops of one image, offset by ``shift``."""
    kind = draw(st.sampled_from(("lambda", "sasa", "halo")))
    heads = draw(st.integers(1, 2))
    dim_out = heads * 2
    if kind == "lambda":
        r = 2 * draw(st.integers(0, 2)) + 1
        spatial_dims = draw(st.integers(1, 3))
        # content=False: the content lambda is a global summary of the crop, not a local function
        layer = LambdaLayer(3, dim_out, dim_k=2, heads=heads, r=r, content=False, spatial_dims=spatial_dims,
                            dim_u=draw(st.integers(1, 2)), impl=draw(st.sampled_from(IMPLS)))
        rho = r // 2
    elif kind == "sasa":
        ksize = 2 * draw(st.integers(0, 2)) + 1
        layer = LocalSelfAttention(3, dim_out, kernel_size=ksize, heads=heads, block_size=draw(st.integers(1, 4)))
        spatial_dims, rho = 2, ksize // 2
    else:
        halo = draw(st.integers(0, 2))
        layer = HaloAttention(3, dim_out, block_size=draw(st.integers(1, 4)), halo_size=halo, heads=heads,
                              pixel_centered=True)
        spatial_dims, rho = 2, halo
    shift = tuple(draw(st.integers(0, 2)) for _ in range(spatial_dims))
    # at least one position whose receptive field lies inside both crops
    size = tuple(draw(st.integers(2 * rho + 1 + t, 2 * rho + 4 + t)) for t in shift)
    return kind, layer, rho, size, shift


@examples(20)
@given(case=equivariance_cases(), seed=st.integers(0, 2 ** 16))
def test_local_layers_are_translation_equivariant_away_from_the_border(case, seed):
    """Crops ``x1 = X[p:p+s]`` and ``x2 = X[p+t:p+t+s]`` of one image: ``f(x1)[i + t] = f(x2)[i]`` wherever both
    receptive fields (radius rho) lie inside their crops. Holds exactly in arithmetic; the two sides sum the same
    terms in different blocks and orders, so they differ by float64 rounding (two computations: 2 F64_TOL)."""
    kind, layer, rho, size, shift = case
    torch.manual_seed(seed)
    layer = randomize_(layer).double().eval()
    big = torch.randn(1, 3, *(s + t for s, t in zip(size, shift)), dtype=torch.float64)
    x1 = big[(slice(None), slice(None)) + tuple(slice(0, s) for s in size)]
    x2 = big[(slice(None), slice(None)) + tuple(slice(t, t + s) for s, t in zip(size, shift))]
    y1, y2 = layer(x1), layer(x2)
    # positions i of y2 with i - rho >= 0 and i + t + rho < s (then y1's position i + t is interior too)
    sl1 = tuple(slice(rho + t, s - rho) for s, t in zip(size, shift))
    sl2 = tuple(slice(rho, s - rho - t) for s, t in zip(size, shift))
    a, b = y1[(slice(None), slice(None)) + sl1], y2[(slice(None), slice(None)) + sl2]
    assert a.shape == b.shape and a.numel() > 0
    assert_close_scaled(a, b, f"{kind} shifted by {shift}", tol=2 * F64_TOL, scale=y2.abs().max().item())


# ---------------------------------------------------------------------------------------------------- (b) errors
NOT_INT = st.sampled_from([2.5, "3", True, (2,)])  # floats, strings, bools (no int here), sequences
NOT_POSITIVE = st.integers(-3, 0)
BAD_COUNT = st.one_of(NOT_POSITIVE, NOT_INT)
BAD_NAME = st.sampled_from(["", "bogus", "Softmax", 3, None])


def one(arg, values, *needles):
    """Mutation: ``arg`` set to one of ``values``; the message must name ``arg`` and the other needles."""
    return values.map(lambda v: ({arg: v}, (arg, *needles)))


def combo(updates, *needles):
    """Mutation: several arguments at once (each update valid alone, invalid together)."""
    return st.just((updates, needles))


LAMBDA_BASE = dict(dim=6, dim_out=4, dim_k=2, heads=2, r=3)
LAMBDA_MUTATIONS = [
    one("dim", st.one_of(BAD_COUNT, st.none())),
    one("dim_out", BAD_COUNT),
    one("dim_k", st.one_of(BAD_COUNT, st.none())),
    one("heads", st.one_of(BAD_COUNT, st.none())),
    one("heads", st.sampled_from([3, 5, 6, 8]), "dim_out"),  # does not divide dim_out=4
    one("dim_u", st.one_of(BAD_COUNT, st.none())),
    one("r", st.one_of(st.integers(1, 5).map(lambda i: 2 * i), NOT_POSITIVE, NOT_INT)),  # even: not centred
    one("stride", st.sampled_from([0, 3, 4, -1, 2.0, True, "2", None])),
    one("stride_pool", st.sampled_from([0, 1, 4, 3.0, True, None])),
    one("spatial_dims", st.sampled_from([0, 4, -1, 2.0, True, "2"])),
    one("key_norm", BAD_NAME),
    one("qv_norm", BAD_NAME.filter(lambda v: v is not None)),
    one("impl", BAD_NAME),
    one("position_embedding", BAD_NAME),
    one("embedding", st.sampled_from(["relative", 3, torch.zeros(3)])),
    combo(dict(causal=True, spatial_dims=2), "causal", "spatial_dims"),
    combo(dict(causal=True, spatial_dims=3), "causal", "spatial_dims"),
    combo(dict(causal=True, stride=2), "causal", "stride"),
    combo(dict(r=None), "feat_size"),
    st.sampled_from([(2,), (4, 4, 4), (0, 4), (4, -1), (4.5, 4), (4, True), "44", 2.5]).map(
        lambda f: (dict(r=None, feat_size=f, spatial_dims=2), ("feat_size",))),
    combo(dict(content=False, position=False), "content", "position"),
    combo(dict(position_embedding="absolute", feat_size=4), "position_embedding"),  # r=3: absolute is global
    combo(dict(position_embedding="absolute", r=None), "position_embedding", "feat_size"),
    combo(dict(impl="triton", multihead=True), "impl", "multihead"),
    combo(dict(impl="triton", spatial_dims=3), "impl", "spatial_dims"),
    combo(dict(impl="triton", r=None, feat_size=4, position_embedding="absolute"), "impl", "position_embedding"),
    combo(dict(position_bias=True, multihead=True), "position_bias"),
    combo(dict(position_bias=True, dim_u=2), "position_bias"),
    combo(dict(position_bias=True, position=False), "position_bias"),
    st.sampled_from([(dict(embedding=RelativePositionEmbedding.local(2, 5)), ("r",)),
                     (dict(embedding=RelativePositionEmbedding.local(3, 3)), ("dim_k",)),
                     (dict(embedding=RelativePositionEmbedding.local(2, 3, spatial_dims=1), spatial_dims=2),
                      ("spatial_dims",)),
                     (dict(embedding=RelativePositionEmbedding.local(2, 3, dim_u=2)), ("dim_u",)),
                     (dict(embedding=RelativePositionEmbedding.global_context(2, 4)), ("r",)),  # global, r=3
                     ]),
]


def _word(needle):
    import re

    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(needle)}(?![A-Za-z0-9_])")


def assert_one_line_value_error_naming(build, needles):
    with pytest.raises(Exception) as excinfo:
        build()
    msg = str(excinfo.value)
    assert excinfo.type is ValueError, f"{excinfo.type.__name__} instead of ValueError: {msg}"
    assert "\n" not in msg, f"multi-line message: {msg!r}"
    for needle in needles:
        assert _word(needle).search(msg), f"the message does not name {needle!r}: {msg!r}"


@pytest.mark.parametrize("index", range(len(LAMBDA_MUTATIONS)))  # every kind of mistake, a few values each
@examples(6)
@given(data=st.data())
def test_invalid_lambda_layer_arguments_raise_a_one_line_value_error_naming_them(index, data):
    updates, needles = data.draw(LAMBDA_MUTATIONS[index])
    kwargs = dict(LAMBDA_BASE, **updates)
    assert_one_line_value_error_naming(lambda: LambdaLayer(**kwargs), needles)


REGISTRY_BASE = {
    "conv": dict(dim=4, dim_out=4),
    "conv_se": dict(dim=4, dim_out=4),
    "linear_attention": dict(dim=4, dim_out=8, heads=2),
    "double_attention": dict(dim=4, dim_out=8),
    "relative_self_attention": dict(dim=4, dim_out=4, heads=2, feat_size=4),
    "attention_augmented_conv": dict(dim=4, dim_out=16, heads=2, feat_size=4),
    "local_self_attention": dict(dim=4, dim_out=4, heads=2),
    "axial_self_attention": dict(dim=4, dim_out=4, heads=2, feat_size=4),
    "halo_attention": dict(dim=4, dim_out=4, heads=2, block_size=4, halo_size=1),
    "lambda": dict(dim=4, dim_out=4, heads=2, feat_size=4),
    "lambda_conv": dict(dim=4, dim_out=4, heads=2, r=3),
}
BAD_STRIDE_12 = st.sampled_from([0, 3, -1, 2.0, True, "2", None])
BAD_FEAT_VALUES = st.sampled_from([0, -2, (4, 0), 2.5, (4.5, 4), "4", True])
BAD_FEAT = st.one_of(BAD_FEAT_VALUES, st.sampled_from([(4, 4, 4), (4,)]))  # 2-d layers (LambdaLayer: any length)
COMMON_MUTATIONS = [one("dim", BAD_COUNT), one("dim_out", BAD_COUNT), one("bogus_argument", st.just(1))]
REGISTRY_MUTATIONS = {
    "conv": [one("stride", st.sampled_from([0, -1, 2.0, True, "2", None])),
             one("kernel_size", st.sampled_from([2, 4, 0, -1, 3.0, True])),
             one("groups", st.sampled_from([0, 3, 2.5, True]))],
    "conv_se": [one("rd_ratio", st.sampled_from([0, -0.5, 1.5, "a", float("nan"), float("inf"), True])),
                one("kernel_size", st.sampled_from([2, 0]))],
    "linear_attention": [one("heads", st.one_of(BAD_COUNT, st.just(3))), one("dim_k", BAD_COUNT),
                         one("dim_v", BAD_COUNT), one("stride", st.sampled_from([0, -2, 1.5]))],
    "double_attention": [one("c_m", BAD_COUNT), one("c_n", BAD_COUNT)],
    "relative_self_attention": [one("heads", st.one_of(BAD_COUNT, st.just(3))), one("dim_qk", BAD_COUNT),
                                one("rel_split", BAD_NAME), one("stride", BAD_STRIDE_12),
                                one("feat_size", BAD_FEAT), combo(dict(feat_size=None), "feat_size"),
                                combo(dict(rel_split="half", dim_qk=2), "rel_split")],
    "attention_augmented_conv": [one("heads", BAD_COUNT), one("stride", BAD_STRIDE_12),
                                 one("k_ratio", st.sampled_from([0, -1, "a", float("inf"), float("nan"), None])),
                                 one("v_ratio", st.sampled_from([0, 1, 1.5, -0.1, "a", float("nan")])),
                                 one("rel_split", BAD_NAME), one("feat_size", BAD_FEAT),
                                 combo(dict(dim_out=2), "dim_out")],
    "local_self_attention": [one("kernel_size", st.sampled_from([2, 0, 4, -1, 3.0, True])),
                             one("block_size", BAD_COUNT), one("stride", BAD_STRIDE_12),
                             one("heads", st.one_of(BAD_COUNT, st.just(3))),
                             combo(dict(heads=4), "heads", "dim_qk")],  # 1 query/key channel per head
    "axial_self_attention": [one("heads", st.one_of(BAD_COUNT, st.just(3))), one("stride", BAD_STRIDE_12),
                             one("feat_size", BAD_FEAT), combo(dict(feat_size=None), "feat_size")],
    "halo_attention": [one("block_size", BAD_COUNT), one("halo_size", st.sampled_from([-1, 1.5, True, "1", None])),
                       one("stride", st.sampled_from([0, 3, -1, 2.0, True])),  # 3 does not divide block_size
                       one("downsample", BAD_NAME), one("rel_geometry", BAD_NAME), one("rel_split", BAD_NAME),
                       one("dim_qk", BAD_COUNT), one("heads", st.one_of(BAD_COUNT, st.just(3)))],
    "lambda": [combo(dict(feat_size=None), "feat_size"), one("feat_size", BAD_FEAT_VALUES),
               one("stride", BAD_STRIDE_12), one("heads", st.just(3), "dim_out")],
    "lambda_conv": [one("r", st.sampled_from([2, 0, -1, 3.0, True])), one("stride", BAD_STRIDE_12),
                    combo(dict(r=None), "feat_size")],
}


def test_every_registry_layer_has_a_base_configuration_for_the_error_properties():
    assert set(REGISTRY_BASE) == set(list_spatial_layers())


REGISTRY_CASES = [(name, i) for name in sorted(REGISTRY_BASE)
                  for i in range(len(COMMON_MUTATIONS) + len(REGISTRY_MUTATIONS[name]))]


@pytest.mark.parametrize("name,index", REGISTRY_CASES)  # every layer, every kind of mistake, a few values each
@examples(6)
@given(data=st.data())
def test_invalid_registry_layer_arguments_raise_a_one_line_value_error_naming_them(name, index, data):
    updates, needles = data.draw((COMMON_MUTATIONS + REGISTRY_MUTATIONS[name])[index])
    kwargs = dict(REGISTRY_BASE[name], **updates)
    dim, dim_out = kwargs.pop("dim"), kwargs.pop("dim_out")
    assert_one_line_value_error_naming(lambda: create_spatial_layer(name, dim, dim_out, **kwargs), needles)


@examples(20)
@given(case=st.one_of(
    st.tuples(st.just("se_channels"), BAD_COUNT), st.tuples(st.just("se_rd_channels"), BAD_COUNT),
    st.tuples(st.just("rd_ratio"), st.sampled_from([0, -1, 1.01, "a", float("nan"), True])),
    st.tuples(st.just("eca_channels"), BAD_COUNT),
    st.tuples(st.just("kernel_size"), st.sampled_from([0, 2, 4, -3, 3.0, True]))))
def test_invalid_channel_gate_arguments_raise_a_one_line_value_error_naming_them(case):
    kind, value = case
    builds = {"se_channels": (lambda: SqueezeExcite(value), "channels"),
              "se_rd_channels": (lambda: SqueezeExcite(8, rd_channels=value), "rd_channels"),
              "rd_ratio": (lambda: SqueezeExcite(8, rd_ratio=value), "rd_ratio"),
              "eca_channels": (lambda: EfficientChannelAttention(value), "channels"),
              "kernel_size": (lambda: EfficientChannelAttention(8, kernel_size=value), "kernel_size")}
    build, needle = builds[kind]
    assert_one_line_value_error_naming(build, (needle,))


@st.composite
def bad_inputs(draw, spatial_dims, dim, feat_size=None, absolute=False, any_spatial_dims=False):
    """An input the layer must refuse, and what the message must name. ``any_spatial_dims``: the layer takes
    1-3 spatial dims (the channel gates), its channel argument is ``channels``."""
    kind = draw(st.sampled_from(["rank", "channels", "dtype", "other_float", "empty", "not_a_tensor"]
                                + (["too_large"] if feat_size else []) + (["other_size"] if absolute else [])))
    spatial = list(feat_size) if feat_size else [draw(st.integers(1, 5)) for _ in range(spatial_dims)]
    if kind == "rank":
        valid = (3, 4, 5) if any_spatial_dims else (spatial_dims + 2,)
        rank = draw(st.integers(0, 7).filter(lambda r: r not in valid))
        shape = (2, dim, 3, 4, 5, 3, 2)[:rank]
        needles = ["spatial_dims 1, 2 or 3" if any_spatial_dims else f"spatial_dims={spatial_dims}"]
        return torch.randn(shape), needles + ([f"spatial_dims={rank - 2}"] if 1 <= rank - 2 <= 3 else [])
    if kind == "channels":
        c = draw(st.integers(1, 12).filter(lambda c: c != dim))
        return torch.randn(1, c, *spatial), [f"{'channels' if any_spatial_dims else 'dim'}={dim}", f"{c} channels"]
    if kind == "dtype":
        dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64]))
        return torch.ones(1, dim, *spatial, dtype=dtype), ["floating-point", str(dtype)]
    if kind == "other_float":  # float64 into a float32 layer outside autocast: torch's "expected scalar type" before
        return torch.randn(1, dim, *spatial, dtype=torch.float64), ["parameters are float32", "input is float64"]
    if kind == "empty":
        spatial[draw(st.integers(0, spatial_dims - 1))] = 0
        return torch.randn(1, dim, *spatial), ["spatial size"]
    if kind == "not_a_tensor":
        return draw(st.sampled_from([[1.0, 2.0], None, 3.0])), ["tensor"]
    if kind == "too_large":
        spatial[draw(st.integers(0, spatial_dims - 1))] += draw(st.integers(1, 2))
        return torch.randn(1, dim, *spatial), ["feat_size"]
    spatial[draw(st.integers(0, spatial_dims - 1))] -= 1  # other_size (sides >= 2): absolute embeddings need
    return torch.randn(1, dim, *spatial), ["feat_size"]  # feat_size exactly


@examples(60)
@given(data=st.data(), spatial_dims=st.integers(1, 3), scope=st.sampled_from(["local", "global", "absolute"]))
def test_invalid_lambda_layer_inputs_raise_a_one_line_value_error_naming_the_problem(data, spatial_dims, scope):
    """Wrong rank (the message names the layer's spatial_dims and the input's), channels, dtype, an empty axis,
    no tensor, larger than a global layer's feat_size, other than an absolute layer's feat_size."""
    feat = tuple(data.draw(st.integers(2, 4)) for _ in range(spatial_dims)) if scope != "local" else None
    kwargs = dict(r=3) if scope == "local" else dict(r=None, feat_size=feat)
    if scope == "absolute":
        kwargs["position_embedding"] = "absolute"
    layer = LambdaLayer(4, dim_k=2, heads=2, spatial_dims=spatial_dims, **kwargs).eval()
    x, needles = data.draw(bad_inputs(spatial_dims, 4, feat, scope == "absolute"))
    assert_one_line_value_error_naming(lambda: layer(x), needles)


@examples(60)
@given(data=st.data(), name=st.sampled_from(list_spatial_layers() + ["squeeze_excite", "eca"]))
def test_invalid_spatial_layer_inputs_raise_a_one_line_value_error_naming_the_problem(data, name):
    if name in ("squeeze_excite", "eca"):  # any of 1-3 spatial dims
        layer = SqueezeExcite(4) if name == "squeeze_excite" else EfficientChannelAttention(4)
        x, needles = data.draw(bad_inputs(data.draw(st.integers(1, 3)), 4, any_spatial_dims=True))
    else:
        kwargs = {k: v for k, v in REGISTRY_BASE[name].items() if k not in ("dim", "dim_out")}
        layer = create_spatial_layer(name, 4, 8, **kwargs)
        feat = (4, 4) if "feat_size" in kwargs else None
        x, needles = data.draw(bad_inputs(2, 4, feat))
    assert_one_line_value_error_naming(lambda: layer(x), needles)


def test_a_5d_input_to_a_2d_lambda_layer_names_spatial_dims_3():
    """The issue's example: the message says which spatial_dims the input has (3), i.e. how to build a layer
    that takes it, besides the rank the layer expects."""
    layer = LambdaLayer(8, dim_k=2, heads=2, r=3)
    with pytest.raises(ValueError) as excinfo:
        layer(torch.randn(1, 8, 3, 4, 5))
    msg = str(excinfo.value)
    assert "spatial_dims=3" in msg and "spatial_dims=2" in msg and "rank 4" in msg and "\n" not in msg
    assert LambdaLayer(8, dim_k=2, heads=2, r=3, spatial_dims=3)(torch.randn(1, 8, 3, 4, 5)).shape == (1, 8, 3, 4, 5)


# ---------------------------------------------------------------------------------------------------- known bugs
# Found by the properties above; their fix lies outside this suite's files (LambdaLayer._output and forward,
# EfficientAttention.forward). Strict: each turns into a failure once fixed, so the marker is removed then.
@pytest.mark.parametrize("spatial", [(1, 3, 3), (2, 2, 2), (3, 3, 2)])
def test_stride_2_lambda_layer_pools_small_3d_maps(spatial):
    """The padded 3x3x3 pool of a stride-2 layer is defined for any side (1-d and 2-d layers pool 1-pixel
    sides); 3-d inputs with a side below 3 used to raise a RuntimeError inside torch (avg_pool3d)."""
    layer = LambdaLayer(4, dim_k=2, heads=2, r=3, spatial_dims=3, stride=2).double().eval()
    x = torch.randn(1, 4, *spatial, dtype=torch.float64)
    assert_close_scaled(layer(x), lambda_reference(layer, x), "stride-2 3-d")


@pytest.mark.parametrize("spatial_dims", [1, 2, 3])
def test_stride_pool_2_on_a_one_pixel_side_raises_value_error(spatial_dims):
    layer = LambdaLayer(4, dim_k=2, heads=2, r=3, spatial_dims=spatial_dims, stride=2, stride_pool=2)
    with pytest.raises(ValueError, match="stride_pool"):
        layer(torch.randn(2, 4, *([4] * (spatial_dims - 1)), 1))


@pytest.mark.parametrize("name", ["lambda_conv", "linear_attention"])
def test_an_empty_batch_gives_an_empty_output(name):
    """Every other spatial layer maps a batch of 0 to an empty output of the right shape."""
    layer = create_spatial_layer(name, 4, 8, heads=2).eval()
    assert layer(torch.randn(0, 4, 5, 5)).shape == (0, 8, 5, 5)
