"""Mixup and CutMix of classification batches (lambdanet.tasks.classification.mix): the mixed batch and its soft
targets against their definitions written out per sample, against timm's ``Mixup`` on the same draw, and the
options' checks."""

import math

import numpy as np
import pytest
import torch

from lambdanet.cli import main
from lambdanet.tasks.classification.mix import BatchMix, MixDraw, cutmix_box, mix_targets, soft_target_cross_entropy


def smoothed(label: int, classes: int, smoothing: float) -> torch.Tensor:
    t = torch.full((classes,), smoothing / classes)
    t[label] += 1.0 - smoothing
    return t


def test_mixup_blends_each_image_with_the_reversed_batch_and_targets_alike():
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, 6, 7), torch.tensor([0, 3, 1, 1, 4])
    mix = BatchMix(0.4, 0.0, num_classes=5, smoothing=0.1, seed=3)
    draw = mix.draw(epoch=2, batch=7, height=6, width=7)
    assert draw.box is None and 0.0 <= draw.lam <= 1.0
    assert mix.draw(2, 7, 6, 7) == draw and mix.draw(2, 8, 6, 7) != draw  # a function of (epoch, batch)
    mixed, targets = mix(x, y, draw)
    perm = [4, 3, 2, 1, 0]
    for i, j in enumerate(perm):
        torch.testing.assert_close(mixed[i], draw.lam * x[i] + (1 - draw.lam) * x[j])
        want = draw.lam * smoothed(int(y[i]), 5, 0.1) + (1 - draw.lam) * smoothed(int(y[j]), 5, 0.1)
        torch.testing.assert_close(targets[i], want)
    torch.testing.assert_close(targets.sum(1), torch.ones(5))


def test_cutmix_box_area_is_the_drawn_share_and_lam_the_area_kept():
    """Over many draws: the pasted box's area is 1 - lam of the image exactly (the corrected lam), and where the
    box lies inside the image its sides are sqrt(1 - lam0) of the image's (lam0 the drawn weight) rounded down:
    (H r - 1)(W r - 1) < area <= H r W r."""
    height, width, rng = 32, 24, np.random.default_rng(0)
    inside = 0
    for lam0 in np.linspace(0.02, 0.98, 49):
        for _ in range(12):
            draw = cutmix_box(height, width, float(lam0), rng)
            y0, y1, x0, x1 = draw.box
            area = (y1 - y0) * (x1 - x0)
            assert draw.lam == pytest.approx(1 - area / (height * width), abs=1e-12)
            r = math.sqrt(1 - lam0)
            assert area <= height * r * width * r + 1e-9
            if y0 > 0 and x0 > 0 and y1 < height and x1 < width:
                inside += 1
                assert (height * r - 1) * (width * r - 1) < area
    assert inside > 40  # the bound was checked on many boxes (about 84 of the 588 lie inside)
    x, y = torch.randn(4, 2, height, width), torch.tensor([1, 0, 2, 2])
    mix = BatchMix(0.0, 1.0, num_classes=3, smoothing=0.0, seed=0)
    draw = mix.draw(0, 0, height, width)
    mixed, targets = mix(x, y, draw)
    y0, y1, x0, x1 = draw.box
    inside_box = torch.zeros(height, width, dtype=torch.bool)
    inside_box[y0:y1, x0:x1] = True
    for i in range(4):
        assert torch.equal(mixed[i][:, inside_box], x[3 - i][:, inside_box])
        assert torch.equal(mixed[i][:, ~inside_box], x[i][:, ~inside_box])
        torch.testing.assert_close(targets[i], draw.lam * smoothed(int(y[i]), 3, 0) + (1 - draw.lam) * smoothed(
            int(y[3 - i]), 3, 0))


def test_with_both_each_batch_takes_one_of_them():
    mix = BatchMix(1.0, 1.0, num_classes=3, smoothing=0.0, seed=1)
    cut = sum(mix.draw(0, b, 16, 16).box is not None for b in range(400))
    assert abs(cut / 400 - 0.5) < 0.1  # binomial(400, 0.5): 0.1 is four standard deviations


class _Fixed:
    """A generator whose integer draws are given (timm's box centre)."""

    def __init__(self, values):
        self.values = list(values)

    def integers(self, high):
        value = self.values.pop(0)
        assert 0 <= value < high
        return value


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_the_mix_of_a_draw_is_timms(kind, seed):
    """timm's Mixup (batch mode) on a batch, and ours on the draw it made (its lam, its box centre): the same images
    and targets, label smoothing included; the soft-target loss is timm's SoftTargetCrossEntropy."""
    pytest.importorskip("timm")
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    alpha = {"mixup_alpha": 0.8, "cutmix_alpha": 0.0} if kind == "mixup" else {"mixup_alpha": 0.0, "cutmix_alpha": 1.0}
    peer = Mixup(**alpha, label_smoothing=0.1, num_classes=7)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 3, 10, 12, generator=g), torch.randint(0, 7, (6,), generator=g)
    np.random.seed(seed)
    want_x, want_t = peer(x.clone(), y)
    np.random.seed(seed)  # the same draws again: the prob test, lam, then (CutMix) the box centre
    np.random.rand()
    lam = float(np.random.beta(0.8, 0.8) if kind == "mixup" else np.random.beta(1.0, 1.0))
    draw = MixDraw(lam) if kind == "mixup" else cutmix_box(10, 12, lam, _Fixed([np.random.randint(0, 10),
                                                                                 np.random.randint(0, 12)]))
    mix = BatchMix(**({"mixup": 0.8, "cutmix": 0.0} if kind == "mixup" else {"mixup": 0.0, "cutmix": 1.0}),
                   num_classes=7, smoothing=0.1, seed=0)
    got_x, got_t = mix(x, y, draw)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_t, want_t)
    logits = torch.randn(6, 7, generator=g)
    torch.testing.assert_close(soft_target_cross_entropy(logits, got_t), SoftTargetCrossEntropy()(logits, want_t))



def test_unmixed_soft_targets_are_label_smoothing():
    """lam = 1: the soft-target loss is the label-smoothed cross-entropy the run uses without mixing."""
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(8, 5, generator=g), torch.randint(0, 5, (8,), generator=g)
    torch.testing.assert_close(soft_target_cross_entropy(logits, mix_targets(y, 5, 1.0, 0.1)),
                               torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, y))


@pytest.mark.parametrize("args,needle", [
    (["--mixup", "-0.5"], "mixup must be a non-negative number (the alpha of Beta(alpha, alpha); 0: off), got -0.5"),
    (["--cutmix", "nan"], "cutmix must be a non-negative number (the alpha of Beta(alpha, alpha); 0: off), got nan"),
    (["--cutmix", "inf"], "cutmix must be a non-negative number"),
])
def test_bad_mix_values_fail_in_one_line(tmp_path, capsys, args, needle):
    assert main(["train", *args, "--out", str(tmp_path / "run"), "--no-progress", "--no-tensorboard"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
