"""Position embeddings of the lambda layer (paper Sec. 3.3, App. E.1).

* :class:`RelativePositionEmbedding`: a table ``R[g, k, u, *K]`` over relative offsets; re-indexed into
  ``E[n, m] = R[offset(m - n)]`` it makes position interactions translation equivariant. ``K`` per axis: ``r``
  for a local scope (lambda convolution), ``2 s - 1`` for a global context of size ``s``; causal: offsets ``<= 0``.
* :class:`AbsolutePositionEmbedding`: one embedding per (query, context) pair, ``E[g, k, u, n, m]``, as in Fig. 3
  taken literally; it needs a fixed ``feat_size`` and is not translation equivariant.

One instance may be handed to several :class:`~lambdanet.layers.LambdaLayer` s to share the embeddings (Table 4
"shared embeddings", App. A): they are then a single parameter. Initialisation: ``E ~ N(0, 1)`` (App. E.1).

Both store their table flat (``weight``: ``[g k u, positions]``) and expose the shaped view as ``table``:
``Module.to(memory_format=torch.channels_last)`` restrides every 4-d parameter and rejects every 5-d one (a 2-d
table ``[g, k, u, r, r]`` is 5-d), so a model holding lambda layers could not be made channels_last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_positive_int, in_graph, to_ntuple

__all__ = ["RelativePositionEmbedding", "AbsolutePositionEmbedding"]


class _FlatTable(nn.Module):
    """A position table stored flat in ``weight``, seen through the shaped view ``table`` (module docstring). A
    ``weight`` saved shaped (lambdanet 0.1 pre-releases) is reshaped on load; other shapes fail in loading."""

    weight: nn.Parameter

    @property
    def table(self) -> Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=1.0)  # App. E.1: E ~ N(0, 1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        value = state_dict.get(prefix + "weight")
        if isinstance(value, Tensor) and value.shape == self.table.shape != self.weight.shape:
            state_dict[prefix + "weight"] = value.reshape(self.weight.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class RelativePositionEmbedding(_FlatTable):
    """Relative position embeddings ``R`` (paper Sec. 3.3).

    Args:
        dim_k: query/key depth ``|k|``.
        kernel_size: extent of the table per spatial axis (``r`` for a local scope, ``2 s - 1`` for a
            global context of size ``s``; ``s`` for a causal global context).
        dim_u: intra-depth ``|u|`` (App. B.4).
        groups: 1 for the multi-query layer, ``heads`` for the multi-head layer (Fig. 7).
        causal: the table holds offsets ``-(K - 1) .. 0`` only (its last entry is offset 0).
        feat_size: the global context the table was sized for (``None``: a local scope); larger inputs fail.

    Shape:
        ``table``: ``[groups, dim_k, dim_u, *kernel_size]``, a view of ``weight`` ``[g k u, prod(kernel_size)]``.
    """

    def __init__(
        self,
        dim_k: int,
        kernel_size: Sequence[int],
        *,
        dim_u: int = 1,
        groups: int = 1,
        causal: bool = False,
        feat_size: Sequence[int] | None = None,
    ):
        super().__init__()
        for name, val in (("dim_k", dim_k), ("dim_u", dim_u), ("groups", groups)):
            check_positive_int(val, name)
        kernel_size = tuple(int(s) for s in kernel_size)
        if not 1 <= len(kernel_size) <= 3:
            raise ValueError(f"kernel_size must have 1, 2 or 3 entries, got {kernel_size}")
        for s in kernel_size:
            check_positive_int(s, "kernel_size", odd=not causal)
        self.dim_k, self.dim_u, self.groups, self.causal = dim_k, dim_u, groups, causal
        self.kernel_size, self.spatial_dims = kernel_size, len(kernel_size)
        self.center = tuple(s - 1 if causal else s // 2 for s in kernel_size)
        self.feat_size = None if feat_size is None else tuple(int(s) for s in feat_size)
        self.weight = nn.Parameter(torch.empty(groups * dim_k * dim_u, math.prod(kernel_size)))  # (g k u) K
        self.reset_parameters()

    @property
    def table(self) -> Tensor:
        """``R[g, k, u, *K]`` (a view of ``weight``)."""
        return self.weight.view(self.groups, self.dim_k, self.dim_u, *self.kernel_size)  # g k u *K

    @classmethod
    def local(
        cls, dim_k: int, r: int, *, spatial_dims: int = 2, dim_u: int = 1, groups: int = 1, causal: bool = False
    ) -> RelativePositionEmbedding:
        """A local scope of ``r`` positions per axis (``r`` odd; causal: the ``r`` ending at the query)."""
        check_positive_int(r, "r", odd=not causal)
        return cls(dim_k, (r,) * spatial_dims, dim_u=dim_u, groups=groups, causal=causal)

    @classmethod
    def global_context(
        cls,
        dim_k: int,
        feat_size: int | Sequence[int],
        *,
        spatial_dims: int | None = None,
        dim_u: int = 1,
        groups: int = 1,
        causal: bool = False,
    ) -> RelativePositionEmbedding:
        """Every relative offset of a ``feat_size`` input: ``2 s - 1`` entries per axis (``s`` if causal)."""
        if spatial_dims is None:
            spatial_dims = (
                1 if isinstance(feat_size, int) and causal else (2 if isinstance(feat_size, int) else len(feat_size))
            )
        size = to_ntuple(feat_size, spatial_dims, "feat_size")
        for s in size:
            check_positive_int(s, "feat_size")
        kernel = tuple(s if causal else 2 * s - 1 for s in size)
        return cls(dim_k, kernel, dim_u=dim_u, groups=groups, causal=causal, feat_size=size)

    def embeddings(self, spatial: Sequence[int], dtype: torch.dtype | None = None) -> Tensor:
        """``E[g, k, u, n, m]`` for an input of size ``spatial`` (see ``functional.gather_relative_embeddings``),
        in ``dtype`` (default: the table's; a half-precision table is read in its layer's float32).

        On the CPU without autograd (inference) the result is cached while the table holds the same values: a copy
        of the table (``r^d k u`` numbers, far fewer than ``E``'s) is compared at each call, so writes the version
        counter does not see (``weight.data.mul_(...)``, as EMA teachers are often updated) rebuild it too;
        layers sharing this module share it. On a GPU, where the comparison would wait for the device, ``E`` is
        gathered at every call (one kernel), as in a trace, a compiled graph or a ``torch.func`` transform."""
        from lambdanet.functional import gather_relative_embeddings

        spatial, w = tuple(spatial), self.weight
        dtype = w.dtype if dtype is None else dtype
        if torch.is_grad_enabled() or in_graph() or w.device.type != "cpu":
            return gather_relative_embeddings(self.table.to(dtype), self.center, spatial)
        key = (w.dtype, dtype, spatial)
        cached = self.__dict__.get("_cache")  # (key, the table's values then, E)
        if cached is None or cached[0] != key or not torch.equal(cached[1], w):
            E = gather_relative_embeddings(self.table.detach().to(dtype), self.center, spatial)
            self.__dict__["_cache"] = cached = (key, w.detach().clone(), E)  # one entry: the last size used
        return cached[2]

    def extra_repr(self) -> str:
        scope = f"feat_size={self.feat_size}" if self.feat_size else f"scope={self.kernel_size}"
        return f"dim_k={self.dim_k}, dim_u={self.dim_u}, groups={self.groups}, {scope}, causal={self.causal}"


class AbsolutePositionEmbedding(_FlatTable):
    """Absolute per-(query, context) position embeddings ``E[g, k, u, n, m]`` (Fig. 3 taken literally).

    ``n * m * k * u * g`` parameters for a fixed ``feat_size``; inputs must have exactly that size.
    ``table`` is ``E`` ``[g, k, u, n, m]``, a view of the parameter ``weight`` ``[g * k * u, n * m]``.
    """

    def __init__(self, dim_k: int, feat_size: Sequence[int], *, dim_u: int = 1, groups: int = 1):
        super().__init__()
        for name, val in (("dim_k", dim_k), ("dim_u", dim_u), ("groups", groups)):
            check_positive_int(val, name)
        self.feat_size = tuple(int(s) for s in feat_size)
        for s in self.feat_size:
            check_positive_int(s, "feat_size")
        self.spatial_dims, self.dim_k, self.dim_u, self.groups = len(self.feat_size), dim_k, dim_u, groups
        self.n = n = math.prod(self.feat_size)
        self.weight = nn.Parameter(torch.empty(groups * dim_k * dim_u, n * n))  # (g k u) (n m)
        self.reset_parameters()

    @property
    def table(self) -> Tensor:
        """``E[g, k, u, n, m]`` (a view of ``weight``)."""
        return self.weight.view(self.groups, self.dim_k, self.dim_u, self.n, self.n)  # g k u n m

    def embeddings(self, causal: bool = False) -> Tensor:
        """``E[g, k, u, n, m]``; with ``causal`` the future ``m > n`` is masked to 0."""
        if not causal:
            return self.table
        mask = torch.ones(self.n, self.n, dtype=torch.bool, device=self.weight.device).tril()  # n m
        return self.table * mask  # g k u n m

    def extra_repr(self) -> str:
        return f"dim_k={self.dim_k}, dim_u={self.dim_u}, groups={self.groups}, feat_size={self.feat_size}"
