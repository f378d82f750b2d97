"""The position part of :class:`~lambdanet.layers.LambdaLayer`: how one forward call computes it
(:class:`~lambdanet.ops.position_lambda.dispatch.LambdaPlan`, picked by the static cost model of
:mod:`lambdanet.ops.position_lambda.dispatch` under the device's
:class:`~lambdanet.ops.position_lambda.policy.ImplPolicy`, from the layer's position embedding) and the steps that
run each plan, queries-first (the position output ``y^p``) or lambdas-first (the position lambdas ``lambda^p``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from lambdanet.helpers import assume_constant_result
from lambdanet.layers.position_embedding import AbsolutePositionEmbedding, RelativePositionEmbedding
from lambdanet.ops.position_lambda import fast as LF
from lambdanet.ops.position_lambda.dispatch import (  # re-exported: their historical home
    CAUSAL_OP,
    LAMBDAS_FIRST_STEPS,
    QUERIES_FIRST_STEPS,
    LambdaPlan,
    static_impl,
    whole_embeddings_fit,
)
from lambdanet.ops.position_lambda.policy import ImplPolicy, impl_policy
from lambdanet.ops.position_lambda.tuning import TunedLayer, measured_winners

__all__ = ["LambdaPlan", "LambdaPositionMixin", "QUERIES_FIRST_STEPS", "LAMBDAS_FIRST_STEPS", "CAUSAL_OP"]


class LambdaPositionMixin:
    """The planning and position steps of :class:`~lambdanet.layers.LambdaLayer` (which sets the attributes
    below in its constructor)."""

    if TYPE_CHECKING:  # set by LambdaLayer (typing only: torch.jit reads class annotations)
        embedding: RelativePositionEmbedding | AbsolutePositionEmbedding | None
        impl: str
        heads: int
        dim_k: int
        dim_v: int
        dim_u: int
        groups: int
        causal: bool
        content: bool
        key_norm: str
        stride: int
        stride_pool: int
        qkv: nn.Linear

    # ------------------------------------------------------------------------------------------ planning
    def _check_spatial(self, spatial: tuple[int, ...]) -> None:
        if self.stride > 1 and self.stride_pool == 2 and min(spatial) < 2:
            raise ValueError(
                f"stride_pool=2 pools non-overlapping 2-wide windows: every spatial side must be at "
                f"least 2, got an input of spatial size {spatial} (stride_pool=3 pools any size)"
            )
        emb = self.embedding
        if isinstance(emb, AbsolutePositionEmbedding):
            if spatial != emb.feat_size:
                raise ValueError(
                    f"absolute position embeddings were built for feat_size={emb.feat_size}, "
                    f"got an input of spatial size {spatial}"
                )
        elif isinstance(emb, RelativePositionEmbedding) and emb.feat_size is not None:
            if any(s > f for s, f in zip(spatial, emb.feat_size)):
                raise ValueError(
                    f"input spatial size {spatial} is larger than feat_size={emb.feat_size} of the global "
                    "relative embeddings; build the layer with a larger feat_size or use a local scope r"
                )

    def plan(self, spatial: Sequence[int], device_type: str | None = None) -> LambdaPlan:
        """The :class:`LambdaPlan` for an input of this spatial size on ``device_type`` (default: the device
        of the layer's weights), under that device's :func:`impl_policy` (``impl="auto"``: the static cost
        model; ``forward`` may then run its measured winner, :mod:`~lambdanet.ops.position_lambda.tuning`).
        ``forward`` calls it once."""
        spatial = tuple(spatial)
        policy = impl_policy(device_type if device_type is not None else self.qkv.weight.device.type)
        if self._runs_causal_op() and math.prod(spatial) >= policy.causal_op_positions:
            return LambdaPlan(CAUSAL_OP, CAUSAL_OP)
        if self.embedding is None:
            return LambdaPlan("none", None)
        if self.impl == "triton":
            return LambdaPlan("triton", "triton")
        return self.plan_for(self.impl, spatial, policy)

    def _runs_causal_op(self) -> bool:
        """Whether this layer's masked lambdas are :func:`lambdanet.ops.causal_lambda`'s (the op the causal language
        models run, chunked: linear in ``n``, no per-query lambda stored): ``impl="auto"``, causal, content lambdas
        over softmax-normalised keys, one group, and a relative (translation-invariant) position table or none.
        Other causal layers, an explicit ``impl`` and TorchScript (tracing or scripting, which the op's autograd
        Function does not serve) run the per-query lambdas of the layer's own steps."""
        if not (self.causal and self.impl == "auto" and self.content and self.groups == 1):
            return False
        if self.key_norm != "softmax" or isinstance(self.embedding, AbsolutePositionEmbedding):
            return False
        return not (torch.jit.is_tracing() or torch.jit.is_scripting())

    def plan_for(self, impl: str, spatial: tuple[int, ...], policy: ImplPolicy) -> LambdaPlan:
        """The plan of implementation ``impl`` (``"auto"``: the cost model's pick) for ``spatial`` under
        ``policy``, on a layer with position lambdas (the candidates that ``impl="auto"`` measures)."""
        n = math.prod(spatial)
        whole = self._whole_embeddings_fit(n, policy)  # E[n, m] may be materialised
        qe_ok = self.dim_u == 1 and self.groups == 1 and not self.causal  # queries-first: multi-query, u = 1
        impl = impl if impl != "auto" else self._auto_impl(spatial, n, whole, qe_ok, policy)
        if impl == "einsum_qe" and not qe_ok:
            impl = "einsum"
        if isinstance(self.embedding, AbsolutePositionEmbedding):  # absolute: lambdas-first impls are the einsum
            impl = impl if impl == "einsum_qe" else "einsum"
            position = "einsum_qe_absolute" if impl == "einsum_qe" else "einsum_absolute"
            return LambdaPlan(impl, position, policy.qe_chunk_fraction)
        if impl == "einsum_qe":
            return LambdaPlan(impl, "einsum_qe_whole" if whole else "einsum_qe_chunked", policy.qe_chunk_fraction)
        return LambdaPlan(impl, "depthwise_conv_tokens" if impl == "depthwise_conv" else impl)

    def _auto_impl(self, spatial: tuple[int, ...], n: int, whole: bool, qe_ok: bool, policy: ImplPolicy) -> str:
        """``impl="auto"``: see :meth:`choose_impl` (the cost model: :func:`static_impl`)."""
        scope = self._relative_scope()
        if scope is None:  # absolute (plan() returned already without embeddings)
            return "einsum_qe"  # "einsum" where queries-first does not apply: plan's one fallback
        taps = math.prod(LF.cropped_kernel_size(*scope, spatial))
        h, k, v = self.heads, self.dim_k, self.dim_v
        return static_impl(policy, n=n, taps=taps, heads=h, dim_k=k, dim_v=v, whole=whole, qe_ok=qe_ok)

    def _whole_embeddings_fit(self, n: int, policy: ImplPolicy) -> bool:
        """Whether the gathered ``E[n, m]`` may be materialised (``policy.max_whole_positions`` positions and
        ``policy.max_whole_elements`` elements at most)."""
        return whole_embeddings_fit(n, self.dim_k * self.dim_u * self.groups, policy)

    def _relative_scope(self) -> tuple[Sequence[int], Sequence[int]] | None:
        """``(kernel_size, center)`` of the relative position table, ``None`` for absolute embeddings or none."""
        emb = self.embedding
        return (emb.kernel_size, emb.center) if isinstance(emb, RelativePositionEmbedding) else None

    def choose_impl(self, spatial: Sequence[int], device_type: str | None = None) -> str:
        """The position implementation the static policy plans for an input of this spatial size
        (``plan(spatial).impl``); an ``impl="auto"`` forward call may run the winner measured for its input
        instead (:func:`~lambdanet.ops.position_lambda.tuning.auto_choice` says which).

        ``"auto"`` follows the device's :class:`ImplPolicy`: the queries-first ``einsum_qe`` when its
        ``n h (k + v)`` multiply-adds per context position stay below ``gemm_speedup`` times the lambda
        convolution's ``taps k v`` while the whole ``E[n, m]`` may be materialised (``max_whole_positions``,
        App. E.1's 852, and ``max_whole_elements``), and below the convolution's outright beyond, where ``E``
        rows are rebuilt per chunk in every pass (:func:`~lambdanet.functional.relative_position_output_qe`):
        global scopes keep it, local scopes on large maps take the convolution. Else the lambdas-first
        ``einsum`` for small maps (at most ``einsum_positions_per_tap`` positions per tap, ``E``
        materialisable), else the dense ``"conv"`` for scopes of ``dense_conv_taps`` taps (multiply-adds
        counted ``dense_conv_speedup`` times cheaper above) or the ``"depthwise_conv"``. Intra-depth,
        multi-head and causal layers use the lambdas-first forms (an explicit ``impl="einsum_qe"`` runs as
        ``"einsum"``), absolute embeddings the einsums; ``"none"`` without position lambdas. A causal layer with
        softmax keys, one group and a relative table (or none) runs ``"causal_op"`` from the policy's
        ``causal_op_positions`` on: content and position lambdas at once in :func:`lambdanet.ops.causal_lambda`,
        chunked (linear in ``n``).
        """
        return self.plan(spatial, device_type).impl

    @assume_constant_result  # torch.compile calls it once while tracing and keeps the result
    def _measured_winners(self, layer_id: int, dtype: torch.dtype, device: torch.device, inputs_grad: bool) -> tuple:
        """:func:`~lambdanet.ops.position_lambda.tuning.measured_winners` of this layer, for traced calls. A
        method: dynamo calls a constant method on the real module, where torch 2.11 cannot hand a module to a
        constant function (``AsPythonConstantNotImplementedError``, a hard error); the caller passes ``id(self)``
        as ``layer_id``, whose tracing guards the compiled code on this very layer (no other gets its result)."""
        return measured_winners(cast(TunedLayer, self), dtype, device, inputs_grad)  # a LambdaLayer

    # ------------------------------------------------------------------------------------------ forward steps

    def _position(
        self, plan: LambdaPlan, q: Tensor, vals: Tensor, spatial: tuple[int, ...]
    ) -> tuple[Tensor | None, Tensor | None]:
        """Position part by ``plan.position``: ``(y^p [b, n, h, v], None)`` queries-first, ``(None, lambda^p
        [b, n, g, v, k])`` lambdas-first, ``(None, None)`` without position lambdas."""
        if plan.position is None:
            return None, None
        if plan.queries_first:
            return self._position_output(plan, q, vals, spatial), None
        return None, self._position_lambdas(plan.position, vals, spatial)

    def _position_output(self, plan: LambdaPlan, q: Tensor, vals: Tensor, spatial: tuple[int, ...]) -> Tensor:
        """Queries-first position output ``y^p = (q E) V``, ``[b, n, h, v]`` (multi-query; ``u = 1`` but for
        ``"triton"``)."""
        step = plan.position
        emb, dtype = self.embedding, vals.dtype  # the compute dtype: half-precision tables are widened
        rel = cast(RelativePositionEmbedding, emb)  # what every step but "einsum_qe_absolute" runs on
        b, n = vals.shape[:2]
        if step == "triton":  # fused kernels, any u: q [b n h k], V [b m v u], R [k u *K]
            from lambdanet.ops.position_lambda.fused import lambda_position_output

            vals = vals.view(b, n, self.dim_v, self.dim_u)  # b m v u
            return lambda_position_output(q, vals, rel.table[0].to(dtype), rel.center, spatial)  # b n h v
        vals = vals.view(b, n, self.dim_v)  # b m v
        chunk = b * max(1, int(plan.qe_chunk_fraction * n * self.dim_k * self.dim_v))  # q . E elements per chunk
        if step == "einsum_qe_absolute":
            absolute = cast(AbsolutePositionEmbedding, emb)
            e = absolute.embeddings()[0, :, 0].to(dtype)  # k n m
            y = LF.position_output_qe(q, e, vals, max_chunk_elements=chunk)  # b h n v
        elif step == "einsum_qe_whole":  # whole E, cached in eval
            e = rel.embeddings(spatial, dtype)[0, :, 0]  # k n m
            y = LF.position_output_qe(q, e, vals, max_chunk_elements=chunk)  # b h n v
        else:  # "einsum_qe_chunked": E row chunks built on the fly, no k n m tensor
            table = rel.table.to(dtype)
            y = LF.relative_position_output_qe(q, table, rel.center, spatial, vals, max_chunk_elements=chunk)
        return y.transpose(1, 2)  # b n h v

    def _position_lambdas(self, step: str, vals: Tensor, spatial: tuple[int, ...]) -> Tensor:
        """Lambdas-first position lambdas ``[b, n, g, v, k]`` from normalised values ``[b, n, (g v u)]``."""
        emb, dtype = self.embedding, vals.dtype  # the compute dtype: half-precision tables are widened
        rel = cast(RelativePositionEmbedding, emb)  # what every step but "einsum_absolute" runs on
        b, n = vals.shape[:2]
        g, v, u, k = self.groups, self.dim_v, self.dim_u, self.dim_k
        if step == "depthwise_conv_tokens":  # channels-last in and out: no layout copies
            return LF.token_position_lambdas(vals, rel.table.to(dtype), rel.center, spatial)  # b n g v k
        vals_cf = LF.permute_copy(vals, (0, 2, 1)).view(b, g, v, u, *spatial)  # b g v u *S
        if step == "einsum_absolute":
            e = cast(AbsolutePositionEmbedding, emb).embeddings(self.causal).to(dtype)  # g k u n m
            lam = LF.einsum_position_lambdas(vals_cf.reshape(b, g, v, u, n), e)  # b g v k n
        else:  # "conv" | "einsum"
            lam = LF.position_lambdas(vals_cf, rel.table.to(dtype), rel.center, step)  # b g v k *S
        return LF.permute_copy(lam.reshape(b, g, v, k, n), (0, 4, 1, 2, 3))  # b n g v k
