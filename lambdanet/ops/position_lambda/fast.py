"""The N-d fast path of :class:`lambdanet.layers.LambdaLayer`, described with its symbols and layouts in
:mod:`lambdanet.functional`; position lambdas may also be fused with the queries (``*_qe``). The readable
reference path beside it: :mod:`lambdanet.functional.reference`."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lambdanet.functional.content import (  # re-exported: the fast path's content part
    KEY_NORMS,
    apply_content_lambda,
    causal_content_lambdas,
    content_lambda,
    normalize_keys,
)
from lambdanet.helpers import autocast_active, bind_shapes, check_choice, conv_nd, leave_autocast, no_autocast
from lambdanet.helpers import functorch_active

__all__ = [
    "POSITION_IMPLS",
    "KEY_NORMS",
    "crop_relative_kernel",
    "cropped_kernel_size",
    "gather_relative_embeddings",
    "position_lambdas",
    "einsum_position_lambdas",
    "normalize_keys",
    "content_lambda",
    "causal_content_lambdas",
    "apply_lambdas",
    "apply_content_lambda",
    "permute_copy",
    "position_output_qe",
    "relative_position_output_qe",
    "POSITION_OUTPUT_IMPLS",
    "token_position_lambdas",
]

POSITION_IMPLS = ("conv", "depthwise_conv", "einsum")
POSITION_OUTPUT_IMPLS = POSITION_IMPLS + ("einsum_qe",)


def crop_relative_kernel(
    kernel: Tensor, center: Sequence[int], spatial: Sequence[int]
) -> tuple[Tensor, tuple[int, ...]]:
    """Drop the kernel taps that can never reach a position of an input of size ``spatial``.

    ``kernel`` is ``[g, k, u, *K]`` with entry ``center[a]`` of axis ``a`` being relative offset 0. On an
    axis of size ``s`` offsets lie in ``[-(s - 1), s - 1]``, so at most ``2 s - 1`` taps matter: a 23x23
    scope on a 7x7 map is a 13x13 one. Also used to crop a global relative table for inputs smaller
    than ``feat_size``. Returns the (view of the) cropped kernel and its new centre.
    """
    axes = kernel.dim() - 3
    if any(s < 1 for s in spatial):
        raise ValueError(f"spatial must be positive sizes, got {tuple(spatial)}")
    if (
        len(center) != axes
        or len(spatial) != axes
        or any(not 0 <= c < kernel.shape[3 + a] for a, c in enumerate(center))
    ):
        raise ValueError(
            f"center must give one tap of each of the kernel's {axes} spatial axes (sizes "
            f"{tuple(kernel.shape[3:])}) for a {len(spatial)}-d input, got center={tuple(center)}"
        )
    new_center = []
    for a, (c, s) in enumerate(zip(center, spatial)):
        size = kernel.shape[3 + a]
        lo, hi = _reachable_taps(c, size, s)
        if lo > 0 or hi < size - 1:
            kernel = kernel.narrow(3 + a, lo, hi - lo + 1)
        new_center.append(c - lo)
    return kernel, tuple(new_center)


def _reachable_taps(center: int, size: int, s: int) -> tuple[int, int]:
    """First and last tap of a ``size``-tap kernel axis (offset 0 at ``center``) that reach an ``s``-long axis."""
    return max(0, center - (s - 1)), min(size - 1, center + (s - 1))


def cropped_kernel_size(kernel_size: Sequence[int], center: Sequence[int], spatial: Sequence[int]) -> tuple[int, ...]:
    """The shape ``*K`` that :func:`crop_relative_kernel` leaves, from sizes alone (no tensor touched)."""
    return tuple(
        hi - lo + 1 for lo, hi in (_reachable_taps(c, size, s) for c, size, s in zip(center, kernel_size, spatial))
    )


def gather_relative_embeddings(
    kernel: Tensor, center: Sequence[int], spatial: Sequence[int], rows: tuple[int, int] | None = None
) -> Tensor:
    """Re-index a relative kernel ``R[g, k, u, *K]`` into ``E[g, k, u, n, m]`` (paper Sec. 3.3).

    ``E[n, m] = R[m - n + center]`` where that index lies inside the kernel and 0 elsewhere, per axis, so
    the einsum form of the position lambdas equals the lambda convolution with the same kernel
    (App. E.1: "masking the position embeddings outside of the local contexts"). Memory: ``g k u n m``.

    ``E`` is Toeplitz in every axis: after zero-padding ``R`` to cover every offset, the row of query ``i`` is the
    window of ``R`` starting at ``center - i``. So ``E`` is built from ``unfold`` windows and one flip (a single
    strided copy), and its backward is ``unfold``'s native accumulation rather than an indexed scatter-add.

    ``rows=(start, stop)`` builds only the queries whose first spatial coordinate lies in
    ``[start, stop)``: ``E[g, k, u, (stop - start) * prod(spatial[1:]), m]``, the rows of a query chunk.
    """
    dims = len(spatial)
    pad: list[int] = []
    centers = []
    for a in range(dims):
        s, c, size = spatial[a], center[a], kernel.shape[3 + a]
        lo, hi = max(0, s - 1 - c), max(0, c + s - 1 - (size - 1))
        pad = [lo, hi] + pad  # F.pad lists the last axis first
        centers.append(c + lo)
    windows = F.pad(kernel, pad)  # every offset -(s-1)..(s-1) present, zeros outside the kernel
    n = m = math.prod(spatial)
    for a in range(dims):
        s = spatial[a]
        first, count = centers[a] - s + 1, s  # the windows (queries, reversed) this axis needs
        if a == 0 and rows is not None:  # query i is window first + s - 1 - i
            first, count = first + s - rows[1], rows[1] - rows[0]
            n = count * m // s
        if first != 0 or windows.shape[3 + a] != count + s - 1:  # slice R, not E: backward zero-fills R only
            windows = windows.narrow(3 + a, first, count + s - 1)
        windows = windows.unfold(3 + a, s, 1)  # g k u *W *S(m): window w holds R[w + m]
    emb = windows.flip(tuple(range(3, 3 + dims)))  # (a copy) window index -> query index n = center - w
    return emb.reshape(*kernel.shape[:3], n, m)  # g k u n m


def _lambda_conv(x: Tensor, weight: Tensor, center: Sequence[int], groups: int) -> Tensor:
    """The n-d convolution, zero-padded to keep the size: the conv's own padding if every kernel is centred,
    else an explicit ``F.pad``."""
    ksize = weight.shape[2:]
    conv = conv_nd(len(ksize))
    if all(c == ks // 2 and ks % 2 == 1 for c, ks in zip(center, ksize)):
        return conv(x, weight, padding=list(center), groups=groups)
    pad: list[int] = []
    for c, ks in zip(reversed(center), reversed(ksize)):  # F.pad lists the last axis first
        pad += [c, ks - 1 - c]
    return conv(F.pad(x, pad), weight, groups=groups)


def einsum_position_lambdas(values: Tensor, embeddings: Tensor) -> Tensor:
    """Position lambdas from explicit embeddings: ``lambda^p_n = sum_{m,u} E[n, m] V[m]``.

    Args:
        values: ``[b, g, v, u, m]``.
        embeddings: ``[g, k, u, n, m]``.

    Returns:
        ``[b, g, v, k, n]``. For ``g = u = 1`` one GEMM ``[(b v), m] @ [m, (k n)]`` (shared by the batch).
    """
    b, g, v, u, m = values.shape
    k, n = embeddings.shape[1], embeddings.shape[3]
    if g == 1 and u == 1:
        lam = values.reshape(b * v, m) @ embeddings.reshape(k * n, m).t()  # (b v) (k n)
        return lam.view(b, 1, v, k, n)  # b g v k n
    return torch.einsum("gkunm,bgvum->bgvkn", embeddings, values)  # b g v k n


def position_lambdas(values: Tensor, kernel: Tensor, center: Sequence[int], impl: str) -> Tensor:
    """Position lambdas of an n-d input through the lambda convolution (paper Sec. 3.4, App. B.1).

    ``lambda^p[b, g, v, k, x] = sum_{o, u} R[g, k, u, center + o] V[b, g, v, u, x + o]`` with zero padding,
    i.e. the einsum form with ``E`` masked outside the scope. ``center`` need not be the middle tap:
    causal layers use ``center = K - 1`` (offsets ``<= 0`` only).

    Args:
        values: ``[b, g, v, u, *S]`` with 1, 2 or 3 spatial dims ``S``.
        kernel: ``[g, k, u, *K]`` relative embeddings ``R``.
        center: per axis, the kernel index of relative offset 0.
        impl: ``"conv"``: the (n+1)-d convolution that treats ``v`` as an extra spatial axis with unit
            kernel extent, computed as an n-d convolution over the batch-folded ``(b v)`` axis (the same
            operator; it avoids Conv3d, which is slow and breaks channels_last, and exists for 3-d
            inputs where PyTorch has no 4-d convolution). ``"depthwise_conv"``: an n-d depthwise
            convolution (``groups = g v``) with channel multiplier ``k``. ``"einsum"``: gather
            ``E[n, m]`` from ``R`` and contract, ``Theta(k n m)`` extra memory, GEMM-shaped.

    Returns:
        ``[b, g, v, k, *S]``.
    """
    check_choice(impl, "impl", POSITION_IMPLS)
    if values.dim() != kernel.dim() + 1 or values.shape[1] != kernel.shape[0] or values.shape[3] != kernel.shape[2]:
        raise ValueError(
            f"values [b, g, v, u, *S] and kernel [g, k, u, *K] must agree on g, u and the spatial rank, got shapes "
            f"{tuple(values.shape)} and {tuple(kernel.shape)}"
        )
    b, g, v, u = values.shape[:4]
    spatial = tuple(values.shape[4:])
    kernel, center = crop_relative_kernel(kernel, center, spatial)
    k = kernel.shape[1]
    ksize = tuple(kernel.shape[3:])
    if impl == "einsum":
        emb = gather_relative_embeddings(kernel, center, spatial)  # g k u n m
        lam = einsum_position_lambdas(values.reshape(b, g, v, u, emb.shape[-2]), emb)  # b g v k n
        return lam.view(b, g, v, k, *spatial)
    if impl == "depthwise_conv":
        x = values.reshape(b, g * v * u, *spatial)  # b (g v u) *S
        weight = kernel.unsqueeze(1).expand(g, v, k, u, *ksize).reshape(g * v * k, u, *ksize)  # (g v k) u *K
        return _lambda_conv(x, weight, center, g * v).view(b, g, v, k, *spatial)  # b g v k *S
    x = values.transpose(1, 2).reshape(b * v, g * u, *spatial)  # "conv", v folded into the batch: (b v) (g u) *S
    out = _lambda_conv(x, kernel.reshape(g * k, u, *ksize), center, g)  # (b v) (g k) *S
    return out.view(b, v, g, k, *spatial).transpose(1, 2)  # b g v k *S


def token_position_lambdas(values: Tensor, kernel: Tensor, center: Sequence[int], spatial: Sequence[int]) -> Tensor:
    """The depthwise lambda convolution on channels-last tokens: ``[b, n, (g v u)] -> [b, n, g, v, k]``.

    The value tokens are already a channels-last image and a channels-last depthwise convolution writes its
    output channels-last, i.e. the position lambdas arrive in token layout: no layout copies either way.
    """
    b, n, c = values.shape
    g, k, u = kernel.shape[:3]
    v = c // (g * u)
    kernel, center = crop_relative_kernel(kernel, center, spatial)
    ksize = tuple(kernel.shape[3:])
    x = values.view(b, *spatial, c).movedim(-1, 1)  # b (g v u) *S with channels-last strides
    weight = kernel.unsqueeze(1).expand(g, v, k, u, *ksize).reshape(g * v * k, u, *ksize)  # (g v k) u *K
    return _lambda_conv(x, weight, center, g * v).movedim(1, -1).reshape(b, n, g, v, k)  # b n g v k


class _PermuteCopy(torch.autograd.Function):
    """``x.permute(dims).contiguous()`` whose backward also returns a contiguous gradient.

    Autograd's own backward of a permute hands the producer a permuted (strided) gradient; convolutions
    and batched GEMMs then copy it, matrix by matrix in the case of ``bmm`` (thousands of tiny copies per
    layer). Copying once, here, keeps every gradient in its producer's layout.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dims: tuple[int, ...]) -> Tensor:
        ctx.inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))
        return x.permute(dims).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.permute(ctx.inverse).contiguous(), None


def permute_copy(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Permute into a contiguous tensor; the gradient flows back contiguous in ``x``'s layout."""
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling() or functorch_active():
        return x.permute(dims).contiguous()  # a graph, not a Python autograd.Function (see position_output_qe)
    return _PermuteCopy.apply(x, tuple(dims))


class _QEPositionOutput(torch.autograd.Function):
    """``y[b, h, n] = sum_m (sum_k q[n, b, h, k] E[n, k, m]) V[b, m]`` in query chunks, saving only ``q``, ``E``
    and ``V``: the ``q . E`` chunks are recomputed in the backward pass (one extra ``b n h m k`` GEMM, ~7% of
    the layer's position FLOPs at the paper's defaults) instead of being stored."""

    @staticmethod
    def forward(ctx, q_n: Tensor, e_n: Tensor, values: Tensor, b: int, h: int, chunk: int) -> Tensor:
        n, v = q_n.shape[0], values.shape[2]
        ctx.dtypes = q_n.dtype, e_n.dtype, values.dtype
        # one compute dtype, decided here (autocast's, else the promoted one) and saved with the inputs, so that
        # the backward computes in it whether or not autocast is active there (under torch.compile it is not)
        q_n, e_n, values = _same_dtype(q_n, e_n, values)
        ctx.save_for_backward(q_n, e_n, values)
        ctx.b, ctx.h, ctx.chunk = b, h, chunk
        out = values.new_empty(b, h, n, v)
        with leave_autocast(q_n.device.type):  # none entered where autocast is off: torch.export records it
            for i in range(0, n, chunk):
                j = min(n, i + chunk)
                out[:, :, i:j] = _qe_chunk_output(q_n[i:j], e_n[i:j], values, b, h)  # b h nc v
        return out  # b h n v

    @staticmethod
    def backward(ctx, grad: Tensor):
        q_n, e_n, values = ctx.saved_tensors
        with no_autocast(q_n.device.type):
            grads = _QEPositionOutput._backward(ctx, grad.to(q_n.dtype), q_n, e_n, values)
        return *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None

    @staticmethod
    def _backward(ctx, grad: Tensor, q_n: Tensor, e_n: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, h, chunk = ctx.b, ctx.h, ctx.chunk
        n, k, m = e_n.shape
        grad_q = torch.empty_like(q_n)
        grad_e = torch.empty(n, k, m, dtype=e_n.dtype, device=e_n.device)
        grad_v = torch.zeros_like(values)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            nc = j - i
            g_c = grad[:, :, i:j].reshape(b, h * nc, grad.shape[-1])  # b (h nc) v (sizes named: b may be 0)
            a = _qe_scores(q_n[i:j], e_n[i:j], b, h)  # recomputed, b (h nc) m
            grad_v.baddbmm_(a.transpose(1, 2), g_c)  # b m v
            del a
            g_a = torch.bmm(g_c, values.transpose(1, 2)).view(b, h, nc, m)  # b h nc m
            g_a = g_a.permute(2, 0, 1, 3).reshape(nc, b * h, m)  # nc (b h) m
            grad_q[i:j] = torch.bmm(g_a, e_n[i:j].transpose(1, 2))  # nc (b h) k
            grad_e[i:j] = torch.bmm(q_n[i:j].transpose(1, 2), g_a)  # nc k m
        return grad_q, grad_e, grad_v


def _same_dtype(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` in one dtype: autocast's where it is active for their device type (and they are floating
    point), else their promoted type."""
    device_type = tensors[0].device.type
    if autocast_active(device_type) and all(t.is_floating_point() for t in tensors):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return tuple(t.to(dtype) for t in tensors)


def _qe_chunk_output(q_c: Tensor, e_c: Tensor, values: Tensor, b: int, h: int) -> Tensor:
    """``(q . E) V`` for a chunk of queries: ``[nc, (b h), k], [nc, k, m], [b, m, v] -> [b, h, nc, v]``."""
    a = _qe_scores(q_c, e_c, b, h)  # b (h nc) m
    return torch.bmm(a, values).view(b, h, q_c.shape[0], values.shape[2])  # b h nc v


def _qe_scores(q_c: Tensor, e_c: Tensor, b: int, h: int) -> Tensor:
    """``q . E`` for a chunk of queries: ``[nc, (b h), k] x [nc, k, m] -> [b, (h nc), m]``."""
    nc, m = q_c.shape[0], e_c.shape[2]
    a = torch.bmm(q_c, e_c)  # nc (b h) m
    return a.view(nc, b, h, m).permute(1, 2, 0, 3).reshape(b, h * nc, m)  # b (h nc) m


def _qe_chunk(b: int, n: int, h: int, k: int, m: int, v: int, max_chunk_elements: int | None, row: int = 1) -> int:
    """Queries per chunk: ``q . E`` chunks of at most ``max_chunk_elements`` (default a quarter of
    ``lambda^p``, ``b n k v / 4``), a whole number of ``row`` queries."""
    # a chunk and its permuted copy are alive together: a quarter of lambda^p each keeps the transient
    # memory at half of lambda^p (chunks cost no extra work; only the backward recomputes q . E)
    budget = max_chunk_elements if max_chunk_elements is not None else b * n * k * v // 4
    return row * max(1, min(n // row, budget // max(1, b * h * m * row)))


def position_output_qe(
    queries: Tensor, embeddings: Tensor, values: Tensor, *, max_chunk_elements: int | None = None
) -> Tensor:
    """Position output ``y^p[b, h, n] = (lambda^p_n)^T q^h_n``, ``[b, h, n, v]``, contracted queries-first (``u = 1``).

    ``lambda^p_n = sum_m E[n, m] V[m]^T`` costs ``b n m k v`` multiply-adds; contracting
    ``sum_m (sum_k q[n, h, k] E[k, n, m]) V[m]`` instead costs ``b n m h (k + v)`` (3.2x fewer at ``k = 16,
    h = 4, v = 64``), all as batched GEMMs. The intermediate ``q . E`` is ``b h n m``: it is formed for query
    chunks of at most ``max_chunk_elements`` elements (default: a quarter of ``lambda^p``, ``b n k v / 4``)
    and never stored for the backward pass, which recomputes it. Memory stays ``Theta(k n m + b n k v)``
    (Table 2); no ``b x n x m`` tensor is formed.

    Args:
        queries: ``[b, n, h, k]``.
        embeddings: ``[k, n, m]``.
        values: ``[b, m, v]``.
    """
    b, n, h, k = queries.shape if queries.dim() == 4 else (-1,) * 4
    m, v = values.shape[1:] if values.dim() == 3 else (-1, -1)
    if tuple(embeddings.shape) != (k, n, m) or values.shape[0] != b or min(b, m) < 0:
        got = f"{tuple(queries.shape)}, {tuple(embeddings.shape)} and {tuple(values.shape)}"
        raise ValueError(f"position_output_qe: queries [b, n, h, k], embeddings [k, n, m] and values [b, m, v] must "
                         f"agree, got {got}")  # fmt: skip
    chunk = _qe_chunk(b, n, h, k, m, v, max_chunk_elements)
    q_n = permute_copy(queries, (1, 0, 2, 3)).view(n, b * h, k)  # n (b h) k
    e_n = embeddings.transpose(0, 1)  # n k m (a strided view)
    values = values.contiguous()
    if torch.jit.is_tracing() or functorch_active():
        # a trace reads shapes as 0-dim tensors of the outer graph ("unordered_map::at") and saves no Python
        # Function, torch.func takes none without setup_context: plain chunked GEMMs (their backward keeps q . E)
        chunks = [
            _qe_chunk_output(q_n[i : i + chunk], e_n[i : i + chunk], values, b, h)  # b h nc v
            for i in range(0, n, chunk)
        ]
        return torch.cat(chunks, dim=2)  # b h n v
    return _QEPositionOutput.apply(q_n, e_n, values, b, h, chunk)  # b h n v


def relative_position_output_qe(
    queries: Tensor,
    kernel: Tensor,
    center: Sequence[int],
    spatial: Sequence[int],
    values: Tensor,
    *,
    max_chunk_elements: int | None = None,
) -> Tensor:
    """:func:`position_output_qe` with ``E`` built from a relative kernel chunk by chunk.

    The rows of ``E`` that a query chunk needs are re-indexed from ``R`` (:func:`gather_relative_embeddings`
    with ``rows``) just before use, and again in the backward pass (activation checkpointing per chunk),
    so memory is ``Theta(b n k v)`` plus one chunk: global relative lambdas on maps far beyond App. E.1's
    852 positions (where a whole ``E`` would be ``k n^2``, 630 MB at 56x56 with ``k = 16``) keep the GEMM
    path. Chunks are whole rows of the first spatial axis; ``torch.compile`` traces it without breaks.

    Args:
        queries: ``[b, n, h, k]``.
        kernel: ``R[1, k, 1, *K]`` (one group, ``u = 1``).
        center: the kernel index of offset 0, per axis.
        spatial: the input's spatial size (``n = m = prod(spatial)``).
        values: ``[b, m, v]``.

    Returns:
        ``[b, h, n, v]``.
    """
    b, n, h, k = queries.shape
    m, v = values.shape[1], values.shape[2]
    spatial, center = tuple(spatial), tuple(center)
    if kernel.dim() != 3 + len(spatial) or kernel.shape[0] != 1 or kernel.shape[2] != 1 or kernel.shape[1] != k:
        raise ValueError(f"kernel must be [1, k={k}, 1, *K] with {len(spatial)} kernel axes, got {tuple(kernel.shape)}")
    if n != math.prod(spatial) or m != n or len(center) != len(spatial):
        raise ValueError(
            f"queries and values must have n = m = prod(spatial) = {math.prod(spatial)} positions "
            f"and center one entry per axis, got n={n}, m={m}, center={center}"
        )
    row = n // spatial[0]
    rows = _qe_chunk(b, n, h, k, m, v, max_chunk_elements, row) // row

    def chunk_output(q_c: Tensor, kern: Tensor, vals: Tensor, start: int, stop: int) -> Tensor:
        e_c = gather_relative_embeddings(kern, center, spatial, rows=(start, stop))[0, :, 0]  # k nc m
        return _qe_chunk_output(q_c, e_c.transpose(0, 1), vals, b, h)  # b h nc v

    q_n = permute_copy(queries, (1, 0, 2, 3)).view(n, b * h, k)  # n (b h) k
    values = values.contiguous()
    outs = []
    for start in range(0, spatial[0], rows):
        stop = min(spatial[0], start + rows)
        q_c = q_n[start * row : stop * row]  # nc (b h) k
        if torch.is_grad_enabled() and not torch.jit.is_tracing() and not functorch_active():  # q, R, V kept; E
            # rows and scores rebuilt in backward (not in a trace, nor under torch.func: no saved-tensor hooks)
            outs.append(checkpoint(chunk_output, q_c, kernel, values, start, stop, use_reentrant=False))
        else:
            outs.append(chunk_output(q_c, kernel, values, start, stop))
    return torch.cat(outs, dim=2)  # b h n v


def apply_lambdas(queries: Tensor, lambdas: Tensor) -> Tensor:
    """Apply per-position lambdas to the queries: ``y[b, n, h] = lambda_n^T q^h_n``.

    Args:
        queries: ``[b, n, h, k]``.
        lambdas: ``[b, n, g, v, k]`` with ``g = 1`` (multi-query: all heads share a lambda) or
            ``g = h`` (multi-head).

    Returns:
        ``[b, n, h, v]``, as batched GEMMs over the ``b n`` positions (no broadcast copies).
    """
    ok = isinstance(queries, Tensor) and isinstance(lambdas, Tensor) and queries.dim() == 4 and lambdas.dim() == 5
    if not (ok and queries.shape[:2] == lambdas.shape[:2] and queries.shape[3] == lambdas.shape[4]
            and lambdas.shape[2] in (1, queries.shape[2])):  # fmt: skip
        bind_shapes(queries=(queries, "b n h k"), lambdas=(lambdas, "b n g v k"))
        raise ValueError(f"lambdas must have g = 1 or g = h = {queries.shape[2]}, got shape {tuple(lambdas.shape)}")
    b, n, h, k = queries.shape
    g, v = lambdas.shape[2], lambdas.shape[3]
    if g == 1:
        out = torch.bmm(queries.reshape(b * n, h, k), lambdas.reshape(b * n, v, k).transpose(1, 2))  # (b n) h v
        return out.view(b, n, h, v)
    out = torch.bmm(lambdas.reshape(b * n * h, v, k), queries.reshape(b * n * h, k, 1))  # (b n h) v 1
    return out.view(b, n, h, v)
