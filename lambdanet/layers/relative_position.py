"""Factorised 2-d relative position logits and the softmax attention of the self-attention baselines.

Bello et al. 2019 (attention augmentation, BoTNet): ``logit(n, m) = q_n . (k_m + r^H_{a-i} + r^W_{c-j})`` with
full-depth height and width tables. SASA (Ramachandran et al. 2019) and HaloNet give half of each head's channels
to each axis: ``q_n[:d/2] . r^H_{a-i} + q_n[d/2:] . r^W_{c-j}``. Tables are shared by all heads (HaloNet App. A);
initialisation ``N(0, d^-1/2)``.

Every baseline (global, local / halo, axial) computes ``softmax(q k^T d^-1/2 + logits_rel) v`` (Vaswani et al.
2017 with additive relative logits, Shaw et al. 2018) through :func:`attend`, the one place that picks the kernel:

* ``"math"`` (:func:`attend_math`): the readable reference, matmul + softmax in :func:`compute_dtype`;
* ``"sdpa"`` (:func:`attend_sdpa`): ``F.scaled_dot_product_attention`` with the relative logits and the mask in
  one additive ``attn_mask``; on CUDA its fused kernels never write the ``n x m`` softmax to memory.

:func:`auto_attention_impl` (the tuning policy) picks one unless the caller passes ``impl`` or a
:func:`use_attention_impl` block forces one (tests, GPU comparisons).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lambdanet.helpers import assume_constant_result, check_choice, compute_dtype

__all__ = [
    "RelativePosition2d",
    "RelativePosition1d",
    "ATTENTION_IMPLS",
    "HALF_DTYPES",
    "SDPA_DEVICE_TYPES",
    "SDPA_TRAINING_BACKENDS",
    "auto_attention_impl",
    "attention_impl",
    "use_attention_impl",
    "attend",
    "attend_math",
    "attend_sdpa",
    "half_reductions_allowed",
]


class RelativePosition2d(nn.Module):
    """Relative position logits factorised over height and width.

    Args:
        max_offset: largest ``|offset|`` per axis ``(oh, ow)``: tables hold ``2 o + 1`` entries.
        dim_head: query depth per head ``d``.
        split: ``"full"`` (both tables ``d`` deep, Bello 2019) or ``"half"`` (``d/2`` per axis, SASA / HaloNet).
    """

    def __init__(self, max_offset: tuple[int, int], dim_head: int, split: str = "full"):
        super().__init__()
        check_choice(split, "split", ("full", "half"))
        if split == "half" and dim_head < 2:
            raise ValueError(f"split='half' needs dim_head >= 2, got dim_head={dim_head}")
        self.max_offset = tuple(int(o) for o in max_offset)
        self.dim_head, self.split = dim_head, split
        dh, dw = (dim_head, dim_head) if split == "full" else (dim_head // 2, dim_head - dim_head // 2)
        self.rel_h = nn.Parameter(torch.randn(2 * self.max_offset[0] + 1, dh) * dim_head**-0.5)
        self.rel_w = nn.Parameter(torch.randn(2 * self.max_offset[1] + 1, dw) * dim_head**-0.5)

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}, dim_head={self.dim_head}, split={self.split!r}"

    def tables(self, q_coords: tuple[Tensor, Tensor], k_coords: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Gather ``T_h[i, a] = r^H[k_a - q_i]`` and ``T_w[j, c]``; offsets beyond the table are clipped to its
        last entry (Shaw et al.; the keys there are not masked)."""
        (qh, qw), (kh, kw) = q_coords, k_coords
        oh, ow = self.max_offset
        idx_h = (kh[None, :] - qh[:, None] + oh).clamp(0, 2 * oh)  # Qh Kh
        idx_w = (kw[None, :] - qw[:, None] + ow).clamp(0, 2 * ow)  # Qw Kw
        return self.rel_h[idx_h], self.rel_w[idx_w]  # Qh Kh dh, Qw Kw dw

    def forward(self, q: Tensor, q_coords: tuple[Tensor, Tensor], k_coords: tuple[Tensor, Tensor]) -> Tensor:
        """Relative logits ``[..., Qh, Qw, Kh, Kw]`` of queries ``q[..., Qh, Qw, d]`` at ``q_coords``, keys at
        ``k_coords``."""
        t_h, t_w = self.tables(q_coords, k_coords)
        dh = t_h.shape[-1]
        q_h, q_w = (q, q) if self.split == "full" else (q[..., :dh], q[..., dh:])
        l_h = torch.einsum("...ijd,iad->...ija", q_h, t_h)  # ... Qh Qw Kh
        l_w = torch.einsum("...ijd,jcd->...ijc", q_w, t_w)  # ... Qh Qw Kw
        return l_h.unsqueeze(-1) + l_w.unsqueeze(-2)  # ... Qh Qw Kh Kw


ATTENTION_IMPLS = ("auto", "math", "sdpa")
"""Values of ``impl``: ``"auto"`` defers to :func:`auto_attention_impl`."""

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Half-precision input dtypes: ``"auto"`` picks SDPA for them on every device."""

SDPA_DEVICE_TYPES = ("cuda",)
"""Device types on which ``"auto"`` picks SDPA for float32 / float64 inputs (see :func:`auto_attention_impl`)."""

SDPA_TRAINING_BACKENDS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""The SDPA kernels :func:`attend_sdpa` allows on CUDA when a gradient is needed. cuDNN attention is left out: it
has no gradient for ``attn_mask`` (a bias that requires grad raises "not differentiable with respect to argument
'attn_bias'"), and with a mask its backward can return NaN query gradients (pytorch#196678). Flash attention takes
no ``attn_mask`` at all. The memory-efficient kernel needs head depths that are multiples of 4 (float32) or 8
(half precision), else SDPA falls back to its math backend. Inference keeps SDPA's own choice (cuDNN first on
H100 with a recent cuDNN)."""

_forced_impl = "auto"  # set by use_attention_impl


def auto_attention_impl(device: torch.device | str, dtype: torch.dtype) -> str:
    """The attention policy: which implementation ``impl="auto"`` runs for inputs on ``device`` of ``dtype``.

    * ``"sdpa"`` on the devices of :data:`SDPA_DEVICE_TYPES` (CUDA): the fused kernels are the fair attention
      baseline on a GPU (no ``b h n m`` logits, softmax and attention tensors in memory).
    * ``"sdpa"`` for float16 / bfloat16 inputs on any device: SDPA accumulates ``q k^T`` in float32, where the
      math path rounds the logits to half precision before its float32 softmax.
    * ``"math"`` otherwise (float32 / float64 on CPU): the code the CPU benchmarks measured. This rule is not
      the result of a timing study; change it here, and only here, when a measurement says otherwise.

    FlexAttention is not used: off CUDA it needs ``torch.compile``, and its gain (adding the factorised
    ``l_h + l_w`` relative logits in a ``score_mod`` instead of materialising the bias) has not been measured.
    """
    return "sdpa" if torch.device(device).type in SDPA_DEVICE_TYPES or dtype in HALF_DTYPES else "math"


def attention_impl(q: Tensor, impl: str = "auto") -> str:
    """The implementation :func:`attend` runs for queries ``q``: ``impl`` if it names one, else the one forced
    by an enclosing :func:`use_attention_impl`, else :func:`auto_attention_impl`."""
    check_choice(impl, "impl", ATTENTION_IMPLS)
    if impl == "auto":
        impl = _forced_impl
    return auto_attention_impl(q.device, q.dtype) if impl == "auto" else impl


@contextlib.contextmanager
def use_attention_impl(impl: str) -> Iterator[None]:
    """Run every :func:`attend` called with ``impl="auto"`` (every attention layer) inside the block with ``impl``
    (``"math"``, ``"sdpa"`` or ``"auto"``). Process-wide, not thread-local; read when a layer runs, so
    ``torch.jit.trace`` / ``torch.export`` record the implementation in force while tracing."""
    global _forced_impl
    check_choice(impl, "impl", ATTENTION_IMPLS)
    previous, _forced_impl = _forced_impl, impl
    try:
        yield
    finally:
        _forced_impl = previous


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    scale: float = 1.0,
    impl: str = "auto",
) -> Tensor:
    """Softmax attention ``softmax(q k^T scale + bias, masked) v`` by the implementation :func:`attention_impl`
    picks (``impl``: one of :data:`ATTENTION_IMPLS`). ``q [..., Nq, d]``, ``k [..., Nk, d]``, ``v [..., Nk, dv]``
    (same leading dims), ``bias`` and ``mask`` (True = keep) broadcastable to ``[..., Nq, Nk]``. A query row with
    no key left gives the uniform average of all values (finite, zero gradient to its query and bias)."""
    if attention_impl(q, impl) == "sdpa":
        return attend_sdpa(q, k, v, bias, mask, scale)
    return attend_math(q, k, v, bias, mask, scale)


def attend_math(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None, scale: float = 1.0
) -> Tensor:
    """The reference implementation of :func:`attend`. Logits and softmax run in :func:`compute_dtype` (``q k^T``
    itself is a matmul in the input dtype). Masked keys get the most negative finite logit, so a row with no
    valid key gives a uniform (finite) average instead of NaN."""
    logits = q @ k.transpose(-1, -2)  # ... Nq Nk
    dtype = compute_dtype(logits.dtype)
    logits = logits.to(dtype) * scale
    if bias is not None:
        logits = logits + bias.to(dtype)
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(dtype).min)
    attn = logits.softmax(dim=-1).to(v.dtype)
    return attn @ v  # ... Nq dv


@assume_constant_result  # torch.compile reads the switch while tracing (no graph break)
def half_reductions_allowed() -> bool:
    """Whether SDPA's math backend may reduce float16 / bfloat16 inputs in half precision (the
    ``allow_fp16_bf16_reduction_math_sdp`` switch; torch versions without it always did)."""
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    return True if allowed is None else bool(allowed())


def attend_sdpa(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None, mask: Tensor | None = None, scale: float = 1.0
) -> Tensor:
    """:func:`attend_math`'s function through ``F.scaled_dot_product_attention``.

    * ``bias`` and ``mask`` become one additive ``attn_mask`` in the query dtype (the memory-efficient kernel
      requires it; cuDNN before pytorch#191612 misread a float32 mask given with half queries): ``bias`` where
      the mask keeps a key, ``-inf`` where it drops one (an exact zero weight, as in math).
    * A query row with no key left would be ``-inf`` throughout (NaN or zeros, depending on the kernel). Its
      query and ``attn_mask`` row are set to zero instead: every logit is 0, the output is the uniform average
      of all values and its query and bias get no gradient, exactly as in math.
    * Leading dims are flattened to ``[B, rest, N, d]``: the fused kernels take 4-d inputs only.
    * Precision: float32 / float64 inputs are computed in their own dtype (float64 on CPU, the math backend,
      agrees with :func:`attend_math` to rounding). For float16 / bfloat16 the fused kernels keep the logits
      and the softmax in float32 accumulators and SDPA's math backend upcasts to float32, unless
      ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` was set (it applies on CPU too): then the
      inputs are upcast here, so the softmax is never computed in half precision.
    * With a gradient needed on CUDA, the kernels are limited to :data:`SDPA_TRAINING_BACKENDS`.
    """
    dtype, lead, nq, nk = q.dtype, q.shape[:-2], q.shape[-2], k.shape[-2]
    attn_mask = None if bias is None else bias.to(dtype)
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)  # ... Nq 1
        fill = torch.where(has_key, -math.inf, 0.0).to(dtype)  # ... Nq 1
        attn_mask = torch.where(mask, 0.0 if attn_mask is None else attn_mask, fill)  # ... Nq Nk
        q = q.masked_fill(~has_key, 0.0)  # ... Nq d
    if q.dim() != 4:  # [*lead, N, d] -> [B, rest, N, d]
        lead4 = (lead[0], math.prod(lead[1:])) if lead else (1, 1)
        q, k, v = (t.reshape(*lead4, *t.shape[-2:]) for t in (q, k, v))
        if attn_mask is not None:
            attn_mask = attn_mask.expand(*lead, nq, nk).reshape(*lead4, nq, nk)
    upcast = dtype in HALF_DTYPES and half_reductions_allowed()
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        attn_mask = None if attn_mask is None else attn_mask.float()
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))
    kernels = sdpa_kernel(list(SDPA_TRAINING_BACKENDS)) if needs_grad and q.is_cuda else contextlib.nullcontext()
    # autocast would cast the upcast inputs straight back to half precision
    autocast = torch.autocast(q.device.type, enabled=False) if upcast else contextlib.nullcontext()
    with kernels, autocast:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # B rest Nq dv
    return out.to(dtype).reshape(*lead, nq, v.shape[-1])  # ... Nq dv


class RelativePosition1d(nn.Module):
    """Relative position logits along one axis: ``q_i . r[a - i]`` with a ``2 o + 1``-entry table."""

    def __init__(self, max_offset: int, dim_head: int):
        super().__init__()
        self.max_offset, self.dim_head = int(max_offset), dim_head
        self.rel = nn.Parameter(torch.randn(2 * self.max_offset + 1, dim_head) * dim_head**-0.5)

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}, dim_head={self.dim_head}"

    def forward(self, q: Tensor) -> Tensor:
        """``q [..., L, d]`` -> logits ``[..., L, L]`` (queries and keys on the same axis)."""
        pos = torch.arange(q.shape[-2], device=q.device)
        idx = (pos[None, :] - pos[:, None] + self.max_offset).clamp(0, 2 * self.max_offset)  # L L
        return torch.einsum("...id,iad->...ia", q, self.rel[idx])  # ... L L
