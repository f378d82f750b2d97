"""Content-only linear attention baselines of LambdaNetworks Table 3 ("conv + linear attention").

* :class:`EfficientAttention` (Shen et al. 2018): ``softmax_channels(Q) (softmax_positions(K)^T V)``, per head,
  then a 1x1 re-projection and a residual connection. It is a content-only lambda layer (App. C.3): the
  context ``softmax(K)^T V`` is a ``k x v`` lambda shared by every query.
* :class:`DoubleAttention` (A^2-Nets, Chen et al. 2018): gather ``G = A softmax_n(B)^T`` (``c_m x c_n``
  global descriptors), distribute ``Z = G softmax_{c_n}(V)``, re-project, residual.
* :class:`ConvPlusAttention`: the drop-in spatial layer, a 3x3 convolution (with the stride) then one of these.

Complexities (``n`` positions, ``d`` channels): efficient attention time ``Theta(b n k v / h)``, space
``Theta(b k v / h + b n d)``; double attention time ``Theta(b n c_m c_n)``, space ``Theta(b c_m c_n + b n d)``.
Neither forms an ``n x n`` map. Softmaxes and context products run in :func:`compute_dtype`.
"""

from __future__ import annotations

from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_input, check_positive_int, compute_dtype
from lambdanet.layers.conv import ConvLayer

__all__ = ["EfficientAttention", "DoubleAttention", "ConvPlusAttention"]


class EfficientAttention(nn.Module):
    """Efficient attention (Shen et al. 2018) with a residual connection, on ``[B, C, H, W]``.

    Args:
        dim: channels ``C`` (input = output).
        dim_k: total key/query channels (default ``C // 2``).
        dim_v: total value channels (default ``C // 2``).
        heads: heads; must divide ``dim_k`` and ``dim_v``.
    """

    def __init__(self, dim: int, dim_k: int | None = None, dim_v: int | None = None, heads: int = 4):
        super().__init__()
        check_positive_int(dim, "dim")
        check_positive_int(heads, "heads")
        dim_k = max(heads, dim // 2) if dim_k is None else dim_k
        dim_v = max(heads, dim // 2) if dim_v is None else dim_v
        for name, val in (("dim_k", dim_k), ("dim_v", dim_v)):
            check_positive_int(val, name)
        if dim_k % heads or dim_v % heads:
            raise ValueError(f"heads={heads} must divide dim_k={dim_k} and dim_v={dim_v}")
        self.dim, self.dim_k, self.dim_v, self.heads = dim, dim_k, dim_v, heads
        self.qkv = nn.Conv2d(dim, 2 * dim_k + dim_v, 1)
        self.proj = nn.Conv2d(dim_v, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        (b, _, hh, ww), h = x.shape, self.heads
        qkv = self.qkv(x).flatten(2)  # b c n
        q, k, v = qkv.to(compute_dtype(qkv.dtype)).split([self.dim_k, self.dim_k, self.dim_v], dim=1)  # b c n
        n = hh * ww  # explicit (not -1): an empty batch reshapes too
        q = q.reshape(b, h, self.dim_k // h, n).softmax(dim=2)  # b h k n (over channels)
        k = k.reshape(b, h, self.dim_k // h, n).softmax(dim=3)  # b h k n (over positions)
        v = v.reshape(b, h, self.dim_v // h, n)  # b h v n
        context = k @ v.transpose(-1, -2)  # b h k v
        out = context.transpose(-1, -2) @ q  # b h v n
        out = out.reshape(b, self.dim_v, hh, ww).to(x.dtype)
        return x + self.proj(out)


class DoubleAttention(nn.Module):
    """Double attention block (A^2-Nets, Chen et al. 2018) with a residual connection.

    Args:
        dim: channels ``C`` (input = output).
        c_m: gathered feature depth (default ``C // 2``).
        c_n: number of global descriptors (default ``C // 2``).
    """

    def __init__(self, dim: int, c_m: int | None = None, c_n: int | None = None):
        super().__init__()
        check_positive_int(dim, "dim")
        c_m = max(1, dim // 2) if c_m is None else c_m
        c_n = max(1, dim // 2) if c_n is None else c_n
        for name, val in (("c_m", c_m), ("c_n", c_n)):
            check_positive_int(val, name)
        self.dim, self.c_m, self.c_n = dim, c_m, c_n
        self.conv_abv = nn.Conv2d(dim, c_m + 2 * c_n, 1)  # A | B | V
        self.proj = nn.Conv2d(c_m, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.dim, 2, self)
        b, _, hh, ww = x.shape
        abv = self.conv_abv(x).flatten(2)  # b c n
        a, bm, v = abv.to(compute_dtype(abv.dtype)).split([self.c_m, self.c_n, self.c_n], dim=1)  # b c n
        gathered = a @ bm.softmax(dim=-1).transpose(1, 2)  # b c_m c_n: second-order attention pooling
        z = gathered @ v.softmax(dim=1)  # b c_m n: distribute to every position
        return x + self.proj(z.view(b, self.c_m, hh, ww).to(x.dtype))


class ConvPlusAttention(nn.Module):
    """A 3x3 convolution (carrying the stride) followed by a residual attention module on its output."""

    def __init__(self, dim: int, dim_out: int | None, attention: str, *, stride: int = 1, **kwargs):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        check_positive_int(stride, "stride")
        check_choice(attention, "attention", ("efficient", "double"))
        self.conv = ConvLayer(dim, dim_out, stride=stride)
        self.attn = (EfficientAttention if attention == "efficient" else DoubleAttention)(dim_out, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(self.conv(x))
