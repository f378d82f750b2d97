"""timm's feature interface, shared by every image backbone (:class:`lambdanet.models.base.Backbone`).

A backbone's feature maps are numbered as timm numbers them: index 0 is the stem's last map at stride 2 (stride 1
with the ``cifar`` stem), indices 1..4 the outputs of the stages c2..c5 (strides 4, 8, 16, 32). ``out_indices``
and :meth:`~lambdanet.models.base.Backbone.forward_intermediates`' ``indices`` select among them;
:class:`FeatureInfo` describes them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FeatureInfo", "feature_take_indices", "STAGE_INDICES"]

STAGE_INDICES = (1, 2, 3, 4)  # c2..c5: the maps a features_only model returns unless out_indices says otherwise


def feature_take_indices(num_features: int, indices: int | Sequence[int] | None = None) -> tuple[list[int], int]:
    """timm's selection of feature maps: ``None`` all ``num_features``, an int ``n`` the last ``n``, a sequence
    those indices (negative ones count from the end). Returns (the absolute indices, the largest); a one-line
    ``ValueError`` for an index out of range."""
    if indices is None:
        indices = num_features
    if isinstance(indices, bool) or not isinstance(indices, (int, Sequence)) or isinstance(indices, str):
        raise ValueError(f"indices must be an int (the last n maps), a sequence of ints or None, got {indices!r}")
    if isinstance(indices, int):
        if not 0 < indices <= num_features:
            raise ValueError(f"indices (the last n feature maps) must be in 1..{num_features}, got {indices}")
        take = list(range(num_features - indices, num_features))
    else:
        take = []
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not -num_features <= i < num_features:
                raise ValueError(
                    f"feature indices must be ints in {-num_features}..{num_features - 1} (0: the stem's stride-2 "
                    f"map, 1..{num_features - 1}: the stages), got {list(indices)!r}"
                )
            take.append(i % num_features)
        if not take:
            raise ValueError("feature indices must name at least one feature map, got an empty sequence")
    return take, max(take)


class FeatureInfo(list):
    """The feature maps of a backbone in timm's ``FeatureInfo`` interface: ``channels()``, ``reduction()`` and
    ``module_name()`` of the selected maps (``out_indices``), or with ``idx`` of any map by its index (timm's
    numbering: :data:`STAGE_INDICES` and the stem's map 0); :attr:`info` holds every map's dict.

    It is also the list of the selected maps' dicts (``num_chs``, ``reduction``, ``module``, ``stage``), which
    is what iterating, ``len`` and ``[i]`` give: a model's c2..c5 unless ``out_indices`` chose others (timm's
    ``FeatureInfo`` indexes every map there instead)."""

    def __init__(self, info: Sequence[dict], out_indices: Sequence[int] = STAGE_INDICES):
        self.info = [dict(d, index=i) for i, d in enumerate(info)]
        self.out_indices = tuple(out_indices)
        super().__init__(self.info[i] for i in self.out_indices)

    def from_other(self, out_indices: Sequence[int]) -> FeatureInfo:
        """The same maps with another selection."""
        return FeatureInfo(self.info, out_indices)

    def get(self, key: str, idx: int | Sequence[int] | None = None):
        """``key`` of the selected maps (``idx`` ``None``), of map ``idx`` (an int) or of maps ``idx``."""
        if idx is None:
            return [self.info[i][key] for i in self.out_indices]
        if isinstance(idx, int):
            return self.info[idx][key]
        return [self.info[i][key] for i in idx]

    def get_dicts(self, keys: Sequence[str] | None = None, idx: int | Sequence[int] | None = None):
        """The dicts (restricted to ``keys``) of the selected maps, of map ``idx`` or of maps ``idx``."""
        chosen = self.out_indices if idx is None else idx
        if isinstance(chosen, int):
            return self.info[chosen] if keys is None else {k: self.info[chosen][k] for k in keys}
        return [self.info[i] if keys is None else {k: self.info[i][k] for k in keys} for i in chosen]

    def channels(self, idx: int | Sequence[int] | None = None):
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None):
        return self.get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None):
        return self.get("module", idx)
