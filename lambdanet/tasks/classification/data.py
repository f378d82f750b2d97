"""The data of a classification run: :func:`prepare_run_data` (its loaders, from ``--data``, ``--val-split``,
``--labeled-fraction`` and ``--pseudo-labels``), seeded batches of augmented images (:class:`ImageLoader`), the
transforms of file datasets, and the datasets themselves (:mod:`lambdanet.tasks.classification.datasets`, whose
names this module also exports).

``--data`` names: :func:`list_datasets`. Small in-memory datasets are augmented by :class:`ImageLoader` (crops with
padding, flips, optional RandAugment); file datasets go through torchvision transforms v2
(:func:`build_transforms`). Every random draw comes from a generator seeded by ``(seed, epoch)`` or
``(seed, epoch, index)``, so a sample is augmented identically whatever the number of processes, the sharding or a
resume: distributed and resumed runs reproduce single-process runs exactly. A dataset that cannot be had raises
:class:`DatasetUnavailableError` (a ``ValueError``) naming the folder searched and how to get it."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.engine.distributed import DistContext
from lambdanet.files import absolute_data, error_with_type
from lambdanet.tasks.classification.config import TrainConfig
from lambdanet.constants import DEFAULT_CROP_PCT
from lambdanet.constants import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401  (lambdanet.data had them)
from lambdanet.tasks.classification.datasets import (
    FASHION_MNIST_DIR,
    IN_MEMORY,
    DatasetSpec,
    DatasetUnavailableError,
    ImageFolderTensors,
    Subset,
    TensorImages,
    build_datasets,
    dataset_spec,
    labeled_split,
    list_datasets,
    split_indices,
)

__all__ = [
    "DatasetSpec",
    "list_datasets",
    "dataset_spec",
    "build_datasets",
    "SeededTransformDataset",
    "build_transforms",
    "split_indices",
    "labeled_split",
    "FASHION_MNIST_DIR",
    "epoch_seed",
    "epoch_indices",
    "ImageLoader",
    "TensorImages",
    "Subset",
    "ImageFolderTensors",
    "resize_images",
    "rand_augment",
    "DatasetUnavailableError",
    "load_pseudo_labels",
    "RunData",
    "prepare_run_data",
]


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the data order in ``epoch`` of a run seeded ``seed``."""
    return (seed * 1_000_003 + epoch) % (2**63)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random augmentation in ``epoch`` of a run seeded ``seed``."""
    return (seed * 1_000_003 + epoch * 7_919 + index) % (2**63)


class SeededTransformDataset(Dataset):
    """Applies ``transform`` to ``base[i]`` under an RNG seeded by ``(seed, epoch, i)``; call :meth:`set_epoch`
    at the start of every epoch."""

    def __init__(self, base: Dataset, transform: Callable | None, seed: int = 0):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(cast(Sized, self.base))

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, label = self.base[i]
        if self.transform is None:
            return image, label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch, i))
            return self.transform(image), label


def eval_resize(size: int | Sequence[int], crop_pct: float) -> int | list[int] | None:
    """What an evaluation resizes an image to before its centre crop to ``size`` (``image_size``, or ``(h, w)``),
    timm's rule, the one of training runs, ``eval`` and :func:`lambdanet.predict.predict`: ``None`` where
    ``crop_pct >= 1`` (resized straight to ``size``, no crop); else the shorter side to ``floor(size / crop_pct)``
    (each side its own for an ``(h, w)`` not square)."""
    if crop_pct >= 1.0:
        return None
    h, w = (size, size) if isinstance(size, int) else size
    return math.floor(h / crop_pct) if h == w else [math.floor(h / crop_pct), math.floor(w / crop_pct)]


def build_transforms(
    spec: DatasetSpec,
    image_size: int,
    *,
    train: bool,
    augment: bool = True,
    randaugment: tuple[int, int] | None = None,
    crop_pct: float = DEFAULT_CROP_PCT,
) -> Callable:
    """torchvision v2 pipeline from a uint8 tensor image of a file dataset (large images) to a normalised
    float tensor: (train) random-resized crop + flip; (eval) the shorter side resized to
    ``floor(image_size / crop_pct)`` (0.875 by default) and centre-cropped, as timm's evaluation and
    :func:`lambdanet.predict.predict` do with the run's ``pretrained_cfg`` (``crop_pct`` 1: resized straight to
    ``image_size x image_size``, as a run on a built-in small dataset evaluated).
    ``randaugment = (layers, magnitude)`` adds RandAugment. Small in-memory images are augmented by
    :class:`ImageLoader` instead."""
    from torchvision.transforms import v2

    if spec.small:
        raise ValueError(f"{spec.name} holds small in-memory images: ImageLoader augments those itself")
    ops: list = []
    if train and augment:
        ops.append(v2.RandomResizedCrop(image_size, antialias=True))
    else:
        resize = eval_resize(image_size, crop_pct)
        if resize is None:
            ops.append(v2.Resize((image_size, image_size), antialias=True))
        else:
            ops += [v2.Resize(resize, antialias=True), v2.CenterCrop(image_size)]
    if train and augment and spec.hflip:
        ops.append(v2.RandomHorizontalFlip())
    if train and randaugment:
        ops.append(rand_augment(*randaugment))
    ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(spec.mean, spec.std)]
    return v2.Compose(ops)


def resize_images(images: Tensor, size: int, chunk: int = 256) -> Tensor:
    """Resize a uint8 ``[N, C, H, W]`` tensor to ``size x size`` once (bilinear, antialiased), ``chunk`` images at a
    time into the uint8 result: the float copies are a chunk's, not the dataset's (CIFAR-10 at 256 px was one
    39 GB float tensor). Each image's pixels are the same whatever the chunk."""
    if images.shape[-2:] == (size, size):
        return images
    out = torch.empty((*images.shape[:2], size, size), dtype=torch.uint8)  # n c size size
    for i in range(0, len(images), chunk):
        part = torch.nn.functional.interpolate(
            images[i : i + chunk].float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )
        out[i : i + chunk] = part.round_().clamp_(0, 255)
    return out


def epoch_indices(
    n: int,
    epoch: int,
    seed: int,
    *,
    shuffle: bool,
    rank: int = 0,
    world: int = 1,
    batch_size: int | None = None,
    drop_last: bool = False,
) -> list[list[int]]:
    """The batches of one rank for one epoch. The global order is a seeded permutation of ``range(n)`` (or
    ``range(n)``); global batch ``i`` is ``order[i B:(i+1) B]`` and rank ``r`` takes its elements
    ``r, r + world, ...`` so that the union of the ranks' ``i``-th batches is the single-process ``i``-th batch
    of size ``B = batch_size``."""
    order = (
        torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch))).tolist()
        if shuffle
        else list(range(n))
    )
    bs = batch_size or n
    chunks = [order[start : start + bs] for start in range(0, n, bs)]
    chunks = [c for c in chunks if not drop_last or len(c) == bs]  # only the last one can be short
    return [c[rank::world] for c in chunks if c[rank::world]]


def rand_augment(layers: int, magnitude: int):
    """torchvision's RandAugment with ``layers`` operations at ``magnitude``. Its scale has 31 bins (0-30);
    a larger magnitude (HaloNet H7's 31, Table A2's recipe) gets the bins to reach it, its maximum strength."""
    from torchvision.transforms import v2

    return v2.RandAugment(num_ops=layers, magnitude=magnitude, num_magnitude_bins=max(31, magnitude + 1))


class ImageLoader:
    """Batches of normalised float images for one rank, epoch by epoch (``set_epoch``). Small in-memory datasets
    take a vectorised path: crops with ``image_size / 8`` padding and flips (where labels allow) are drawn for
    every sample of the epoch from a generator seeded by ``(seed, epoch)`` and applied to whole batches;
    RandAugment, when asked for, then runs per sample under a generator seeded by ``(seed, epoch, index)``. File
    datasets (large images) go through :func:`build_transforms`, :class:`SeededTransformDataset` and a
    ``DataLoader``. Both are deterministic per ``(seed, epoch, index)``. ``crop_pct`` (evaluation): as a run
    evaluated, by the kind of data it trained on (``None``: this data's own way, straight resizing of small
    images, the 0.875 centre crop of files; otherwise the shorter side to ``image_size / crop_pct`` and a centre
    crop, 1: straight), so that ``eval --data OTHER`` feeds the model what it learnt from, as ``predict`` does."""

    def __init__(
        self,
        dataset: Dataset,
        spec: DatasetSpec,
        image_size: int,
        *,
        train: bool,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        workers: int = 0,
        augment: bool = True,
        randaugment: tuple[int, int] | None = None,
        crop_pct: float | None = None,
    ):
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} must be divisible by the number of processes ({world})")
        self.spec, self.image_size, self.train = spec, image_size, train
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.augment, self.epoch, self.start_batch = augment and train, 0, 0
        base, indices = dataset, None
        if isinstance(dataset, Subset) and isinstance(dataset.base, TensorImages):
            base, indices = dataset.base, dataset.indices
        self.fast = isinstance(base, TensorImages) and spec.small
        self.randaugment = rand_augment(*randaugment) if self.fast and train and randaugment else None
        if self.fast:
            tensors = cast(TensorImages, base)  # self.fast: base is a TensorImages
            images = tensors.images if indices is None else tensors.images[indices]
            labels = tensors.labels if indices is None else tensors.labels[indices]
            resize = None if train or crop_pct is None else eval_resize(image_size, crop_pct)
            if resize is not None:  # a run that evaluated with a centre crop (square images: one side)
                from torchvision.transforms.v2.functional import center_crop

                images = center_crop(resize_images(images, cast(int, resize)), [image_size] * 2)
            self.images, self.labels, self.n = resize_images(images, image_size), labels, len(labels)
            self.mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
            self.std = torch.tensor(spec.std).view(1, -1, 1, 1)
        else:
            tf = build_transforms(spec, image_size, train=train, augment=augment, randaugment=randaugment,
                                  crop_pct=DEFAULT_CROP_PCT if crop_pct is None else crop_pct)  # fmt: skip
            self.dataset = SeededTransformDataset(dataset, tf, seed)
            self.n, self.workers = len(cast(Sized, dataset)), workers

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate over ``epoch``'s batches from batch ``start_batch`` on (a preempted epoch continued: the batches
        and their augmentation are functions of seed, epoch and index, so the rest is as it would have been)."""
        self.epoch, self.start_batch = epoch, start_batch
        if not self.fast:
            self.dataset.set_epoch(epoch)

    def batches(self) -> list[list[int]]:
        return epoch_indices(
            self.n,
            self.epoch,
            self.seed,
            shuffle=self.train,
            rank=self.rank,
            world=self.world,
            batch_size=self.batch_size,
            drop_last=self.train,
        )

    def __len__(self) -> int:
        return len(self.batches())

    @property
    def num_samples(self) -> int:
        """Samples this rank sees per epoch."""
        return sum(len(b) for b in self.batches())

    def __iter__(self):
        batches = self.batches()[self.start_batch :]
        if not self.fast:
            yield from torch.utils.data.DataLoader(self.dataset, batch_sampler=batches, num_workers=self.workers)
            return
        crops = flips = None
        if self.augment:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7_919 + 17)
            pad = max(1, self.image_size // 8)
            crops = torch.randint(0, 2 * pad + 1, (self.n, 2), generator=g)
            flips = torch.rand(self.n, generator=g) < 0.5
        for idx in batches:
            index = torch.tensor(idx)
            x = self.images[index].float().div_(255)  # b c h w
            if crops is not None:
                x = self._crop(x, crops[index])
                if self.spec.hflip:
                    x = torch.where(flips[index].view(-1, 1, 1, 1), x.flip(-1), x)
            if self.randaugment is not None:
                x = torch.stack([self._randaugment(img, int(i)) for img, i in zip(x, idx)])  # b c h w
            yield (x - self.mean) / self.std, self.labels[index]

    def _randaugment(self, image: Tensor, i: int) -> Tensor:
        """RandAugment of one ``[c, h, w]`` image in [0, 1] under the generator of ``(seed, epoch, i)``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch, i))
            return cast("Callable[[Tensor], Tensor]", self.randaugment)(image)  # only called when it is set

    def _crop(self, x: Tensor, offsets: Tensor) -> Tensor:
        """Random crops of ``image_size`` from the zero-padded batch at per-sample ``offsets``."""
        b, c, h, w = x.shape
        pad = max(1, self.image_size // 8)
        xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        rows = offsets[:, 0, None] + torch.arange(h)  # b h
        cols = offsets[:, 1, None] + torch.arange(w)  # b w
        bi = torch.arange(b)[:, None, None]
        out = xp.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # b h w c
        # an explicit channels-first copy: for one-channel images .contiguous() keeps the channels-last strides
        # of the permuted view, and the whole network would then run (and lay out its gradients) channels-last
        return out.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)  # b c h w


def load_pseudo_labels(path: str | Path, cfg: TrainConfig) -> dict:
    """A pseudo-label file from ``lambdanet pseudo-label`` that matches this run's data and split."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pseudo_labels file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    expected = "expected the .pt file lambdanet pseudo-label writes"
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # empty, truncated, not a torch file
        raise ValueError(
            f"pseudo_labels file {path} is empty or corrupt ({error_with_type(err)}); {expected}"
        ) from None
    if not isinstance(data, dict) or not {"indices", "labels"} <= set(data):
        raise ValueError(f"pseudo_labels file {path} holds no pseudo-labels (no indices and labels); {expected}")
    for key in ("data", "labeled_fraction", "seed"):
        mine, theirs = getattr(cfg, key), data.get(key)
        if key == "data" and isinstance(theirs, str):  # a relative path of an earlier version's file
            mine, theirs = absolute_data(mine), absolute_data(theirs)
        if theirs != mine:
            raise ValueError(f"pseudo_labels {path} were made for {key}={data.get(key)!r}, this run has {key}={mine!r}")
    return data


@dataclass
class RunData:
    """The loaders of a classification run: training, validation (``--val-split``; else ``None``) and test."""

    spec: DatasetSpec
    train: ImageLoader
    val: ImageLoader | None
    test: ImageLoader
    pseudo_digest: str | None = None  # the pseudo-labels trained on (their images and labels), checked on resume


def prepare_run_data(cfg: TrainConfig, ctx: DistContext) -> RunData:
    """The loaders of a resolved ``cfg`` for this process: the labelled part of the training set
    (``--labeled-fraction``) less the held-out validation part, plus the pseudo-labelled images
    (``--pseudo-labels``); a batch larger than the training set is a one-line error."""
    spec, train_ds, test_ds = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    if spec.num_classes < 2:  # an ImageFolder of one class folder: the loss is 0 and nothing is learnt
        raise ValueError(
            f"{cfg.data} has one class folder ({', '.join(spec.classes or [])}): classification needs two or more "
            "(ImageNet layout: train/<class>/*.jpg and val/<class>/*.jpg, a folder per class)"
        )
    pool, val_ds = _split_training_set(cfg, train_ds)
    fit_ds: Dataset = Subset(train_ds, pool)
    digest = None
    if cfg.pseudo_labels:
        if not isinstance(train_ds, TensorImages):
            raise ValueError(f"pseudo_labels (--pseudo-labels) are supported for in-memory datasets ({IN_MEMORY}), "
                             f"not {cfg.data}")  # fmt: skip
        pl = load_pseudo_labels(cfg.pseudo_labels, cfg)
        digest = pseudo_labels_digest(pl)
        kept = torch.as_tensor(pool)
        fit_ds = TensorImages(
            torch.cat([train_ds.images[kept], train_ds.images[torch.as_tensor(pl["indices"])]]),
            torch.cat([train_ds.labels[kept], torch.as_tensor(pl["labels"])]),
        )
    ra = (cfg.randaugment_layers, cfg.randaugment_magnitude) if cfg.randaugment_layers else None
    world, img = ctx.world, cast(int, cfg.img_size)  # resolve_config set it
    eval_bs = max(world, cfg.eval_batch_size - cfg.eval_batch_size % world)
    train_loader = ImageLoader(
        fit_ds,
        spec,
        img,
        train=True,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        rank=ctx.rank,
        world=world,
        workers=cfg.workers,
        augment=cfg.augment,
        randaugment=ra,
    )
    if len(train_loader) == 0:
        narrowing = (("--val-split", cfg.val_split, 0.0), ("--labeled-fraction", cfg.labeled_fraction, 1.0))
        narrowed = [f"{flag} {value}" for flag, value, neutral in narrowing if value != neutral]
        raise ValueError(
            f"batch_size={cfg.batch_size} is larger than the {train_loader.n} training images of "
            f"{cfg.data}{' left by ' + ' and '.join(narrowed) if narrowed else ''}; lower --batch-size"
            + (f" or change {'it' if len(narrowed) == 1 else 'them'}" if narrowed else "")
        )

    def eval_loader(ds):
        return ImageLoader(
            ds, spec, img, train=False, batch_size=eval_bs, rank=ctx.rank, world=world, workers=cfg.workers
        )

    val = eval_loader(val_ds) if val_ds is not None else None
    return RunData(spec, train_loader, val, eval_loader(test_ds), digest)


def _split_training_set(cfg: TrainConfig, train_ds: Dataset) -> tuple[np.ndarray, Subset | None]:
    """The indices a run trains on (the labelled part, ``--labeled-fraction``, less the held-out validation part)
    and its validation set (``--val-split``; else ``None``); a validation split too small to hold out one image is
    a one-line error (its accuracy would be 0 on no images, and would select the best epoch)."""
    pool = labeled_split(len(cast(Sized, train_ds)), cfg.labeled_fraction, cfg.seed)[0]
    if not cfg.val_split:
        return pool, None
    keep, held = split_indices(len(pool), cfg.val_split, cfg.seed + 1)
    if len(held) == 0 and len(pool) > 1:  # (one labelled image or none: the batch's message below says so)
        left = f" left by --labeled-fraction {cfg.labeled_fraction}" if cfg.labeled_fraction != 1.0 else ""
        raise ValueError(
            f"val_split={cfg.val_split} holds out none of the {len(pool)} training images of {cfg.data}{left}; "
            f"pass --val-split {1 / len(pool):.2g} or more (one image), or 0 for no validation split"
        )
    return pool[keep], Subset(train_ds, pool[held])


def pseudo_labels_digest(pl: dict) -> str:
    """What a student trains on from a pseudo-label file: its images (indices) and labels, as a SHA-256."""
    h = hashlib.sha256()
    for key in ("indices", "labels"):
        h.update(torch.as_tensor(pl[key]).to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()
