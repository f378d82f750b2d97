"""The causal lambda layer for sequences (App. B.2's masked lambdas) with a constant-size streaming state.

Paper symbol -> argument: ``|h|`` -> ``heads`` (multi-query: one lambda serves every head), ``|k|`` -> ``dim_k``,
``|v|`` -> ``dim_v``, ``|u|`` -> ``dim_u``, ``|r|`` -> ``r`` (the causal local scope: offsets ``0..r-1``).

On ``x [b, n, d]``: ``q = x Wq`` (``h`` heads of depth ``k``), ``K = x Wk`` (``k x u``), ``V = x Wv``
(``v x u``); query ``n`` applies ``lambda_n = lambda^c_n + lambda^p_n`` built from the context ``m <= n``
(content: keys softmax-normalised over that context; position: learnt embeddings ``E [r, k, u]`` over the
last ``r`` values), the ``h`` outputs are concatenated and projected back to ``d`` (``Wo``, ``h v x d``).
The computation is :mod:`lambdanet.functional.causal`: chunked for training (linear in ``n``), one position at
a time for generation, with a state of ``u k v + 2 u k + u (r - 1) v`` numbers per example whatever the
context's length. ``r = 0`` keeps content lambdas only: causal linear attention with softmax-normalised
keys (Efficient Attention, App. C.3), the linear-attention baseline.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet.functional import causal as LC
from lambdanet.helpers import autocast_active, check_choice, check_dtype, check_int, check_positive_int
from lambdanet.layers.causal_attention import step_arguments
from lambdanet.ops import lambda_terms as terms
from lambdanet.ops.causal_lambda import call_mode, causal_lambda, resolve_mode

__all__ = ["CausalLambdaLayer"]


DECAYS = (None, "fixed", "gate")
KEY_NORMS = terms.KEY_NORMS  # "softmax": the paper's (the fused op); "l2", "none": Table 12's other rows
_OP_KEYS = ("S", "z", "c", "window")


def _inverse_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


def _outside_inference(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` usable with autograd on: tensors made under ``inference_mode`` copied (autograd cannot save them).
    Not while compiling (no graph break: a compiled step takes states of its own) or without autograd (no copy)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return state
    return {key: t.clone() if t.is_inference() else t for key, t in state.items()}


class CausalLambdaLayer(nn.Module):
    """Causal multi-query lambda layer on ``[b, n, dim]`` token sequences.

    Args:
        dim: model width ``d`` (input and output).
        heads: query heads ``|h|``.
        dim_k: query/key depth ``|k|``.
        dim_v: value depth ``|v|`` (default ``dim // heads``, the paper's); the heads' outputs (``h v``) are
            projected back to ``dim``.
        dim_u: intra-depth ``|u|``.
        r: causal local scope of the position lambdas (offsets ``0..r-1``); 0 for content lambdas only.
        chunk: positions per chunk of the PyTorch chunked form (``mode="chunk"``).
        mode: the causal op's implementation (:func:`lambdanet.ops.causal_lambda`): ``"auto"`` (the Triton
            ``"fused_chunk"`` kernels on CUDA, the PyTorch ``"chunk"`` form elsewhere), or one of its modes.
        decay: lets the content summary forget (not in the paper): ``None`` (the paper's prefix softmax),
            ``"fixed"`` (a learnt rate ``g_k > 0`` per key channel: the weight of context ``m`` for query ``n`` is
            multiplied by ``exp(-g (n - m))`` before the normalisation, RetNet's decay) or ``"gate"`` (a
            data-dependent rate ``g_t = softplus(x_t W_g + b)``: the weight is multiplied by
            ``exp(-sum_{m < t <= n} g_t)``, GLA's forget gate). Both keep the constant-size state.
        short_conv: the width of a causal depthwise convolution over the ``q, K, V`` projections (0: none; Mamba's
            and DeltaNet's short convolution); the state keeps the last ``short_conv - 1`` projections.
        lambdas: the number of lambdas, each with its own keys and values, among which the ``heads`` queries are
            split evenly (1: the paper's multi-query lambda; ``heads``: one lambda per head, App. B.3's
            multi-head lambdas); the state holds ``lambdas`` of them.
        content: the content lambdas (``False``: the position lambdas alone, Table 10's position-only row; needs
            ``r >= 1``; the layer then has no keys).
        key_norm: how the keys are normalised over the prefix ``m <= n``, per channel (Table 12 for sequences):
            ``"softmax"`` (the paper's), ``"l2"`` (``K[m] / ||K[:n+1]||_2``) or ``"none"`` (the raw keys: the
            content lambda is a running sum that grows with the context).
        query_softmax: the queries softmax-normalised over ``k`` per head as well (Table 12's "+ softmax on
            queries").

    ``content=False`` and ``key_norm`` other than ``"softmax"`` run the two terms apart
    (:mod:`lambdanet.ops.lambda_terms`, PyTorch chunked forms whatever ``mode`` says); ``decay`` needs the
    prefix softmax. Every option keeps the constant-size state.

    The decays are computed as offsets of the keys: ``exp(K[m]) prod_{m < t <= n} exp(-g_t)`` normalised over
    ``m <= n`` equals a prefix softmax of ``K[m] + G[m]`` with ``G`` the running sum of the rates (the factor
    ``exp(-G[n])`` cancels), so every mode of the causal op serves them unchanged; the offsets are float32 and
    restart at 0 with each call (the carried maximum is shifted by the call's total instead).

    The position embeddings are drawn from ``N(0, 1 / (r k))`` (the paper's ``N(0, 1)`` assumes batch-normalised
    queries and a batch norm after the layer; here the layer feeds a residual stream); the projections use
    PyTorch's default initialisation (a model may rescale ``proj`` with its depth). Decay rates start spread
    log-uniformly over ``[2^-9, 2^-5]`` per channel (RetNet's range), the gate's weights at zero.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 4,
        dim_k: int = 16,
        dim_v: int | None = None,
        dim_u: int = 1,
        r: int = 64,
        chunk: int = LC.DEFAULT_CHUNK,
        mode: str = "auto",
        decay: str | None = None,
        short_conv: int = 0,
        lambdas: int = 1,
        content: bool = True,
        key_norm: str = "softmax",
        query_softmax: bool = False,
    ):
        super().__init__()
        for value, name in ((dim, "dim"), (heads, "heads"), (dim_k, "dim_k"), (dim_u, "dim_u"), (chunk, "chunk")):
            check_positive_int(value, name)
        check_positive_int(lambdas, "lambdas")
        if heads % lambdas:
            raise ValueError(f"lambdas must divide heads={heads} (the queries are split among them), got {lambdas}")
        dim_v = dim // heads if dim_v is None else dim_v
        check_positive_int(dim_v, "dim_v")
        check_int(r, "r", 0, note=" (0: content lambdas only)")  # numpy's too, as LambdaLayer's
        r = int(r)
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(map(repr, DECAYS))}, got {decay!r}")
        check_int(short_conv, "short_conv", 0, note=" (0: no convolution)")
        short_conv = int(short_conv)
        self.dim, self.heads, self.dim_k, self.dim_v = dim, heads, dim_k, dim_v
        self._state_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.dim_u, self.r, self.chunk, self.decay, self.short_conv = dim_u, r, chunk, decay, short_conv
        for value, name in ((content, "content"), (query_softmax, "query_softmax")):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        check_choice(key_norm, "key_norm", KEY_NORMS)
        if not content and not r:
            raise ValueError("content=False needs position lambdas: r must be >= 1 with it, got r=0")
        if decay is not None and (not content or key_norm != "softmax"):
            raise ValueError(f"decay={decay!r} needs the content lambdas' prefix softmax (content=True, "
                             f"key_norm='softmax'), got content={content}, key_norm={key_norm!r}")  # fmt: skip
        self.lambdas, self.content, self.key_norm, self.query_softmax = lambdas, content, key_norm, query_softmax
        self.fused = content and key_norm == "softmax"  # the one causal op serves both terms
        resolve_mode(mode, "cpu")  # checked here; resolved on each call's device
        self.mode = mode
        width = heads * dim_k + lambdas * (dim_k * dim_u * content + dim_v * dim_u)
        self.qkv = nn.Linear(dim, width, bias=False)
        self.proj = nn.Linear(heads * dim_v, dim, bias=False)
        self.emb = nn.Parameter(torch.empty(r, dim_k, dim_u)) if r else None
        self._reset_table()  # before the modules below draw their own (the random numbers of a seed as before)
        self.conv = nn.Conv1d(width, width, short_conv, groups=width, bias=False) if short_conv else None
        self.decay_rate = nn.Parameter(torch.empty(dim_k, dim_u)) if decay == "fixed" else None
        self.gate = nn.Linear(dim, dim_k * dim_u) if decay == "gate" else None
        self.reset_options()

    def reset_parameters(self) -> None:
        """The layer's own initialisation (also after ``to_empty`` from the meta device): the position table
        ``N(0, 1 / (r k))``, the short convolution the identity (its last tap: the option starts as the plain
        layer), the decay rates ``2^-9 .. 2^-5`` per key channel (fixed, or the gate's bias with zero weights).
        The projections keep ``nn.Linear``'s own initialisation (its ``reset_parameters``)."""
        self._reset_table()
        self.reset_options()

    def _reset_table(self) -> None:
        if self.emb is not None:
            with torch.no_grad():
                self.emb.copy_(torch.randn(self.emb.shape) / math.sqrt(max(self.r, 1) * self.dim_k))

    def reset_options(self) -> None:
        """The options' own initialisation, drawing no random numbers: the short convolution the identity, the
        decay rates ``2^-9 .. 2^-5`` (fixed, or the gate's bias with zero weights). A model that initialises its
        linear layers its own way calls it after (the gate is an ``nn.Linear`` that must start at zero)."""
        k, u = self.dim_k, self.dim_u
        with torch.no_grad():
            if self.conv is not None:
                nn.init.zeros_(self.conv.weight)
                self.conv.weight[:, 0, -1] = 1.0
            rates = _inverse_softplus(torch.logspace(-9, -5, k * u, base=2.0)).view(k, u)  # k u
            if self.decay_rate is not None:
                self.decay_rate.copy_(rates)
            if self.gate is not None:
                nn.init.zeros_(self.gate.weight)
                self.gate.bias.copy_(rates.flatten())

    def _project(self, x: Tensor, state: dict[str, Tensor] | None, keep: bool = True) -> tuple[Tensor, Tensor | None]:
        """``x [b, n, d]`` -> the projections ``[b, n, h k + k u + v u]`` (through the short convolution, which
        continues from the state's last projections) and the convolution's new state (``None`` unless ``keep``)."""
        qkv = self.qkv(x)  # b n c
        if self.conv is None:
            return qkv, None
        s = self.short_conv
        prev = (
            state["conv"] if state is not None and "conv" in state else qkv.new_zeros(x.shape[0], s - 1, qkv.shape[2])
        )
        full = torch.cat([prev.to(qkv.dtype), qkv], dim=1)  # b (s - 1 + n) c
        if x.shape[1] == 0:  # an empty sequence: nothing to convolve, the carried projections stay
            out = qkv
        elif x.shape[1] == 1:  # one position (generation): the s taps as a product and a sum in float32 at least,
            # not a convolution call (~100 us on a CPU, for s x c multiply-adds)
            dtype = torch.promote_types(full.dtype, torch.float32)
            taps = self.conv.weight[:, 0].t().to(dtype)  # s c
            out = (full.to(dtype) * taps).sum(1, keepdim=True).to(full.dtype)  # b 1 c
        else:
            out = self.conv(full.transpose(1, 2)).transpose(1, 2)  # b n c
        if not keep:
            return out, None
        last = full[:, full.shape[1] - (s - 1) :].detach()  # the state receives no gradient (truncated backprop)
        return out, last.to(torch.promote_types(qkv.dtype, torch.float32))

    def _split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[b, n, c]`` -> ``q [b, n, h, k]``, ``K [b, n, L, k, u]``, ``V [b, n, L, v, u]`` (``L`` lambdas; without
        content lambdas the keys are an empty ``[b, n, L, 0, u]``)."""
        h, k, v, u, L = self.heads, self.dim_k, self.dim_v, self.dim_u, self.lambdas
        kc = k * self.content
        q, keys, values = qkv.split([h * k, L * kc * u, L * v * u], dim=-1)  # b n (h k), (L k u), (L v u)
        q = q.unflatten(-1, (h, k))  # b n h k
        q = q.softmax(dim=-1) if self.query_softmax else q
        return q, keys.unflatten(-1, (L, kc, u)), values.unflatten(-1, (L, v, u))

    def _fold(self, q: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each lambda as a stream of its own for the op: ``(b L) n (h / L) k``, ``(b L) n k u``, ``(b L) n v u``."""
        q = q.unflatten(2, (self.lambdas, -1)).transpose(1, 2).flatten(0, 1)  # (b L) n (h/L) k
        return q, keys.transpose(1, 2).flatten(0, 1), values.transpose(1, 2).flatten(0, 1)

    def _unfold(self, y: Tensor) -> Tensor:
        """The op's ``(b L) n (h / L) v`` -> ``b n (h v)``."""
        return y.unflatten(0, (-1, self.lambdas)).transpose(1, 2).flatten(2)  # b n (h v)

    def _offsets(self, x: Tensor, keys: Tensor) -> tuple[Tensor, Tensor | None]:
        """The decayed keys ``K + G`` (float32; ``G`` the running sum of the rates from 0 in this call) and the
        call's total ``G[n]`` per channel ``[b, k, u]``; the keys as they are without a decay."""
        if self.decay is None:
            return keys, None
        dtype = torch.promote_types(keys.dtype, torch.float32)  # float32 at least: the offsets grow with n
        if self.decay_rate is not None:
            rate = F.softplus(self.decay_rate.to(dtype)).expand(x.shape[0], x.shape[1], -1, -1)  # b n k u
        else:
            rate = F.softplus(cast(nn.Linear, self.gate)(x).to(dtype)).unflatten(-1, (self.dim_k, self.dim_u))
        G = rate.cumsum(dim=1)[:, :, None]  # b n 1 k u: every lambda's keys alike
        total = G[:, -1] if G.shape[1] else G.new_zeros(G.shape[0], 1, self.dim_k, self.dim_u)  # b 1 k u
        return keys.to(dtype) + G, total.expand(-1, self.lambdas, -1, -1).flatten(0, 1).detach()  # (b L) k u

    def _terms(self, q: Tensor, keys: Tensor, values: Tensor, state: dict[str, Tensor] | None):
        """The content and position terms apart (``content=False`` or ``key_norm`` other than the softmax):
        ``(y (b L) n (h/L) v, the terms' state)``."""
        y: Tensor | None = None
        new: dict[str, Tensor] = {}
        if self.content:
            before = None if state is None else {key: state[key] for key in ("S", "ss")}
            y, mine = terms.content_lambda(q, keys, values, key_norm=self.key_norm, chunk_size=self.chunk,
                                           initial_state=before, output_final_state=True)  # fmt: skip
            new.update(mine)
        if self.emb is not None:
            before = None if state is None else {"window": state["window"]}
            p, mine = terms.position_lambda(q, values, self.emb, chunk_size=self.chunk, initial_state=before,
                                            output_final_state=True)  # fmt: skip
            y = p if y is None else y + p
            new.update(mine)
        return cast(Tensor, y), {key: t.detach() for key, t in new.items()}  # as the fused op's: no gradient

    def no_weight_decay(self) -> set[str]:
        """The parameters that take no weight decay (timm's method; :func:`lambdanet.engine.optim.param_groups`
        reads it): ``decay_rate``, the fixed decay's rates before the softplus. Weight decay would pull them
        towards 0, a rate of ``softplus(0) = 0.69`` per position, whatever the data say (Mamba exempts its
        ``A_log`` alike)."""
        return {"decay_rate"} if self.decay_rate is not None else set()

    def init_state(self, batch_size: int, dtype: torch.dtype | None = None, device=None) -> dict[str, Tensor]:
        """The empty context's state (:func:`lambdanet.functional.causal.init_causal_lambda_state`, and the last
        ``short_conv - 1`` projections as zeros)."""
        check_int(batch_size, "batch_size", 0)  # (numpy's integers too, as the attention layer's init_state)
        batch_size = int(batch_size)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point dtype (the state is float32 or wider), got {dtype}")
        p = self.qkv.weight
        dtype = torch.promote_types(dtype or p.dtype, torch.float32)
        device = device or p.device
        B, k, v, u, r = batch_size * self.lambdas, self.dim_k, self.dim_v, self.dim_u, self.r
        if self.fused:
            state = LC.init_causal_lambda_state(B, k, v, u, r, dtype=dtype, device=device)
        else:
            state = terms.init_position_state(B, v, u, r, dtype=dtype, device=device) if r else {}
            state.update(terms.init_content_state(B, k, v, u, dtype=dtype, device=device) if self.content else {})
        if self.conv is not None:
            state["conv"] = torch.zeros(batch_size, self.short_conv - 1, self.qkv.out_features, dtype=dtype,
                                        device=device)  # fmt: skip
        return state

    @staticmethod
    def _to_proj(y: Tensor, x: Tensor) -> Tensor:
        """The lambdas' output as ``proj`` takes it: in ``x``'s dtype, except under autocast, where ``proj`` casts
        its input itself (a bf16 ``y`` cast to a float32 ``x``'s dtype and back cost 4 copies of ``[b, n, h v]``
        per layer and step: ~6 ms of a 100 ms ``lambda_lm_base`` step on an H100)."""
        return y if autocast_active(y.device.type) else y.to(x.dtype)

    def _finish(self, state: dict[str, Tensor], total: Tensor | None, conv: Tensor | None) -> dict[str, Tensor]:
        state = dict(state)
        if total is not None:  # the next call's offsets restart at 0: shift the carried maximum to that frame
            state["c"] = state["c"] - total.transpose(1, 2)  # b u k
        if conv is not None:
            state["conv"] = conv
        return state

    def forward(self, x: Tensor, state: dict[str, Tensor] | None = None, return_state: bool = False):
        """``x [b, n, dim]`` -> ``[b, n, dim]`` (and the state after the last position if ``return_state``);
        ``state``: the context before ``x`` (default: none)."""
        self._check_x(x, "[batch, length, dim={}]", 3)
        if state is not None:
            if self.mode == "naive" and self.fused:
                raise ValueError(
                    "state must be None with mode='naive' (the definition starts from an empty context); "
                    "continue a sequence with mode='auto', 'chunk' or 'fused_recurrent'"
                )
            self._check_state(state, x.shape[0], x.device)
            state = _outside_inference(state)
        qkv, conv = self._project(x, state, keep=return_state)
        q, keys, values = self._split(qkv)  # b n h k, b n L k u, b n L v u
        keys, total = self._offsets(x, keys)
        q, keys, values = self._fold(q, keys, values)  # (b L) n (h/L) k, (b L) n k u, (b L) n v u
        if not self.fused:
            y, op_state = self._terms(q, keys, values, state)
        else:
            mode = call_mode(self.mode, q, self.r if self.emb is not None else 0, dim_u=self.dim_u)
            res = causal_lambda(q, keys, values, self.emb, mode=mode,
                                chunk_size=self.chunk if mode == "chunk" else None,
                                initial_state=None if state is None else {key: state[key] for key in _OP_KEYS},
                                output_final_state=return_state)  # fmt: skip
            y, op_state = res if isinstance(res, tuple) else (res, {})  # a training step makes no final state
        out = self.proj(self._to_proj(self._unfold(y), x))  # b n d
        return (out, self._finish(op_state, total, conv)) if return_state else out

    def step(self, state: dict[str, Tensor], x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One position: ``x [b, dim]`` after the context ``state`` -> ``([b, dim], new state)`` (the earlier order
        ``step(x, state)`` still works for one release, with a warning)."""
        state, x = step_arguments(state, x, "CausalLambdaLayer.step")
        self._check_x(x, "[batch, dim={}]", 2)
        self._check_state(state, x.shape[0], x.device)
        state = _outside_inference(state)
        qkv, conv = self._project(x[:, None], state)
        q, keys, values = self._split(qkv)  # b 1 h k, b 1 L k u, b 1 L v u
        keys, total = self._offsets(x[:, None], keys)
        q, keys, values = self._fold(q, keys, values)  # (b L) 1 (h/L) k, (b L) 1 k u, (b L) 1 v u
        if not self.fused:
            y, op_state = self._terms(q, keys, values, state)
        elif resolve_mode(self.mode, x.device) == "fused_chunk":  # the recurrent kernel: one launch per step
            y, op_state = causal_lambda(q, keys, values, self.emb, mode="fused_recurrent",
                                        initial_state={key: state[key] for key in _OP_KEYS},
                                        output_final_state=True)  # fmt: skip
        else:
            op_state = {key: state[key] for key in _OP_KEYS}
            y, op_state = LC.causal_lambda_step(q[:, 0], keys[:, 0], values[:, 0], self.emb, op_state)
            y = y[:, None]  # (b L) 1 (h/L) v
        return self.proj(self._to_proj(self._unfold(y)[:, 0], x)), self._finish(op_state, total, conv)

    def _check_x(self, x: Tensor, layout: str, rank: int) -> None:
        """A one-line ``ValueError`` unless ``x`` is a floating-point tensor of ``layout`` that the projection takes."""
        if not isinstance(x, Tensor) or x.dim() != rank or x.shape[-1] != self.dim or not x.is_floating_point():
            got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating-point tensor {layout.format(self.dim)}, got {got}")
        check_dtype(x, self.qkv.weight, "CausalLambdaLayer")

    def _check_state(self, state: dict[str, Tensor], batch_size: int, device: torch.device) -> None:
        """A one-line ``ValueError`` unless ``state`` has the keys and shapes of :meth:`init_state` for
        ``batch_size``, floating-point tensors on ``device`` (the expected shapes kept per batch size, as generation
        checks every step)."""
        known = getattr(self, "_state_shapes", {})  # (a layer pickled by an earlier version has none)
        want = known.get(batch_size)
        if want is None:
            want = {key: tuple(t.shape) for key, t in self.init_state(batch_size, device="meta").items()}
            self._state_shapes = {**known, batch_size: want}
        LC.check_state_shapes(state, want, "state must be this layer's state (keys {keys}: init_state, or a returned "
                              "state)", "state does not fit a batch of {b} in this layer", device=device,
                              b=batch_size)  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, dim_k={self.dim_k}, dim_v={self.dim_v}, dim_u={self.dim_u}, "
            f"r={self.r}, chunk={self.chunk}, mode={self.mode!r}, decay={self.decay!r}, short_conv={self.short_conv}, "
            f"lambdas={self.lambdas}"
            + (", content=False" if not self.content else "")
            + (f", key_norm={self.key_norm!r}" if self.key_norm != "softmax" else "")
            + (", query_softmax=True" if self.query_softmax else "")
        )
