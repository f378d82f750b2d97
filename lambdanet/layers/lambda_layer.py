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
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet import functional as LF
from lambdanet.helpers import (
    avg_pool_nd,
    check_choice,
    check_dtype,
    check_input,
    check_positive_int,
    compute_dtype,
    leave_autocast,
    to_ntuple,
)
from lambdanet.layers.lambda_plan import (  # the plan is re-exported from its historical home
    CAUSAL_OP,
    LAMBDAS_FIRST_STEPS,
    QUERIES_FIRST_STEPS,
    LambdaPlan,
    LambdaPositionMixin,
)
from lambdanet.layers.position_embedding import AbsolutePositionEmbedding, RelativePositionEmbedding
from lambdanet.ops.causal_lambda import causal_lambda
from lambdanet.ops.position_lambda.policy import (  # the policy is re-exported from its historical home
    CUDA_IMPL_POLICY,
    DEFAULT_IMPL_POLICY,
    ImplPolicy,
    impl_policy,
    set_impl_policy,
)
from lambdanet.ops.position_lambda.tuning import tuned_plan

__all__ = [
    "LambdaLayer",
    "LambdaPlan",
    "QUERIES_FIRST_STEPS",
    "LAMBDAS_FIRST_STEPS",
    "ImplPolicy",
    "DEFAULT_IMPL_POLICY",
    "CUDA_IMPL_POLICY",
    "impl_policy",
    "set_impl_policy",
]

_IMPLS = ("auto",) + LF.POSITION_OUTPUT_IMPLS + ("triton",)
_QV_NORMS = ("auto", "batch", "layer", None)
_POS_EMBS = ("relative", "absolute")


class LambdaLayer(LambdaPositionMixin, nn.Module):
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
        stride: 1, or 2 for an average pool of stride 2 after the layer (3x3, App. E.1).
        stride_pool: the kernel of that pool: 3 (App. E.1, padded by 1) or 2 (non-overlapping 2x2 windows, the
            convention of timm's LambdaResNet checkpoints). Either gives ``ceil(side / 2)``, as a block's padded
            stride-2 shortcut does: on an odd side the 2x2 pool's last window averages the one row there is.
        position_bias: a learned offset ``b[k]`` added to every position lambda, ``lambda^p_n[k, v] += b[k]``
            (the bias of the lambda convolution in timm's checkpoints; not in the paper). It adds
            ``q_n . b`` to every value channel of the output.
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
            to share between layers (Table 4); it defines the scope, and ``r`` must say the same: its local
            scope (``r=7`` for a 7 x 7 table), or ``None`` for a global one (a mismatch is a one-line error
            naming the value to pass).
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
            ``u = 1``, non-causal), ``"triton"`` (the same contraction in fused Triton kernels, forward and
            backward, with ``E`` read from the relative table inside the kernel: multi-query, relative
            embeddings, 1-d or 2-d, any ``u``; CUDA, or CPU under ``TRITON_INTERPRET=1``; fp32 accumulation)
            or ``"auto"``: the fastest of the others, timed on the first call of each input size
            (:mod:`~lambdanet.ops.position_lambda.tuning`), or the static cost model of :meth:`choose_impl` where
            nothing is timed; it does not pick ``"triton"`` until the kernels have been measured on a GPU.

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
        stride_pool: int = 3,
        position_bias: bool = False,
    ):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        for name, value in dict(dim=dim, dim_out=dim_out, dim_k=dim_k, heads=heads, dim_u=dim_u).items():
            check_positive_int(value, name)
        if dim_out % heads:
            raise ValueError(f"heads={heads} must divide dim_out={dim_out} (value depth |v| = dim_out / heads)")
        check_choice(stride, "stride", (1, 2))
        check_choice(stride_pool, "stride_pool", (2, 3))
        check_choice(key_norm, "key_norm", LF.KEY_NORMS)
        check_choice(qv_norm, "qv_norm", _QV_NORMS)
        check_choice(position_embedding, "position_embedding", _POS_EMBS)
        check_choice(impl, "impl", _IMPLS)
        flags = dict(content=content, position=position, causal=causal, multihead=multihead,
                     query_softmax=query_softmax, position_bias=position_bias)  # fmt: skip
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if not (content or position):
            raise ValueError("content and position cannot both be False: the layer would compute nothing")
        if embedding is not None and not isinstance(embedding, (RelativePositionEmbedding, AbsolutePositionEmbedding)):
            raise ValueError(
                "embedding must be a RelativePositionEmbedding or AbsolutePositionEmbedding, "
                f"got {type(embedding).__name__}"
            )
        spatial_dims = self._resolve_spatial_dims(spatial_dims, embedding, causal, feat_size)
        if impl == "triton":
            self._check_triton(multihead, spatial_dims, position_embedding, embedding, position)
        if causal and stride != 1:
            raise ValueError("causal=True needs stride=1 (the average pool would mix future positions)")
        feat = to_ntuple(feat_size, spatial_dims, "feat_size")
        for s in feat or ():
            check_positive_int(s, "feat_size")

        self.dim, self.dim_out, self.dim_k, self.heads, self.dim_u = dim, dim_out, dim_k, heads, dim_u
        self.dim_v = dim_out // heads
        self.groups, self.multihead = (heads if multihead else 1), multihead
        self.spatial_dims, self.stride, self.causal, self.stride_pool = spatial_dims, stride, causal, stride_pool
        self.content, self.position = content, position
        self.key_norm, self.query_softmax, self.impl = key_norm, query_softmax, impl
        self.qv_norm = ("layer" if causal else "batch") if qv_norm == "auto" else qv_norm

        # position embeddings (own or shared) and the scope they define: r (local) or feat_size (global)
        self.embedding = self._build_embedding(position_embedding, embedding, r, feat) if position else None
        if not position and r is not None:
            check_positive_int(r, "r", odd=not causal)
        self.r, self.feat_size = self._scope(r, feat)

        # projections (no bias): Q = X Wq (d -> k h), K = C Wk (d -> k u g), V = C Wv (d -> v u g)
        self.dim_qk_total = dim_k * heads
        self.dim_keys_total = dim_k * dim_u * self.groups if content else 0
        self.dim_values_total = self.dim_v * dim_u * self.groups
        self.qkv = nn.Linear(dim, self.dim_qk_total + self.dim_keys_total + self.dim_values_total, bias=False)
        self.norm_q, self.norm_v = self._make_norm(self.dim_qk_total), self._make_norm(self.dim_values_total)
        if position_bias and (not position or self.groups != 1 or dim_u != 1):
            raise ValueError("position_bias=True needs position lambdas of a multi-query layer with dim_u=1")
        # b[k]: one offset per key depth, shared by every position and value channel (zero: no effect)
        self.position_bias = nn.Parameter(torch.zeros(dim_k)) if position_bias else None
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------ construction
    @staticmethod
    def _check_triton(multihead: bool, spatial_dims: int, position_embedding: str, embedding, position: bool) -> None:
        """``impl="triton"``: the kernels cover multi-query layers with relative embeddings on 1-d and 2-d inputs."""
        if (
            multihead
            or spatial_dims == 3
            or position_embedding == "absolute"
            or isinstance(embedding, AbsolutePositionEmbedding)
            or not position
        ):
            raise ValueError(
                "impl='triton' needs a multi-query layer (multihead=False) with relative position "
                f"embeddings on 1-d or 2-d inputs; got multihead={multihead}, spatial_dims="
                f"{spatial_dims}, position_embedding={position_embedding!r}, position={position}"
            )

    @staticmethod
    def _resolve_spatial_dims(spatial_dims: int | None, embedding, causal: bool, feat_size) -> int:
        """``spatial_dims``, else the shared embedding's, else 1 when causal, ``len(feat_size)``, or 2."""
        if spatial_dims is None and embedding is not None:
            spatial_dims = embedding.spatial_dims
        if spatial_dims is None:
            if causal:
                spatial_dims = 1
            elif feat_size is not None and not isinstance(feat_size, int):
                n = len(feat_size) if hasattr(feat_size, "__len__") and not isinstance(feat_size, str) else 0
                if not 1 <= n <= 3:  # its entries are checked with the resolved spatial_dims
                    raise ValueError(
                        "feat_size must be an int or a sequence of 1, 2 or 3 ints (one per spatial dim), "
                        f"got {feat_size!r}"
                    )
                spatial_dims = n
            else:
                spatial_dims = 2
        check_choice(spatial_dims, "spatial_dims", (1, 2, 3))
        if causal and spatial_dims != 1:
            raise ValueError(f"causal=True needs 1-d inputs (spatial_dims=1), got spatial_dims={spatial_dims}")
        return spatial_dims

    def _build_embedding(
        self, position_embedding: str, embedding, r: int | None, feat: tuple[int, ...] | None
    ) -> RelativePositionEmbedding | AbsolutePositionEmbedding:
        """The position embeddings: the shared ``embedding`` (checked against this layer), absolute ones over
        ``feat``, a local relative table of scope ``r``, or a global relative table over ``feat``."""
        k, u, g, dims, causal = self.dim_k, self.dim_u, self.groups, self.spatial_dims, self.causal
        if embedding is not None:
            self._check_shared_embedding(embedding, r, feat)
            return embedding
        if position_embedding == "absolute":
            if feat is None or r is not None:
                raise ValueError("position_embedding='absolute' needs feat_size and r=None (a global context)")
            return AbsolutePositionEmbedding(k, feat, dim_u=u, groups=g)
        if r is not None:
            check_positive_int(r, "r", odd=not causal)
            return RelativePositionEmbedding.local(k, r, spatial_dims=dims, dim_u=u, groups=g, causal=causal)
        if feat is None:
            raise ValueError("r=None (global context) needs feat_size, the spatial size of the input")
        return RelativePositionEmbedding.global_context(k, feat, spatial_dims=dims, dim_u=u, groups=g, causal=causal)

    def _scope(self, r: int | None, feat: tuple[int, ...] | None) -> tuple[int | None, tuple[int, ...] | None]:
        """``(r, feat_size)`` as the embedding defines them (the arguments when there is none)."""
        emb = self.embedding
        if emb is None:
            return r, feat
        local = isinstance(emb, RelativePositionEmbedding) and emb.feat_size is None
        return (cast(RelativePositionEmbedding, emb).kernel_size[0], None) if local else (None, emb.feat_size)

    def _make_norm(self, channels: int) -> nn.Module:
        norms = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}
        return norms[self.qv_norm](channels) if self.qv_norm in norms else nn.Identity()

    def _check_shared_embedding(self, emb, r, feat) -> None:
        for name in ("dim_k", "dim_u", "groups", "spatial_dims"):
            got, want = getattr(emb, name), getattr(self, name)
            if got != want:
                raise ValueError(f"shared embedding has {name}={got}, this layer needs {name}={want}")
        if isinstance(emb, RelativePositionEmbedding) and emb.causal != self.causal:
            raise ValueError(f"shared embedding has causal={emb.causal}, this layer has causal={self.causal}")
        if isinstance(emb, RelativePositionEmbedding) and emb.feat_size is None:
            if r is None or (r,) * self.spatial_dims != emb.kernel_size:
                raise ValueError(
                    f"r={r} does not match the shared embedding's local scope {emb.kernel_size}; "
                    f"pass r={emb.kernel_size[0]}"
                )
        else:
            if r is not None:
                raise ValueError(f"the shared embedding is global (feat_size={emb.feat_size}); pass r=None")
            if feat is not None and feat != emb.feat_size:
                raise ValueError(f"feat_size={feat} does not match the shared embedding's feat_size {emb.feat_size}")

    def reset_parameters(self) -> None:
        """Paper initialisation (App. E.1): ``Wq ~ N(0, (d k)^-1/2)``, ``Wk, Wv ~ N(0, d^-1/2)`` (std); the
        position bias (where the layer has one) 0. The position table and the norms reset themselves."""
        with torch.no_grad():
            w, nq = self.qkv.weight, self.dim_qk_total
            w[:nq].normal_(0.0, (self.dim * self.dim_k) ** -0.5)
            w[nq:].normal_(0.0, self.dim**-0.5)
            bias = getattr(self, "position_bias", None)  # (set after the first call, from __init__)
            if bias is not None:
                bias.zero_()

    def extra_repr(self) -> str:
        scope = f"r={self.r}" if self.r is not None else f"feat_size={self.feat_size}"
        parts = [
            f"{self.dim}, {self.dim_out}",
            f"dim_k={self.dim_k}",
            f"heads={self.heads}",
            f"dim_u={self.dim_u}",
            scope,
            f"stride={self.stride}",
        ]
        if self.spatial_dims != 2:
            parts.append(f"spatial_dims={self.spatial_dims}")
        parts += [f"{flag}=True" for flag in ("causal", "multihead", "query_softmax") if getattr(self, flag)]
        if not self.content or not self.position:
            parts.append(f"content={self.content}, position={self.position}")
        defaults = {"key_norm": "softmax", "qv_norm": "batch", "impl": "auto"}
        parts += [f"{name}={getattr(self, name)!r}" for name, d in defaults.items() if getattr(self, name) != d]
        if self.stride > 1 and self.stride_pool != 3:
            parts.append(f"stride_pool={self.stride_pool}")
        if self.position_bias is not None:
            parts.append("position_bias=True")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------------ forward steps
    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, self.spatial_dims, "LambdaLayer")
        check_dtype(x, self.qkv.weight, "LambdaLayer")
        b, spatial = x.shape[0], tuple(x.shape[2:])
        self._check_spatial(spatial)
        plan = self.plan(spatial, x.device.type)
        channels_first = x.is_contiguous()
        q, keys, vals = self._project(x, channels_first)  # b n (h k), b n (g k u), b n (g v u)
        out_dtype = q.dtype
        cdtype = compute_dtype(out_dtype)
        # lambdas in fp32 (at least): key softmax and lambda accumulation never in half precision, also under
        # autocast, which is switched off only where it is on (an export records any autocast context entered)
        with leave_autocast(x.device.type):
            q = q.to(cdtype).view(b, math.prod(spatial), self.heads, self.dim_k)  # b n h k (explicit n: b may be 0)
            if self.query_softmax:
                q = q.softmax(dim=-1)
            vals = vals.to(cdtype)  # b n (g v u)
            if plan.position == CAUSAL_OP:  # the causal op: content and position lambdas at once
                out = self._causal_op(q, keys.to(cdtype), vals)  # b n h v
            else:
                if self.impl == "auto":  # the winner measured for this call's key (tuning.py), else the static plan
                    plan = tuned_plan(self, plan, q, vals, spatial)
                y_c, lam_c = self._content(q, keys.to(cdtype), vals)  # b n h v | b n g v k (causal)
                y_p, lam_p = self._position(plan, q, vals, spatial)  # b n h v (queries-first) | b n g v k
                lam = _add(lam_p, lam_c)  # b n g v k: every per-query lambda, applied in one GEMM
                out = cast(Tensor, _add(y_c, y_p, None if lam is None else LF.apply_lambdas(q, lam)))  # b n h v
            if self.position_bias is not None:  # q_n . b on every value channel
                out = out + (q @ self.position_bias.to(cdtype)).unsqueeze(-1)  # b n h v
        return self._output(out.to(out_dtype), spatial, channels_first)  # b d_out *S / stride

    def _causal_op(self, q: Tensor, keys: Tensor, vals: Tensor) -> Tensor:
        """``q [b, n, h, k]``, keys ``[b, n, (k u)]``, values ``[b, n, (v u)]`` -> ``y [b, n, h, v]`` through the
        causal op; the table's offsets ``-(r - 1) .. 0`` become its ``emb[j]`` for offset ``-j``."""
        b, n = q.shape[:2]
        emb = None if self.embedding is None else self.embedding.table[0].to(q.dtype)  # k u r (last: offset 0)
        emb = None if emb is None else emb.flip(-1).permute(2, 0, 1)  # r k u
        keys, vals = keys.view(b, n, self.dim_k, self.dim_u), vals.view(b, n, self.dim_v, self.dim_u)
        return cast(Tensor, causal_lambda(q, keys, vals, emb))  # b n h v

    def _project(self, x: Tensor, channels_first: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens ``[b, n, d]`` of ``x`` -> normalised queries, raw keys, normalised values."""
        b, n = x.shape[0], math.prod(x.shape[2:])
        if channels_first:
            tokens = LF.permute_copy(x.reshape(b, self.dim, n), (0, 2, 1))  # b n d
        else:  # channels_last input: the token view is free
            tokens = x.movedim(1, -1).reshape(b, n, self.dim)  # b n d
        # three GEMMs on row blocks of the fused weight: contiguous outputs keep BatchNorm on its fast path
        weights = self.qkv.weight.split([self.dim_qk_total, self.dim_keys_total, self.dim_values_total])
        q, keys, vals = (F.linear(tokens, w) for w in weights)  # b n (h k), b n (g k u), b n (g v u)
        return self._norm(self.norm_q, q), keys, self._norm(self.norm_v, vals)

    def _norm(self, norm: nn.Module, t: Tensor) -> Tensor:
        """Apply the q/v normalisation to ``[b, n, c]`` tokens (BatchNorm over the ``b n`` positions)."""
        if isinstance(norm, nn.Identity):
            return t
        b, n, c = t.shape
        return norm(t.reshape(b * n, c)).view(b, n, c)

    def _content(self, q: Tensor, keys: Tensor, vals: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Content part: ``(y^c [b, n, h, v], None)`` with the shared content lambda, ``(None, lambda^c
        [b, n, g, v, k])`` per query for a causal layer, ``(None, None)`` without content."""
        if not self.content:
            return None, None
        b, n = q.shape[:2]
        g, k, u, v = self.groups, self.dim_k, self.dim_u, self.dim_v
        keys = keys.view(b, n, g, k, u)  # b m g k u
        vals = vals.view(b, n, g, v, u)  # b m g v u
        if self.causal:
            return None, LF.causal_content_lambdas(keys, vals, self.key_norm).transpose(-1, -2)  # b n g v k
        lam = LF.content_lambda(LF.normalize_keys(keys, self.key_norm, dim=1), vals)  # b g k v
        return LF.apply_content_lambda(q, lam), None  # b n h v

    def _output(self, out: Tensor, spatial: tuple[int, ...], channels_first: bool) -> Tensor:
        """``[b, n, h, v]`` -> ``[b, d_out, *S]`` in the input's memory format, then the stride-2 pool."""
        b = out.shape[0]
        out = out.reshape(b, math.prod(spatial), self.dim_out)  # b n d_out
        if channels_first:
            out = LF.permute_copy(out, (0, 2, 1)).view(b, self.dim_out, *spatial)  # b d_out *S
        else:
            out = out.view(b, *spatial, self.dim_out).movedim(-1, 1)  # b d_out *S (channels-last)
        if self.stride > 1:
            pad = (self.stride_pool - 1) // 2  # 3x3: padded by 1 (App. E.1), the zeros counted; 2x2: none
            if pad and self.spatial_dims == 3 and min(spatial) < 3:  # avg_pool3d refuses a padded window larger
                out, pad = F.pad(out, (pad, pad) * 3), 0  # than the input: the same zeros, padded beforehand
            # an odd side rounds up with either pool, as a padded stride-2 convolution's (a block's shortcut) does:
            # the 2x2 pool's last window then averages the one row or column there is
            dtype = out.dtype  # torch's avg_pool3d on the CPU has no float16 / bfloat16 kernel: pooled in float32
            widen = self.spatial_dims == 3 and out.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
            out = avg_pool_nd(self.spatial_dims)(
                out.float() if widen else out,
                kernel_size=self.stride_pool,
                stride=self.stride,
                padding=pad,
                ceil_mode=self.stride_pool == 2,
            ).to(dtype)
            if not channels_first and self.spatial_dims == 3:  # torch's avg_pool3d on the CPU returns NCDHW
                out = out.contiguous(memory_format=torch.channels_last_3d)
        return out


def _add(*terms: Tensor | None) -> Tensor | None:
    """The sum of the terms that are not ``None`` (``None`` if all are)."""
    total = None
    for t in terms:
        if t is not None:
            total = t if total is None else total + t
    return total
