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

import torch
from torch import Tensor, nn

from lambdanet.ops.causal_lambda import causal_lambda, resolve_mode
from lambdanet.functional import causal as LC
from lambdanet.helpers import check_positive_int

__all__ = ["CausalLambdaLayer"]


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

    The position embeddings are drawn from ``N(0, 1 / (r k))`` (the paper's ``N(0, 1)`` assumes batch-normalised
    queries and a batch norm after the layer; here the layer feeds a residual stream); the projections use
    PyTorch's default initialisation (a model may rescale ``proj`` with its depth).
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
    ):
        super().__init__()
        for value, name in ((dim, "dim"), (heads, "heads"), (dim_k, "dim_k"), (dim_u, "dim_u"), (chunk, "chunk")):
            check_positive_int(value, name)
        dim_v = dim // heads if dim_v is None else dim_v
        check_positive_int(dim_v, "dim_v")
        if not isinstance(r, int) or r < 0:
            raise ValueError(f"r must be a non-negative int (0: content lambdas only), got {r!r}")
        self.dim, self.heads, self.dim_k, self.dim_v = dim, heads, dim_k, dim_v
        self.dim_u, self.r, self.chunk = dim_u, r, chunk
        self.mode = resolve_mode(mode, "cpu") and mode  # checked here, resolved per call
        self.qkv = nn.Linear(dim, heads * dim_k + dim_k * dim_u + dim_v * dim_u, bias=False)
        self.proj = nn.Linear(heads * dim_v, dim, bias=False)
        self.emb = nn.Parameter(torch.randn(r, dim_k, dim_u) / math.sqrt(max(r, 1) * dim_k)) if r else None

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h, k, v, u = self.heads, self.dim_k, self.dim_v, self.dim_u
        q, keys, values = self.qkv(x).split([h * k, k * u, v * u], dim=-1)  # ... (h k), (k u), (v u)
        return q.unflatten(-1, (h, k)), keys.unflatten(-1, (k, u)), values.unflatten(-1, (v, u))

    def init_state(self, batch_size: int, dtype: torch.dtype | None = None, device=None) -> dict[str, Tensor]:
        """The empty context's state (:func:`lambdanet.functional.causal.init_causal_lambda_state`)."""
        p = self.qkv.weight
        dtype = torch.promote_types(dtype or p.dtype, torch.float32)
        return LC.init_causal_lambda_state(
            batch_size, self.dim_k, self.dim_v, self.dim_u, self.r, dtype=dtype, device=device or p.device
        )

    def forward(self, x: Tensor, state: dict[str, Tensor] | None = None, return_state: bool = False):
        """``x [b, n, dim]`` -> ``[b, n, dim]`` (and the state after the last position if ``return_state``);
        ``state``: the context before ``x`` (default: none)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [batch, length, dim={self.dim}], got shape {tuple(x.shape)}")
        q, keys, values = self._split(x)  # b n h k, b n k u, b n v u
        mode = resolve_mode(self.mode, x.device)
        y, state = causal_lambda(
            q,
            keys,
            values,
            self.emb,
            mode=mode,
            chunk_size=self.chunk if mode == "chunk" else None,
            initial_state=state,
            output_final_state=True,
        )
        out = self.proj(y.flatten(2).to(x.dtype))  # b n d
        return (out, state) if return_state else out

    def step(self, x: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One position: ``x [b, dim]`` -> ``([b, dim], new state)``."""
        q, keys, values = self._split(x)  # b h k, b k u, b v u
        if resolve_mode(self.mode, x.device) == "fused_chunk":  # the recurrent kernel: one launch per step
            y, state = causal_lambda(q[:, None], keys[:, None], values[:, None], self.emb, mode="fused_recurrent",
                                     initial_state=state, output_final_state=True)  # fmt: skip
            y = y[:, 0]  # b h v
        else:
            y, state = LC.causal_lambda_step(q, keys, values, self.emb, state)  # b h v
        return self.proj(y.flatten(1).to(x.dtype)), state

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, dim_k={self.dim_k}, dim_v={self.dim_v}, dim_u={self.dim_u}, "
            f"r={self.r}, chunk={self.chunk}, mode={self.mode!r}"
        )
