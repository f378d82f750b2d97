"""Squeeze-and-excitation (Hu et al. 2018): channel attention, a diagonal lambda shared by all
positions (LambdaNetworks App. C.4)."""

from __future__ import annotations

from torch import Tensor, nn

from lambdanet.helpers import check_input, check_positive_int, check_real

__all__ = ["SqueezeExcite"]


class SqueezeExcite(nn.Module):
    """``x * sigmoid(W2 relu(W1 mean(x)))`` with ``W1: c -> max(1, int(c * rd_ratio))`` (biases included).

    Args:
        channels: input = output channels.
        rd_ratio: squeeze ratio: ``1/16`` in SE-ResNet (LambdaNetworks Table 3), ``0.25`` in ResNet-RS.
        rd_channels: explicit squeezed width (overrides ``rd_ratio``).
        act: activation between the two 1x1 convolutions.

    Time ``Theta(b n c)``, space ``Theta(b c)``.
    """

    def __init__(
        self, channels: int, rd_ratio: float = 1 / 16, rd_channels: int | None = None, act: type[nn.Module] = nn.ReLU
    ):
        super().__init__()
        check_positive_int(channels, "channels")
        if rd_channels is None:
            check_real(rd_ratio, "rd_ratio", high=1)
            rd_channels = max(1, int(channels * rd_ratio))
        check_positive_int(rd_channels, "rd_channels")
        self.channels = channels
        self.fc1 = nn.Conv2d(channels, rd_channels, 1)
        self.act = act()
        self.fc2 = nn.Conv2d(rd_channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        check_input(x, self.channels, None, self, dim_name="channels")
        s = x.mean(dim=tuple(range(2, x.dim())), keepdim=True)  # b c 1 1
        s = self.fc2(self.act(self.fc1(s.view(s.shape[0], s.shape[1], 1, 1))))  # b c 1 1
        return x * s.sigmoid().view(*s.shape[:2], *([1] * (x.dim() - 2)))
