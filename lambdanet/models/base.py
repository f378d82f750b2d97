"""What every classification backbone here shares: the pooled linear head and the feature API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

from torch import Tensor, nn

__all__ = ["Backbone"]

if TYPE_CHECKING:

    class _ZeroInitLast(Protocol):
        def zero_init_last(self) -> None: ...


class Backbone(nn.Module):
    """Subclasses build their trunk (``stem``, ``stages``, ``final_conv``, or their own ``forward_stages`` (c2..c5
    feature maps) and ``forward_features`` (the last map before pooling)) and call :meth:`_init_head`."""

    num_features: int
    feature_info: list[dict]
    if TYPE_CHECKING:  # the default trunk's parts, set by the subclasses that use it (typing only: torch.jit reads
        # class annotations)
        stem: nn.Module
        stages: nn.Sequential
        final_conv: nn.Module

    def _init_head(self, num_features: int, num_classes: int, drop_rate: float, features_only: bool) -> None:
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        self.num_features, self.num_classes = num_features, num_classes
        self.features_only, self.drop_rate = features_only, drop_rate
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

    def get_classifier(self) -> nn.Module:
        """The classifier (timm's interface): ``fc``, an ``nn.Identity`` when there is none."""
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a fresh one with ``num_classes`` outputs (0: no classifier); the pooling is
        global average pooling (``global_pool`` ``None`` or ``"avg"``, timm's argument). ``pretrained_cfg`` follows
        (its ``num_classes``; its ``classes`` no longer apply)."""
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0:
            raise ValueError(f"num_classes must be a non-negative int, got {num_classes!r}")
        if global_pool not in (None, "avg"):
            raise ValueError(f"global_pool must be 'avg' (global average pooling, the only one), got {global_pool!r}")
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        cfg = getattr(self, "pretrained_cfg", None)
        if cfg is not None and cfg.get("num_classes") != num_classes:
            cfg.update(num_classes=num_classes, classes=None)

    def forward_stages(self, x: Tensor) -> list[Tensor]:
        """Feature maps of c2..c5 (strides 4, 8, 16, 32 with the ImageNet stems), for a trunk of ``stem``
        then ``stages`` (a subclass with another layout overrides this and :meth:`forward_features`)."""
        x = self.stem(x)
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        return feats

    def forward_features(self, x: Tensor) -> Tensor:
        """The last feature map (after ``final_conv``), before pooling."""
        return self.final_conv(self.stages(self.stem(x)))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pooled features ``[b, num_features]`` (``pre_logits``) or logits from :meth:`forward_features`' map."""
        x = self.head_drop(x.mean(dim=(2, 3)))
        return x if pre_logits else self.fc(x)

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:
        return self.forward_stages(x) if self.features_only else self.forward_head(self.forward_features(x))
