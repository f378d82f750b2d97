"""Semi-supervised pseudo-labels (App. E.2): a teacher checkpoint labels the unlabelled part of the training set; a
student then trains on the labelled part plus the pseudo-labelled images (``--pseudo-labels``). The labelled part
is a seeded ``labeled_fraction`` of the training split (``--labeled-fraction``); the rest is treated as unlabelled.
The pseudo-label file records the dataset, fraction and seed it belongs to."""

from __future__ import annotations

import math

from collections.abc import Sized
from pathlib import Path
from typing import cast

import torch

from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lambdanet.engine.values import check_number
from lambdanet.files import absolute_data, check_checkpoint_task, run_file
from lambdanet.models.hub import hub_repo
from lambdanet.tasks.classification.data import IN_MEMORY, ImageLoader, Subset, build_datasets, labeled_split
from lambdanet.tasks.classification.config import TrainConfig
from lambdanet.tasks.classification.load import restore_model

__all__ = ["make_pseudo_labels"]


@torch.no_grad()
def make_pseudo_labels(
    checkpoint: str | Path, out: str | Path, *, threshold: float = 0.0, batch_size: int = 256
) -> dict:
    """Label the unlabelled training images of the teacher run ``checkpoint`` (its directory or its ``last.pt``)
    with its EMA weights when it has them; keep those with confidence >= ``threshold`` (in [0, 1])."""
    check_number(threshold, "threshold", 0, 1)
    if hub_repo(checkpoint) is not None:  # weights alone: no configuration to rebuild the teacher's data from
        raise ValueError(f"{checkpoint} holds weights without a training checkpoint; pseudo-label with the run that "
                         "wrote it (its directory or last.pt)")  # fmt: skip
    path = run_file(checkpoint, checkpoint=True)  # a run directory: its last.pt
    state = load_checkpoint(path)
    check_checkpoint_task(state.get("config"), path, "classify")  # a language-model or detection checkpoint
    if not isinstance(state.get("config"), dict):
        raise CheckpointError(f"checkpoint {checkpoint} has no training configuration (not a lambdanet train run)")
    cfg = TrainConfig(**state["config"])
    if cfg.data.startswith("imagefolder:"):
        raise ValueError(f"the teacher {checkpoint} was trained on {cfg.data}: pseudo-labels are made for the "
                         f"in-memory datasets a student can train on ({IN_MEMORY})")  # fmt: skip
    if cfg.labeled_fraction >= 1.0:
        raise ValueError(
            f"the teacher {checkpoint} was trained on all labels (labeled_fraction=1.0): there are no "
            "unlabelled images; train the teacher with --labeled-fraction < 1"
        )
    spec, train_ds, _ = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    _, unlabeled = labeled_split(len(cast(Sized, train_ds)), cfg.labeled_fraction, cfg.seed)
    if not len(unlabeled):
        raise ValueError(
            f"the teacher {checkpoint} was trained with labeled_fraction={cfg.labeled_fraction} of "
            f"{len(cast(Sized, train_ds))} images: every one is labelled, none left to pseudo-label; train the teacher "
            "with a lower --labeled-fraction"
        )
    model, _ = restore_model(state, spec, path=checkpoint)
    model.eval()
    loader = ImageLoader(
        Subset(train_ds, unlabeled), spec, cfg.img_size or spec.image_size, train=False, batch_size=batch_size
    )
    probs = torch.cat([model(x).softmax(dim=1) for x, _ in loader])
    conf, labels = probs.max(dim=1)
    keep = conf >= threshold
    truth = torch.as_tensor([train_ds[int(i)][1] for i in unlabeled])
    result = {
        "indices": torch.as_tensor(unlabeled)[keep],
        "labels": labels[keep],
        "confidence": conf[keep],
        "data": absolute_data(cfg.data),  # a teacher of an earlier version may have kept it relative
        "labeled_fraction": cfg.labeled_fraction,
        "seed": cfg.seed,
        "teacher": str(checkpoint),
        # over the labels kept (NaN when none is): what the student will learn from
        "agreement_with_true_labels": float((labels == truth)[keep].float().mean()) if keep.any() else math.nan,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(result, out)  # whole or not at all
    return result
