"""The lambda layer (LambdaNetworks, Bello 2021) as a drop-in spatial layer for 1-d, 2-d and 3-d inputs.

Paper symbol -> argument: ``|k|`` -> ``dim_k``, ``|h|`` -> ``heads``, ``|u|`` -> ``dim_u``, ``|r|`` / ``|m|``
scope -> ``r``, ``d`` -> ``dim`` (input) / ``dim_out`` (output), ``|v| = dim_out / heads``.

Computation (Eq. 1-2, Fig. 3): ``Q = BN(X Wq)`` with ``h`` heads of depth ``k``, ``K = C Wk``
(``k x u`` per position), ``V = BN(C Wv)`` (``v x u``), then per query position ``n``:
``lambda_n = sum_{m,u} (softmax_m(K)[m] + E[n, m]) V[m]^T`` and ``y_n = concat_h(lambda_n^T q^h_n)``.
The content part is computed once per example, the position part through the lambda convolution
(local scope ``r``) or through relative embeddings over a global ``feat_size`` context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet import functional as LF
from lambdanet.helpers import avg_pool_nd, check_choice, check_input, check_positive_int, to_ntuple
from lambdanet.layers.position_embedding import AbsolutePositionEmbedding, RelativePositionEmbedding

__all__ = ["LambdaLayer"]

_IMPLS = ("auto",) + LF.POSITION_OUTPUT_IMPLS
_QV_NORMS = ("auto", "batch", "layer", None)
_POS_EMBS = ("relative", "absolute")
# auto impl: the einsum (GEMM) path while E[n, m] stays small and is not much larger than the scope
_EINSUM_MAX_POSITIONS = 852  # App. E.1: "convolution implementation only for input length |n| > 852"
_EINSUM_MAX_ELEMENTS = 1 << 24  # 64 MiB of fp32 embeddings per layer


class LambdaLayer(nn.Module):
    """Multi-query lambda layer on ``[B, dim, *spatial]`` inputs -> ``[B, dim_out, *spatial / stride]``.

    Args:
        dim: input channels ``d``.
        dim_out: output channels (default ``dim``); ``heads`` must divide it, ``|v| = dim_out / heads``.
        dim_k: query/key depth ``|k|`` (16).
        heads: number of queries ``|h|`` (4).
        dim_u: intra-depth ``|u|`` (1; App. B.4, Fig. 8).
        r: scope size ``|r|`` (odd unless causal): position lambdas from a local ``r^d`` neighbourhood through the
            lambda convolution, any input size. ``None``: global context with relative embeddings over
            ``feat_size``; smaller inputs use the central part of the relative table.
        feat_size: spatial size of the global context (``r=None`` or absolute embeddings).
        stride: 1, or 2 for a 3x3 average pool of stride 2 after the layer (App. E.1).
        spatial_dims: 1 (sequences), 2 (images) or 3 (video). Default: ``len(feat_size)`` when a tuple,
            1 when ``causal``, else 2.
        causal: masked lambdas for 1-d inputs (App. B.2): position ``t`` sees positions ``<= t``; keys
            are normalised over each query's own context with cumulative sums. With ``r``, the scope is
            the ``r`` positions ending at ``t``.
        content: compute the content lambda (Table 10).
        position: compute the position lambdas (Table 10).
        position_embedding: ``"relative"`` (translation equivariant, default) or ``"absolute"``
            (one embedding per (n, m) pair, Fig. 3 literally; needs ``feat_size`` and ``r=None``).
        embedding: an existing :class:`RelativePositionEmbedding` / :class:`AbsolutePositionEmbedding`
            to share between layers (Table 4); it then defines the scope, so leave ``r`` at its default
            or pass the matching value.
        multihead: the multi-head formulation of Fig. 7 (one lambda per head; for comparison).
        key_norm: ``"softmax"`` over context positions (default), ``"l2"`` or ``"none"`` (Table 12).
        query_softmax: also softmax the queries over ``k`` (Table 12).
        qv_norm: normalisation of queries and values: ``"batch"`` (BatchNorm, paper default),
            ``"layer"`` (LayerNorm over channels), ``None`` (Table 12 "no batch normalization").
            ``"auto"``: ``"batch"``, or ``"layer"`` when ``causal`` (batch statistics would leak the
            future during training).
        impl: position implementation: ``"conv"`` ((n+1)-d convolution), ``"depthwise_conv"`` (n-d
            depthwise with channel multiplier), ``"einsum"`` (masked embeddings, lambdas first as in Fig. 3),
            ``"einsum_qe"`` (the same embeddings contracted queries-first, ``(q E) V``: ``h (k + v)`` instead of
            ``k v`` multiply-adds per (n, m) pair, in query chunks no larger than ``lambda^p``; multi-query,
            ``u = 1``, non-causal) or ``"auto"`` (see :meth:`choose_impl`).

    Complexity (Table 2, ``d = dim_out``): global ``Theta(b n m k d / h)`` time and ``Theta(k n m + b n k d / h)``
    space; lambda convolution ``Theta(b n r k d / h)`` time and ``Theta(k r + b n k d / h)`` space, linear in
    ``n``. No ``b x n x m`` tensor is formed. Intra-depth multiplies time and ``E`` by ``u``; the
    multi-head form multiplies time by ``h``.

    The lambda computation itself (key normalisation, lambdas, their application) runs in float32
    (float64 for float64 inputs), also under ``torch.autocast``; the projections follow autocast.
    """

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        *,
        dim_k: int = 16,
        heads: int = 4,
        dim_u: int = 1,
        r: int | None = 23,
        feat_size: int | Sequence[int] | None = None,
        stride: int = 1,
        spatial_dims: int | None = None,
        causal: bool = False,
        content: bool = True,
        position: bool = True,
        position_embedding: str = "relative",
        embedding: RelativePositionEmbedding | AbsolutePositionEmbedding | None = None,
        multihead: bool = False,
        key_norm: str = "softmax",
        query_softmax: bool = False,
        qv_norm: str | None = "auto",
        impl: str = "auto",
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        check_positive_int(dim, "dim")
        check_positive_int(dim_out, "dim_out")
        check_positive_int(dim_k, "dim_k")
        check_positive_int(heads, "heads")
        check_positive_int(dim_u, "dim_u")
        if dim_out % heads:
            raise ValueError(f"heads={heads} must divide dim_out={dim_out} (value depth |v| = dim_out / heads)")
        check_choice(stride, "stride", (1, 2))
        check_choice(key_norm, "key_norm", LF.KEY_NORMS)
        check_choice(qv_norm, "qv_norm", _QV_NORMS)
        check_choice(position_embedding, "position_embedding", _POS_EMBS)
        check_choice(impl, "impl", _IMPLS)
        if not (content or position):
            raise ValueError("content and position cannot both be False: the layer would compute nothing")
        if embedding is not None:
            if not isinstance(embedding, (RelativePositionEmbedding, AbsolutePositionEmbedding)):
                raise ValueError(
                    "embedding must be a RelativePositionEmbedding or AbsolutePositionEmbedding, "
                    f"got {type(embedding).__name__}")
            if spatial_dims is None:
                spatial_dims = embedding.spatial_dims
        if spatial_dims is None:
            if causal:
                spatial_dims = 1
            elif feat_size is not None and not isinstance(feat_size, int):
                spatial_dims = len(tuple(feat_size))
            else:
                spatial_dims = 2
        check_choice(spatial_dims, "spatial_dims", (1, 2, 3))
        if causal and spatial_dims != 1:
            raise ValueError(f"causal=True needs 1-d inputs (spatial_dims=1), got spatial_dims={spatial_dims}")
        if causal and stride != 1:
            raise ValueError("causal=True needs stride=1 (the average pool would mix future positions)")
        groups = heads if multihead else 1
        feat = to_ntuple(feat_size, spatial_dims, "feat_size")
        if feat is not None:
            for s in feat:
                check_positive_int(s, "feat_size")

        self.dim, self.dim_out, self.dim_k, self.heads, self.dim_u = dim, dim_out, dim_k, heads, dim_u
        self.dim_v = dim_out // heads
        self.groups, self.multihead = groups, multihead
        self.spatial_dims, self.stride, self.causal = spatial_dims, stride, causal
        self.content, self.position = content, position
        self.key_norm, self.query_softmax, self.impl = key_norm, query_softmax, impl
        self.qv_norm = ("layer" if causal else "batch") if qv_norm == "auto" else qv_norm

        # position embeddings: own or shared
        self.embedding: RelativePositionEmbedding | AbsolutePositionEmbedding | None = None
        if position:
            if embedding is not None:
                self._check_shared_embedding(embedding, r, feat)
                self.embedding = embedding
            elif position_embedding == "absolute":
                if feat is None or r is not None:
                    raise ValueError("position_embedding='absolute' needs feat_size and r=None (a global context)")
                self.embedding = AbsolutePositionEmbedding(dim_k, feat, dim_u=dim_u, groups=groups)
            elif r is not None:
                check_positive_int(r, "r", odd=not causal)
                self.embedding = RelativePositionEmbedding.local(
                    dim_k, r, spatial_dims=spatial_dims, dim_u=dim_u, groups=groups, causal=causal)
            else:
                if feat is None:
                    raise ValueError("r=None (global context) needs feat_size, the spatial size of the input")
                self.embedding = RelativePositionEmbedding.global_context(
                    dim_k, feat, spatial_dims=spatial_dims, dim_u=dim_u, groups=groups, causal=causal)
        elif r is not None:
            check_positive_int(r, "r", odd=not causal)
        emb = self.embedding
        local = isinstance(emb, RelativePositionEmbedding) and emb.feat_size is None
        self.r = emb.kernel_size[0] if local else (r if emb is None else None)
        self.feat_size = feat if emb is None else emb.feat_size

        # projections (no bias): Q = X Wq (d -> k h), K = C Wk (d -> k u g), V = C Wv (d -> v u g)
        self.dim_qk_total = dim_k * heads
        self.dim_keys_total = dim_k * dim_u * groups if content else 0
        self.dim_values_total = self.dim_v * dim_u * groups
        self.qkv = nn.Linear(dim, self.dim_qk_total + self.dim_keys_total + self.dim_values_total, bias=False)
        self.norm_q = self._make_norm(self.dim_qk_total)
        self.norm_v = self._make_norm(self.dim_values_total)
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def _make_norm(self, channels: int) -> nn.Module:
        if self.qv_norm == "batch":
            return nn.BatchNorm1d(channels)
        if self.qv_norm == "layer":
            return nn.LayerNorm(channels)
        return nn.Identity()

    def _check_shared_embedding(self, emb, r, feat) -> None:
        expect = {"dim_k": self.dim_k, "dim_u": self.dim_u, "groups": self.groups,
                  "spatial_dims": self.spatial_dims}
        for name, want in expect.items():
            got = getattr(emb, name)
            if got != want:
                raise ValueError(f"shared embedding has {name}={got}, this layer needs {name}={want}")
        if isinstance(emb, RelativePositionEmbedding) and emb.causal != self.causal:
            raise ValueError(f"shared embedding has causal={emb.causal}, this layer has causal={self.causal}")
        if isinstance(emb, RelativePositionEmbedding) and emb.feat_size is None:
            if r is None or (r,) * self.spatial_dims != emb.kernel_size:
                raise ValueError(f"r={r} does not match the shared embedding's local scope {emb.kernel_size}; "
                                 f"pass r={emb.kernel_size[0]}")
        else:
            if r is not None:
                raise ValueError(f"the shared embedding is global (feat_size={emb.feat_size}); pass r=None")
            if feat is not None and feat != emb.feat_size:
                raise ValueError(f"feat_size={feat} does not match the shared embedding's feat_size {emb.feat_size}")

    def reset_parameters(self) -> None:
        """Paper initialisation (App. E.1): ``Wq ~ N(0, (d k)^-1/2)``, ``Wk, Wv ~ N(0, d^-1/2)`` (std)."""
        with torch.no_grad():
            w = self.qkv.weight
            nq = self.dim_qk_total
            w[:nq].normal_(0.0, (self.dim * self.dim_k) ** -0.5)
            w[nq:].normal_(0.0, self.dim ** -0.5)

    def extra_repr(self) -> str:
        scope = f"r={self.r}" if self.r is not None else f"feat_size={self.feat_size}"
        parts = [f"{self.dim}, {self.dim_out}", f"dim_k={self.dim_k}", f"heads={self.heads}",
                 f"dim_u={self.dim_u}", scope, f"stride={self.stride}"]
        if self.spatial_dims != 2:
            parts.append(f"spatial_dims={self.spatial_dims}")
        for flag in ("causal", "multihead", "query_softmax"):
            if getattr(self, flag):
                parts.append(f"{flag}=True")
        if not self.content or not self.position:
            parts.append(f"content={self.content}, position={self.position}")
        if self.key_norm != "softmax":
            parts.append(f"key_norm={self.key_norm!r}")
        if self.qv_norm != "batch":
            parts.append(f"qv_norm={self.qv_norm!r}")
        if self.impl != "auto":
            parts.append(f"impl={self.impl!r}")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------------
    def _check_spatial(self, spatial: tuple[int, ...]) -> None:
        emb = self.embedding
        if isinstance(emb, AbsolutePositionEmbedding):
            if spatial != emb.feat_size:
                raise ValueError(
                    f"absolute position embeddings were built for feat_size={emb.feat_size}, "
                    f"got an input of spatial size {spatial}")
        elif isinstance(emb, RelativePositionEmbedding) and emb.feat_size is not None:
            if any(s > f for s, f in zip(spatial, emb.feat_size)):
                raise ValueError(
                    f"input spatial size {spatial} is larger than feat_size={emb.feat_size} of the global "
                    "relative embeddings; build the layer with a larger feat_size or use a local scope r")

    def choose_impl(self, spatial: Sequence[int]) -> str:
        """The position implementation used for an input of this spatial size.

        ``"auto"``: the queries-first einsum (``einsum_qe``) when its ``n m h (k + v)`` multiply-adds undercut
        ``2.5 x`` the lambda convolution's ``n r k v`` (GEMMs run ~2.5x faster per FLOP than the convolutions
        on CPU). Beyond ``n = 852`` positions (App. E.1) or 64 MiB of ``E``, the rows of ``E`` are rebuilt
        chunk by chunk from the relative table in every pass
        (:func:`~lambdanet.functional.relative_position_output_qe`), and the einsum must undercut the
        convolution's multiply-adds outright: it then serves global scopes (a 56x56 global layer trains
        ~2.2x faster than with its 111x111 lambda convolution) while local scopes on large maps keep the
        convolution. Otherwise the depthwise lambda convolution, or the lambdas-first einsum for small maps
        whose scope covers them. Intra-depth, multi-head and causal layers use the lambdas-first forms.
        """
        qe_ok = self.dim_u == 1 and self.groups == 1 and not self.causal
        if self.impl != "auto":
            if self.impl == "einsum_qe" and not qe_ok:
                return "einsum"
            return self.impl
        emb = self.embedding
        n = math.prod(spatial)
        if isinstance(emb, AbsolutePositionEmbedding):
            return "einsum_qe" if qe_ok else "einsum"
        kernel, _ = LF.crop_relative_kernel(emb.table, emb.center, spatial)
        taps = math.prod(kernel.shape[3:])
        small = self._whole_embeddings_fit(n)
        gemm_speedup = 2.5 if small else 1.0
        if qe_ok and n * self.heads * (self.dim_k + self.dim_v) <= gemm_speedup * taps * self.dim_k * self.dim_v:
            return "einsum_qe"
        if small and n <= 2 * taps:
            return "einsum"
        return "depthwise_conv"

    def _whole_embeddings_fit(self, n: int) -> bool:
        """Whether the gathered ``E[n, m]`` may be materialised: ``n <= 852`` (App. E.1) and at most 64 MiB."""
        elements = n * n * self.dim_k * self.dim_u * self.groups
        return n <= _EINSUM_MAX_POSITIONS and elements <= _EINSUM_MAX_ELEMENTS

    def _qe_path(self, spatial: Sequence[int]) -> bool:
        """Whether the position output is contracted queries-first (``einsum_qe``)."""
        return self.choose_impl(spatial) == "einsum_qe"

    def _norm(self, norm: nn.Module, t: Tensor) -> Tensor:
        """Apply the q/v normalisation to ``[b, n, c]`` tokens (BatchNorm over the ``b n`` positions)."""
        if isinstance(norm, nn.Identity):
            return t
        b, n, c = t.shape
        return norm(t.reshape(b * n, c)).view(b, n, c)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, self.spatial_dims, "LambdaLayer")
        b, spatial = x.shape[0], tuple(x.shape[2:])
        self._check_spatial(spatial)
        n = math.prod(spatial)
        h, k, u, g, v = self.heads, self.dim_k, self.dim_u, self.groups, self.dim_v

        channels_first = x.is_contiguous()
        if channels_first:
            tokens = LF.permute_copy(x.reshape(b, self.dim, n), (0, 2, 1))  # b n d
        else:  # channels_last input: the token view is free
            tokens = x.movedim(1, -1).reshape(b, n, self.dim)  # b n d
        # three GEMMs on row blocks of the fused weight: contiguous outputs keep BatchNorm on its fast path
        w_q, w_k, w_v = self.qkv.weight.split([self.dim_qk_total, self.dim_keys_total, self.dim_values_total])
        q = F.linear(tokens, w_q)  # b n (h k)
        keys = F.linear(tokens, w_k)  # b n (g k u)
        vals = F.linear(tokens, w_v)  # b n (g v u)
        q = self._norm(self.norm_q, q)  # b n (h k)
        vals = self._norm(self.norm_v, vals)  # b n (g v u)
        out_dtype = q.dtype

        autocast_on = torch.is_autocast_enabled(x.device.type) if x.device.type in ("cuda", "cpu") else False
        ctx = torch.autocast(device_type=x.device.type, enabled=False) if autocast_on else nullcontext()
        cdtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
        with ctx:  # lambdas in fp32 (at least): key softmax and lambda accumulation never in half precision
            q = q.to(cdtype).view(b, n, h, k)  # b n h k
            if self.query_softmax:
                q = q.softmax(dim=-1)
            vals = vals.to(cdtype)
            out = None
            causal_lam = None  # b n g v k, per-query content lambdas of a causal layer
            if self.content:
                keys = keys.to(cdtype).view(b, n, g, k, u)  # b m g k u
                vals_t = vals.view(b, n, g, v, u)  # b m g v u
                if self.causal:
                    causal_lam = LF.causal_content_lambdas(keys, vals_t, self.key_norm).transpose(-1, -2)
                else:
                    lam_c = LF.content_lambda(LF.normalize_keys(keys, self.key_norm, dim=1), vals_t)  # b g k v
                    out = LF.apply_content_lambda(q, lam_c)  # b n h v
            if self.position and self._qe_path(spatial):
                emb = self.embedding
                if isinstance(emb, AbsolutePositionEmbedding):
                    y = LF.position_output_qe(q, emb.embeddings()[0, :, 0], vals.view(b, n, v))  # b h n v
                elif self._whole_embeddings_fit(n):  # whole E, cached in eval
                    y = LF.position_output_qe(q, emb.embeddings(spatial)[0, :, 0], vals.view(b, n, v))  # b h n v
                else:  # E row chunks built on the fly: no k n m tensor
                    y = LF.relative_position_output_qe(q, emb.table, emb.center, spatial, vals.view(b, n, v))
                y = y.transpose(1, 2)  # b n h v
                out = y if out is None else out + y
            elif self.position:
                lam_p = self._position_lambdas(vals, b, spatial)  # b n g v k
                if causal_lam is not None:
                    lam_p = lam_p + causal_lam
                y = LF.apply_lambdas(q, lam_p)  # b n h v
                out = y if out is None else out + y
            elif causal_lam is not None:
                out = LF.apply_lambdas(q, causal_lam)  # b n h v

        out = out.to(out_dtype).reshape(b, n, self.dim_out)  # b n d_out
        if channels_first:
            out = LF.permute_copy(out, (0, 2, 1)).view(b, self.dim_out, *spatial)  # b d_out *S
        else:
            out = out.view(b, *spatial, self.dim_out).movedim(-1, 1)  # b d_out *S (channels-last)
        if self.stride > 1:
            out = avg_pool_nd(self.spatial_dims)(out, kernel_size=3, stride=self.stride, padding=1)
        return out

    def _position_lambdas(self, vals: Tensor, b: int, spatial: tuple[int, ...]) -> Tensor:
        """Position lambdas ``[b, n, g, v, k]`` from normalised values ``[b, n, (g v u)]``."""
        g, v, u, k = self.groups, self.dim_v, self.dim_u, self.dim_k
        n = math.prod(spatial)
        emb = self.embedding
        if isinstance(emb, RelativePositionEmbedding) and self.choose_impl(spatial) == "depthwise_conv":
            return LF.token_position_lambdas(vals, emb.table, emb.center, spatial)  # b n g v k
        vals_cf = LF.permute_copy(vals, (0, 2, 1)).view(b, g, v, u, *spatial)  # b g v u *S
        if isinstance(emb, AbsolutePositionEmbedding):
            lam = LF.einsum_position_lambdas(vals_cf.reshape(b, g, v, u, n), emb.embeddings(self.causal))
        else:
            impl = self.choose_impl(spatial)
            impl = "einsum" if impl == "einsum_qe" else impl
            lam = LF.position_lambdas(vals_cf, emb.table, emb.center, impl)  # b g v k *S
        return LF.permute_copy(lam.reshape(b, g, v, k, n), (0, 4, 1, 2, 3))  # b n g v k
