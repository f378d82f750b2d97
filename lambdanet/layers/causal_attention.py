"""Causal multi-head self-attention for sequences, the transformer baseline of the lambda language models.

On ``x [b, n, d]``: ``q, k, v = x Wqkv`` (``heads`` heads of depth ``d / heads``), rotary position embeddings
(RoFormer, Su et al. 2021) on ``q`` and ``k`` unless the model adds learnt positions, causal
``scaled_dot_product_attention``, ``Wo``. Generation keeps the keys and values of every earlier position
(the KV cache): its state, and each step's cost, grow linearly with the context.
"""

from __future__ import annotations

import warnings
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet.helpers import check_int, check_positive_int

__all__ = ["CausalSelfAttention", "rotary", "step_arguments"]


def step_arguments(state, x, where: str) -> tuple[dict, Tensor]:
    """``(state, x)`` of a streaming ``step(state, x)`` (the causal mixers', a language-model block's), the order of
    :meth:`lambdanet.models.lm.LanguageModel.step`. The earlier order, ``step(x, state)`` (a tensor first, a
    dict second), works for one release: a ``DeprecationWarning`` naming ``where``, then the two swapped."""
    if isinstance(state, Tensor) and isinstance(x, dict):
        warnings.warn(
            f"{where}(x, state) is deprecated: call {where}(state, x), the order of LanguageModel.step; the old "
            "order is removed in lambdanet 0.4",
            DeprecationWarning,
            stacklevel=3,
        )
        return cast(dict, x), state
    return cast(dict, state), cast(Tensor, x)


def rotary(x: Tensor, start: int | Tensor = 0, base: float = 10000.0) -> Tensor:
    """Rotary position embedding of ``x [b, h, n, dh]`` (``dh`` even) for positions ``start .. start + n - 1``:
    channel pairs ``(i, i + dh/2)`` rotated by ``pos * base^(-2i/dh)``, computed in float32 or wider."""
    n, dh = x.shape[2], x.shape[3]
    dtype = torch.promote_types(x.dtype, torch.float32)
    freq = base ** (-torch.arange(0, dh // 2, dtype=dtype, device=x.device) * 2 / dh)  # dh/2
    pos = torch.arange(n, dtype=dtype, device=x.device) + start  # n
    angle = pos[:, None] * freq  # n dh/2
    cos, sin = angle.cos(), angle.sin()  # n dh/2
    x1, x2 = x.to(dtype).chunk(2, dim=-1)  # b h n dh/2
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)  # b h n dh


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention on ``[b, n, dim]`` with a KV cache for generation.

    Args:
        dim: model width (input and output).
        heads: attention heads; must divide ``dim`` (head depth ``dim / heads``, even with ``rotary``).
        rotary: rotate queries and keys by their positions (no learnt positions needed).
    """

    def __init__(self, dim: int, heads: int = 4, rotary: bool = True):
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(heads, "heads")
        if not isinstance(rotary, bool):
            raise ValueError(f"rotary must be True or False, got {rotary!r}")
        if dim % heads or (rotary and (dim // heads) % 2):
            raise ValueError(f"heads={heads} must divide dim={dim} into an even head depth (rotary needs pairs)")
        self.dim, self.heads, self.rotary = dim, heads, rotary
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def init_state(self, batch_size: int, dtype: torch.dtype | None = None, device=None) -> dict[str, Tensor]:
        """The empty KV cache: ``k`` and ``v`` of shape ``[b, heads, 0, dim / heads]``."""
        check_int(batch_size, "batch_size", 0)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        p = self.qkv.weight
        empty = torch.zeros(
            batch_size, self.heads, 0, self.dim // self.heads, dtype=dtype or p.dtype, device=device or p.device
        )
        return {"k": empty, "v": empty.clone()}

    def _heads(self, x: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # 3 b h n dh
        if self.rotary:
            q, k = rotary(q, start), rotary(k, start)
        return q, k, v

    def forward(self, x: Tensor, state: dict[str, Tensor] | None = None, return_state: bool = False):
        """``x [b, n, dim]`` -> ``[b, n, dim]``; with ``state`` (a KV cache) ``x`` continues its context,
        and ``return_state`` also returns the cache extended by ``x``'s keys and values."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim or not x.is_floating_point():
            got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating-point tensor [batch, length, dim={self.dim}], got {got}")
        start = 0 if state is None else self._check_state(state, x)
        q, k, v = self._heads(x, start)  # b h n dh
        if state is not None:  # the cache keeps its dtype (the wider of the two, as before)
            k, v = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)  # b h (t + n) dh
        kq, vq = k.to(q.dtype), v.to(q.dtype)  # attended in the queries' dtype (a cache of another dtype)
        if start == 0:
            y = F.scaled_dot_product_attention(q, kq, vq, is_causal=True)  # b h n dh
        else:  # query i sees the cache and the new positions up to its own
            n, t = q.shape[2], k.shape[2]
            mask = torch.ones(n, t, dtype=torch.bool, device=x.device).tril(t - n)  # n t
            y = F.scaled_dot_product_attention(q, kq, vq, attn_mask=mask)  # b h n dh
        out = self.proj(y.transpose(1, 2).flatten(2))  # b n d
        # the cache receives no gradient, as the lambda layers' states (truncated backprop across calls)
        return (out, {"k": k.detach(), "v": v.detach()}) if return_state else out

    def step(self, state: dict[str, Tensor], x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One position: ``x [b, dim]`` after the cache ``state`` -> ``([b, dim], the cache one position longer)``
        (the earlier order ``step(x, state)`` still works for one release, with a warning)."""
        state, x = step_arguments(state, x, "CausalSelfAttention.step")
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[-1] != self.dim or not x.is_floating_point():
            got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating-point tensor [batch, dim={self.dim}], got {got}")
        out, state = self.forward(x.unsqueeze(1), state, return_state=True)
        return out[:, 0], state

    def _check_state(self, state, x: Tensor) -> int:
        """A one-line ``ValueError`` unless ``state`` is a KV cache for ``x`` (:meth:`init_state`'s keys; ``[b,
        heads, t, dim / heads]`` floating-point tensors on ``x``'s device); returns its length ``t``."""
        want = (x.shape[0], self.heads, self.dim // self.heads)
        k, v = (state.get(key) if isinstance(state, dict) else None for key in ("k", "v"))
        if not isinstance(k, Tensor) or not isinstance(v, Tensor):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be this layer's KV cache (keys ['k', 'v']: init_state, or a returned "
                             f"state), got {got}")  # fmt: skip
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want or t.shape[2] != k.shape[2]:
                raise ValueError(f"state['{name}'] must be [batch={want[0]}, heads={want[1]}, length, "
                                 f"{want[2]}] (as long as the other), got {tuple(t.shape)}")  # fmt: skip
            if not t.is_floating_point() or t.device != x.device:
                raise ValueError(f"state['{name}'] must be a floating-point tensor on {x.device}, got {t.dtype} on "
                                 f"{t.device}")  # fmt: skip
        return k.shape[2]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}, rotary={self.rotary}"
