"""What every classification backbone here shares: the pooled linear head and timm's feature interface
(``features_only`` / ``out_indices``, ``forward_intermediates``, ``prune_intermediate_layers``,
``set_grad_checkpointing``, ``group_matcher``, ``no_weight_decay``)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lambdanet.helpers import check_number
from lambdanet.layers import AbsolutePositionEmbedding, LambdaLayer, RelativePositionEmbedding
from lambdanet.layers.relative_position import RelativePosition1d, RelativePosition2d
from lambdanet.models.features import STAGE_INDICES, FeatureInfo, feature_take_indices

__all__ = ["Backbone", "POSITION_MODULES", "image_size", "is_block_list"]

# the modules whose parameters are position embeddings or relative-position tables (no weight decay)
POSITION_MODULES = (RelativePositionEmbedding, AbsolutePositionEmbedding, RelativePosition2d, RelativePosition1d)


def image_size(img_size, default) -> tuple[int, int]:
    """The input size ``(H, W)`` a model is built for: ``img_size`` (an int or ``(H, W)`` of positive ints; ``None``:
    ``default``), else a one-line ``ValueError`` naming ``img_size``."""
    img = default if img_size is None else img_size
    pair = (img, img) if isinstance(img, Integral) else tuple(img) if isinstance(img, Sequence) else ()
    if len(pair) != 2 or any(not isinstance(s, Integral) or isinstance(s, bool) or s <= 0 for s in pair):
        raise ValueError(f"img_size must be a positive int or (H, W), got {img_size!r}")
    return int(pair[0]), int(pair[1])


def is_block_list(value) -> bool:
    """Whether ``value`` is a sequence of ints (a model's list of 1-indexed blocks)."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(b, Integral) and not isinstance(b, bool) for b in value)
    )


if TYPE_CHECKING:

    class _ZeroInitLast(Protocol):
        def zero_init_last(self) -> None: ...


class Backbone(nn.Module):
    """Subclasses build their trunk and call :meth:`_init_head` with the dicts of their feature maps in timm's
    numbering (:mod:`lambdanet.models.features`: the stem's stride-2 map, then c2..c5). The default trunk is
    ``stem`` (its first ``stem_split`` children end at the stride-2 map; 0: the whole stem does), ``stages``
    and ``final_conv`` (part of the last feature map where ``final_conv_in_features``, else applied after it);
    a subclass with another layout overrides :meth:`_trunk`, :meth:`_blocks`, :meth:`_prune_trunk` and
    :meth:`group_matcher`."""

    num_features: int
    pooled: bool  # global average pooling before the classifier (off: reset_classifier(0, ""))
    feature_info: FeatureInfo
    grad_checkpointing: bool = False
    stem_split: int = 0
    final_conv_in_features: bool = False
    if TYPE_CHECKING:  # the default trunk's parts, set by the subclasses that use it (typing only: torch.jit reads
        # class annotations)
        stem: nn.Module
        stages: nn.Sequential
        final_conv: nn.Module

    def _init_head(
        self,
        num_features: int,
        num_classes: int,
        drop_rate: float,
        features_only: bool,
        *,
        info: Sequence[dict],
        out_indices: int | Sequence[int] | None = None,
    ) -> None:
        check_number(drop_rate, "drop_rate", 0, 1, high_open=True)
        if out_indices is not None and not features_only:
            raise ValueError(
                f"out_indices selects the feature maps a features_only model returns: pass features_only=True "
                f"with out_indices={out_indices!r}"
            )
        chosen = STAGE_INDICES if out_indices is None else sorted(set(feature_take_indices(len(info), out_indices)[0]))
        self.feature_info = FeatureInfo(info, chosen)
        self.num_features, self.num_classes = num_features, num_classes
        self.features_only, self.drop_rate, self.pooled = features_only, drop_rate, True
        self.head_drop = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()
        self.fc = nn.Linear(num_features, num_classes) if num_classes > 0 and not features_only else nn.Identity()

    def _init_norms(self, block_type: type[nn.Module], zero_init_last: bool) -> None:
        """Every BatchNorm at identity (weight 1, bias 0); with ``zero_init_last`` every ``block_type`` block
        zeroes its last BatchNorm (``zero_init_last()``), so its residual branch starts at zero."""
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_last:
            for m in self.modules():
                if isinstance(m, block_type):
                    cast("_ZeroInitLast", m).zero_init_last()

    # ------------------------------------------------------------------------------------------ the trunk

    def _trunk(self) -> tuple[list[list[nn.Module]], list[nn.Module]]:
        """(segments, tail): segment ``i`` runs from feature map ``i - 1`` (or the input) to map ``i``; the tail
        turns the last map into :meth:`forward_features`' map. Stages pruned away have no segment."""
        stem = list(cast(nn.Sequential, self.stem)) if self.stem_split else [self.stem]
        k = self.stem_split or 1
        segments, rest = [stem[:k]], stem[k:]
        for stage in self.stages:
            segments.append([*rest, stage])
            rest = []
        if self.final_conv_in_features:
            segments[-1].append(self.final_conv)
            return segments, rest
        return segments, rest + [self.final_conv]

    def _blocks(self) -> list[nn.Module]:
        """The residual blocks, which :meth:`set_grad_checkpointing` recomputes in the backward pass."""
        return [block for stage in self.stages for block in cast(nn.Sequential, stage)]

    def _prune_trunk(self, last: int) -> None:
        """Drop what only the feature maps after map ``last`` need."""
        self.stages = self.stages[:last]
        if last < len(self.feature_info.info) - 1:
            self.final_conv = nn.Identity()

    def _run(self, modules: Sequence[nn.Module], x: Tensor, blocks: set[int] | None) -> Tensor:
        """``modules`` one after the other; with ``blocks`` (checkpointing) those blocks are checkpointed, and a
        ``Sequential`` holding some (at any depth) is run child by child."""
        for m in modules:
            if blocks is not None and id(m) in blocks:
                x = checkpoint(m, x, use_reentrant=False)
            elif blocks is not None and isinstance(m, nn.Sequential) and any(id(c) in blocks for c in m.modules()):
                x = self._run(list(m), x, blocks)
            else:
                x = m(x)
        return x

    def _checkpointed(self) -> set[int] | None:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return {id(m) for m in self._blocks()}
        return None

    # ------------------------------------------------------------------------------- timm's model interface

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each residual block's activations in the backward pass instead of keeping them (timm's
        method): less memory, one more forward of every block. (BatchNorm's running statistics then also see
        each training batch twice, as in timm.)"""
        self.grad_checkpointing = bool(enable)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise learning-rate decay, in timm's format (``timm.models.group_parameters``
        reads it): the stem, then one group per block (``coarse``: per stage) in depth order, ``final_conv``
        after them; the classifier, unmatched, comes last."""
        blocks = r"^stages\.(\d+)" if coarse else r"^stages\.(\d+)\.(\d+)"
        return {"stem": r"^stem", "blocks": [(blocks, None), (r"^final_conv", (99999,))]}

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters that take no weight decay (timm's method, which its optimiser factory and
        :func:`lambdanet.engine.optim.param_groups` read): position embeddings and relative-position tables,
        and the lambda convolutions' position biases."""
        names = set()
        for prefix, module in self.named_modules():
            if isinstance(module, POSITION_MODULES):
                names |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
            elif isinstance(module, LambdaLayer) and module.position_bias is not None:
                names.add(f"{prefix}.position_bias")
        return names

    def get_classifier(self) -> nn.Module:
        """The classifier (timm's interface): ``fc``, an ``nn.Identity`` when there is none."""
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a fresh one with ``num_classes`` outputs (0: no classifier); timm's
        ``global_pool``: ``"avg"`` global average pooling, ``""`` none (with ``num_classes=0``: :meth:`forward`
        returns the last feature map, as after :meth:`prune_intermediate_layers`), ``None`` the pooling as it is.
        ``pretrained_cfg`` follows (its ``num_classes``; its ``classes`` no longer apply)."""
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0:
            raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
        if global_pool not in (None, "avg", ""):
            raise ValueError(
                f"global_pool must be 'avg' (global average pooling, the only one) or '' (none), got {global_pool!r}"
            )
        if global_pool == "" and num_classes:
            raise ValueError(f"global_pool '' (no pooling) needs num_classes=0 (no classifier), got {num_classes}")
        if global_pool is not None:
            self.pooled = global_pool == "avg"
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        cfg = getattr(self, "pretrained_cfg", None)
        if cfg is not None and cfg.get("num_classes") != num_classes:
            cfg.update(num_classes=num_classes, classes=None)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's ``forward_intermediates``: the feature maps ``indices`` (``None`` all, an int the last ``n``, a
        sequence those, in timm's numbering: :mod:`lambdanet.models.features`) and, unless
        ``intermediates_only``, :meth:`forward_features`' map. ``stop_early`` runs the trunk only up to the last
        map asked for (the final map is then that one). ``norm`` has nothing to apply (no final norm layer here);
        ``output_fmt`` must be ``"NCHW"``."""
        if output_fmt != "NCHW":
            raise ValueError(
                f"output_fmt must be 'NCHW' (the only layout of these convolutional maps), got {output_fmt!r}"
            )
        take, last = feature_take_indices(len(self.feature_info.info), indices)
        segments, tail = self._trunk()
        ran_all = not stop_early or last + 1 >= len(segments)
        blocks, out = self._checkpointed(), []
        for i, segment in enumerate(segments if ran_all else segments[: last + 1]):
            x = self._run(segment, x, blocks)
            if i in take:
                out.append(x)
        if intermediates_only:
            return out
        return (self._run(tail, x, None) if ran_all else x), out

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's ``prune_intermediate_layers``: remove the layers after the last feature map of ``indices`` (and
        with ``prune_head`` the classifier, and a ``final_conv`` that follows the feature maps); returns the
        absolute indices. ``prune_norm`` has no norm layer to remove."""
        take, last = feature_take_indices(len(self.feature_info.info), indices)
        self._prune_trunk(last)
        if prune_head:  # timm's: forward then returns the last map kept
            self.reset_classifier(0, "")
            if not self.final_conv_in_features:
                self.final_conv = nn.Identity()
        return take

    def forward_stages(self, x: Tensor) -> list[Tensor]:
        """The feature maps c2..c5 (strides 4, 8, 16, 32 with the ImageNet stems)."""
        return cast(
            "list[Tensor]", self.forward_intermediates(x, STAGE_INDICES, stop_early=True, intermediates_only=True)
        )

    def forward_features(self, x: Tensor) -> Tensor:
        """The last feature map (after ``final_conv``), before pooling."""
        return self._run([self.stem, self.stages, self.final_conv], x, self._checkpointed())

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pooled features ``[b, num_features]`` (``pre_logits``) or logits from :meth:`forward_features`' map
        (the map itself where the pooling is off: ``reset_classifier(0, "")``)."""
        x = self.head_drop(x.mean(dim=(2, 3)) if self.pooled else x)
        return x if pre_logits else self.fc(x)

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:
        if self.features_only:
            indices = self.feature_info.out_indices
            return cast(
                "list[Tensor]", self.forward_intermediates(x, indices, stop_early=True, intermediates_only=True)
            )
        return self.forward_head(self.forward_features(x))
