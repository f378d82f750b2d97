"""The glyphs of the built-in scenes (:mod:`lambdanet.tasks.detection.glyphs`): the glyph datasets and how their
grey levels become objects (:class:`GlyphSource`, :class:`GlyphStyle`), a split's pool of glyphs
(:class:`GlyphPool`), one glyph rendered at a size or an area, textured backgrounds and contrasting colours.
Rendering is numpy and PIL (single-threaded, identical on every machine)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from lambdanet.constants import DATASET_CLASSES
from lambdanet.tasks.classification.data import DatasetUnavailableError, TensorImages, build_datasets

__all__ = [
    "GlyphStyle",
    "GlyphSource",
    "GlyphPool",
    "GLYPH_SOURCES",
    "FASHION_MNIST_CLASSES",
    "DIGIT_CLASSES",
    "STROKE",
    "SILHOUETTE",
    "glyph_categories",
    "resize",
    "render_glyph",
    "fit_glyph",
    "luminance",
    "background",
    "glyph_colour",
]

FASHION_MNIST_CLASSES = DATASET_CLASSES["fashion-mnist"]
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
    """A glyph dataset of :func:`lambdanet.tasks.classification.data.build_datasets` and how its classes become
    categories."""

    data: str  # lambdanet.tasks.classification.data dataset name
    style: GlyphStyle
    classes: tuple[str, ...]  # category names of its labels 0..9 (shared names share a category)


GLYPH_SOURCES: dict[str, GlyphSource] = {
    "digits": GlyphSource("digits", STROKE, DIGIT_CLASSES),
    "mnist5k": GlyphSource("mnist5k", STROKE, DIGIT_CLASSES),
    "fashion-mnist": GlyphSource("fashion-mnist", SILHOUETTE, FASHION_MNIST_CLASSES),
}


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
    """The luminance (ITU-R BT.601 weights) of an RGB colour ``[3]`` in [0, 1]."""
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
