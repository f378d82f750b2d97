"""COCO-format data: reading and checking a COCO folder (:class:`CocoInstances`), converting any detection
dataset to a COCO ground truth (:func:`dataset_to_coco`) for :mod:`lambdanet.tasks.detection.evaluate`."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lambdanet.helpers import is_finite_real
from lambdanet.tasks.detection.targets import empty_target

__all__ = [
    "CocoInstances",
    "coco_ground_truth",
    "dataset_to_coco",
    "read_coco_annotations",
    "coco_split_files",
    "encode_masks",
    "BOX_TOLERANCE",
]

# a COCO box may overrun its image by this many pixels (rounding in real annotation files) before it is an error
BOX_TOLERANCE = 1.0


def encode_masks(masks: Tensor) -> list[dict]:
    """Binary masks ``[N, H, W]`` as COCO compressed RLEs (``counts`` a str: JSON-ready)."""
    from pycocotools import mask as mask_utils

    if len(masks) == 0:
        return []
    rles = mask_utils.encode(np.asfortranarray(masks.to(torch.uint8).permute(1, 2, 0).numpy()))  # H W N
    for rle in rles:
        rle["counts"] = rle["counts"].decode("ascii")
    return rles


def dataset_to_coco(dataset: Dataset) -> dict:
    """A COCO-format ground truth (``images``, ``annotations`` with RLE ``segmentation``, ``bbox`` xywh,
    ``area`` = mask pixels, ``iscrowd``; ``categories`` with ``id`` = label) of any dataset returning
    torchvision detection targets and naming its ``categories``. Image ids are the targets' ``image_id``;
    annotation ids count from 1 (COCOeval treats id 0 as unmatched)."""
    names = getattr(dataset, "categories", None)
    if not isinstance(names, Sequence) or isinstance(names, str):
        raise ValueError(
            f"dataset must name its categories (a 'categories' list, label k is categories[k - 1]); "
            f"{type(dataset).__name__} has none"
        )
    images: list[dict] = []
    annotations: list[dict] = []
    for i in range(len(cast(Sized, dataset))):
        image, target = dataset[i]
        height, width = image.shape[-2:]
        image_id = int(target["image_id"])
        images.append({"id": image_id, "width": int(width), "height": int(height), "file_name": f"{image_id}.png"})
        for rle, (x0, y0, x1, y1), label, area, crowd in zip(
            encode_masks(target["masks"]),
            target["boxes"].tolist(),
            target["labels"].tolist(),
            target["area"].tolist(),
            target["iscrowd"].tolist(),
        ):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": int(label),
                    "segmentation": rle,
                    "area": float(area),
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "iscrowd": int(crowd),
                }
            )
    categories = [{"id": k + 1, "name": name, "supercategory": "object"} for k, name in enumerate(names)]
    return {
        "info": {"description": "lambdanet detection ground truth"},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def coco_ground_truth(dataset: Dataset) -> dict:
    """The COCO ground truth to evaluate ``dataset`` against: its own ``to_coco()`` when it has one (a COCO
    folder keeps its crowd regions, its file's areas and boxes), also for a ``Subset`` of one (its images'
    annotations), else :func:`dataset_to_coco`."""
    to_coco = getattr(dataset, "to_coco", None)
    if callable(to_coco):
        return to_coco()
    base = getattr(dataset, "dataset", None)
    if isinstance(dataset, torch.utils.data.Subset) and isinstance(base, CocoInstances):
        return base.to_coco({base.ids[int(i)] for i in dataset.indices})
    return dataset_to_coco(dataset)


def read_coco_annotations(ann_file: Path, image_dir: Path, *, masks: bool = True) -> dict:
    """Read and check a COCO instances file: one ``ValueError`` line for a missing or unparsable file,
    missing sections, no annotations at all (an image without any is fine), an image without an integer ``id``
    (or one used twice), a category without an integer ``id`` or a ``name``, an annotation of an unknown image or
    category id, a box of other than four numbers or outside its image (by more than :data:`BOX_TOLERANCE` px),
    an annotation without ``iscrowd`` (0 or 1) or, with ``masks`` (Mask R-CNN), a ``segmentation``, or image files
    missing under ``image_dir``. Without ``masks`` (Faster R-CNN) segmentations are not read: boxes alone do."""
    if not ann_file.is_file():
        raise ValueError(f"COCO annotation file {ann_file} does not exist")
    try:
        data = json.loads(ann_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"COCO annotation file {ann_file} is not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"COCO annotation file {ann_file} holds a JSON {type(data).__name__}, not an object with "
                         "the lists images, annotations and categories (COCO instances format)")  # fmt: skip
    if missing := [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]:
        raise ValueError(f"COCO annotation file {ann_file} needs the lists {missing} (COCO instances format)")
    if not data["annotations"]:
        raise ValueError(
            f"COCO annotation file {ann_file} has no annotations (images without any are fine, but "
            "the file must annotate at least one object)"
        )
    if not data["categories"]:
        raise ValueError(f"COCO annotation file {ann_file} has no categories")
    images = _check_images(data["images"], ann_file)
    if bad := next((c for c in data["categories"] if not (isinstance(c, dict) and _is_int(c.get("id")))), None):
        raise ValueError(f"COCO annotation file {ann_file}: category ids must be integers, got {bad!r}"[:300])
    if bad := next((c for c in data["categories"] if not isinstance(c.get("name"), str)), None):
        raise ValueError(f"COCO annotation file {ann_file}: category {bad['id']} needs a name, got {bad!r}"[:300])
    category_ids = {c["id"] for c in data["categories"]}
    for ann in data["annotations"]:
        if not isinstance(ann, dict):
            raise ValueError(f"COCO annotation file {ann_file}: an annotation is a {type(ann).__name__}, not an object")
        _check_annotation(ann, ann_file, images, category_ids, masks)
    if absent := [img["file_name"] for img in data["images"] if not (image_dir / img["file_name"]).is_file()]:
        raise ValueError(
            f"COCO annotation file {ann_file}: {len(absent)} of {len(data['images'])} image files are "
            f"missing under {image_dir} (first: {absent[0]})"
        )
    return data


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_images(images: list, ann_file: Path) -> dict:
    """``{id: image}`` of the file's ``images``, each with a unique integer ``id``, a ``file_name`` and positive
    integer ``width`` and ``height`` (pycocotools keeps the last of two images of one id: their annotations would
    be trained on the other's file)."""
    by_id: dict = {}
    for img in images:
        if not isinstance(img, dict) or not _is_int(img.get("id")):
            raise ValueError(f"COCO annotation file {ann_file}: image ids must be integers, got {img!r}"[:300])
        if "file_name" not in img or not all(_is_int(img.get(k)) and img[k] > 0 for k in ("width", "height")):
            raise ValueError(f"COCO annotation file {ann_file}: image {img['id']!r} needs file_name and positive "
                             f"integer width and height, got {img!r}"[:300])  # fmt: skip
        if img["id"] in by_id:
            first = by_id[img["id"]]["file_name"]
            raise ValueError(f"COCO annotation file {ann_file}: image id {img['id']} is given twice ({first!r} and "
                             f"{img['file_name']!r}); ids must be unique")  # fmt: skip
        by_id[img["id"]] = img
    return by_id


def _check_annotation(ann: dict, ann_file: Path, images: dict, category_ids: set, masks: bool = True) -> None:
    """One annotation of :func:`read_coco_annotations` (its category, image, box, crowd flag and, with ``masks``,
    segmentation)."""
    aid = ann.get("id")
    if ann.get("category_id") not in category_ids:
        raise ValueError(
            f"COCO annotation file {ann_file}: annotation {aid} has category_id "
            f"{ann.get('category_id')!r}, not among the categories {sorted(category_ids)}"
        )
    img = images.get(ann.get("image_id"))
    if img is None:
        raise ValueError(
            f"COCO annotation file {ann_file}: annotation {aid} refers to image_id "
            f"{ann.get('image_id')!r}, which is not in 'images'"
        )
    box = ann.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(is_finite_real(v) for v in box)):
        raise ValueError(f"COCO annotation file {ann_file}: annotation {aid} needs bbox [x, y, w, h] of four numbers, "
                         f"got {box!r}")  # fmt: skip
    x, y, w, h = box
    width, height = img["width"], img["height"]
    t = BOX_TOLERANCE
    if x < -t or y < -t or w < 0 or h < 0 or x + w > width + t or y + h > height + t:
        raise ValueError(
            f"COCO annotation file {ann_file}: annotation {aid} has bbox {box} (x, y, w, h) outside "
            f"its image {img.get('file_name')!r} of {width}x{height} (tolerance {t} px)"
        )
    for key in ("segmentation", "iscrowd") if masks else ("iscrowd",):
        if key not in ann:
            raise ValueError(
                f"COCO annotation file {ann_file}: annotation {aid} has no {key!r} (the COCO "
                "instances format gives every annotation a segmentation, polygons or RLE, and "
                "iscrowd; --no-masks, Faster R-CNN, needs no segmentation)"
            )
    if ann["iscrowd"] not in (0, 1) or isinstance(ann["iscrowd"], float):
        raise ValueError(f"COCO annotation file {ann_file}: annotation {aid} has iscrowd {ann['iscrowd']!r}, "
                         "not 0 or 1")  # fmt: skip
    if masks and (why := _segmentation_problem(ann["segmentation"], height, width)):
        raise ValueError(f"COCO annotation file {ann_file}: annotation {aid}'s segmentation {why}")


def _segmentation_problem(seg, height: int, width: int) -> str | None:
    """Why a COCO ``segmentation`` cannot be decoded (``None``: it can): polygons need 3 points or more each
    (6 numbers, an even count), an RLE its image's ``size`` [height, width] and ``counts``."""
    if isinstance(seg, list):
        if not seg:
            return "is an empty list (polygons [[x1, y1, x2, y2, x3, y3, ...], ...] or an RLE {size, counts})"
        for poly in seg:
            if not isinstance(poly, list) or len(poly) < 6 or len(poly) % 2:
                n = len(poly) if isinstance(poly, list) else type(poly).__name__
                return f"has a polygon of {n} numbers (at least 3 points: 6 numbers, x and y alternating)"
        return None
    if isinstance(seg, dict):
        if list(seg.get("size") or []) != [height, width] or "counts" not in seg:
            return f"is an RLE of size {seg.get('size')!r}, not its image's [height, width] = [{height}, {width}]"
        return None
    return f"is a {type(seg).__name__} (polygons or an RLE expected)"


def _read_coco_image(base, image_id: int):
    """``CocoDetection``'s image reader through :func:`lambdanet.files.read_image` (16-bit images scaled, not
    clipped to white; an unreadable file named in one line)."""
    from lambdanet.files import read_image

    return read_image(os.path.join(base.root, base.coco.loadImgs(image_id)[0]["file_name"]), "RGB")


class CocoInstances(Dataset):
    """A COCO-format split (``torchvision.datasets.CocoDetection`` wrapped by
    ``wrap_dataset_for_transforms_v2``) in the detection format of this module.

    Category ids become contiguous labels ``1..K`` in the order of their ids (``categories[k - 1]`` is
    label ``k``, ``category_ids[k - 1]`` its COCO id). Targets leave out crowd regions and boxes under one
    pixel wide or high (Mask R-CNN cannot train on them); :meth:`to_coco` keeps them, so evaluation
    ignores detections of crowds as COCO does.

    Args:
        image_dir: folder of the images (``file_name`` is relative to it).
        ann_file: the instances JSON, checked by :func:`read_coco_annotations`.
        labels_of: the split whose labels this one takes (the training split, for its test split): the model's
            label ``k`` is that split's ``k``-th category, whatever this file lists besides; an annotation of a
            category it lacks is a one-line error.
    """

    def __init__(
        self,
        image_dir: str | os.PathLike,
        ann_file: str | os.PathLike,
        labels_of: CocoInstances | None = None,
        *,
        masks: bool = True,
    ):
        from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2

        self.image_dir, self.ann_file, self.masks = Path(image_dir), Path(ann_file), masks
        self.data = read_coco_annotations(self.ann_file, self.image_dir, masks=masks)
        if labels_of is None:
            cats = sorted(self.data["categories"], key=lambda c: c["id"])
            self.categories, self.category_ids = [c["name"] for c in cats], [c["id"] for c in cats]
        else:
            self.categories, self.category_ids = list(labels_of.categories), list(labels_of.category_ids)
            names = dict(zip(labels_of.category_ids, labels_of.categories))
            if other := [c for c in self.data["categories"] if c["id"] in names and c.get("name") != names[c["id"]]]:
                raise ValueError(
                    f"COCO annotation file {self.ann_file} names category {other[0]['id']} "
                    f"{other[0].get('name')!r}, {labels_of.ann_file} names it {names[other[0]['id']]!r}"
                )
        self.label_of = {cid: k + 1 for k, cid in enumerate(self.category_ids)}
        if unknown := next((a for a in self.data["annotations"] if a["category_id"] not in self.label_of), None):
            raise ValueError(
                f"COCO annotation file {self.ann_file}: annotation {unknown.get('id')} has category_id "
                f"{unknown['category_id']}, which {labels_of.ann_file if labels_of else 'it'} does not list "
                f"(the model's categories: {self.category_ids})"
            )
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its loading progress
            base = CocoDetection(str(self.image_dir), str(self.ann_file))
        base._load_image = functools.partial(_read_coco_image, base)  # an instance attribute: over the method
        keys = {"image_id", "boxes", "labels", "iscrowd"} | ({"masks"} if masks else set())
        self.base = wrap_dataset_for_transforms_v2(base, target_keys=keys)
        self.ids = list(base.ids)
        self.data_images = {img["id"]: img for img in self.data["images"]}

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Tensor, dict]:
        from torchvision.transforms.v2.functional import pil_to_tensor

        pil, raw = self.base[i]
        image = pil_to_tensor(pil).float() / 255  # 3 H W
        height, width = image.shape[-2:]
        info = self.data_images[int(raw["image_id"])]
        if (info["height"], info["width"]) != (height, width):  # the boxes were checked against the declared size
            raise ValueError(f"COCO annotation file {self.ann_file}: image {info['file_name']!r} is {width}x{height} "
                             f"pixels, the file says {info['width']}x{info['height']}")  # fmt: skip
        if "boxes" not in raw:  # an image without annotations
            return image, empty_target(height, width, raw["image_id"])
        boxes = raw["boxes"].as_subclass(Tensor).float().clamp(min=0)  # n 4
        boxes[:, 0::2] = boxes[:, 0::2].clamp(max=width)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(max=height)
        crowd = torch.as_tensor(raw["iscrowd"], dtype=torch.int64)  # n
        keep = (crowd == 0) & (boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)  # n
        labels = torch.tensor([self.label_of[int(c)] for c in raw["labels"][keep].tolist()], dtype=torch.int64)
        target = {"boxes": boxes[keep], "labels": labels, "image_id": int(raw["image_id"])}
        if self.masks:
            masks = raw["masks"].as_subclass(Tensor)[keep].to(torch.uint8)  # k H W
            target["masks"] = masks
            target["area"] = masks.flatten(1).sum(dim=1).float() if len(masks) else torch.zeros(0)
        else:  # Faster R-CNN: the boxes' areas
            kept = target["boxes"]  # k 4
            target["area"] = (kept[:, 2] - kept[:, 0]) * (kept[:, 3] - kept[:, 1])
        return image, {**target, "iscrowd": torch.zeros(len(labels), dtype=torch.int64)}

    def to_coco(self, image_ids: set[int] | None = None) -> dict:
        """The annotation file with category ids replaced by the labels (crowd regions kept; the categories the
        model's, :attr:`categories`) and annotation ids counted from 1 (COCOeval treats id 0 as unmatched);
        ``image_ids``: those images only (an evaluation of the first ones)."""
        data = copy.deepcopy(self.data)
        if image_ids is not None:
            data["images"] = [img for img in data["images"] if img["id"] in image_ids]
            data["annotations"] = [a for a in data["annotations"] if a["image_id"] in image_ids]
        for i, ann in enumerate(data["annotations"]):
            ann["id"] = i + 1
            ann["category_id"] = self.label_of[ann["category_id"]]
            ann.setdefault("area", float(ann["bbox"][2] * ann["bbox"][3]))  # COCOeval's size classes read it
        data["categories"] = [{"id": k + 1, "name": name} for k, name in enumerate(self.categories)]
        return data


def coco_split_files(root: Path) -> dict[str, tuple[Path, Path]]:
    """``{"train": (image_dir, ann_file), "test": ...}`` of a COCO folder: ``annotations/instances_<name>.json``
    with images in ``<name>/``; the test split is the ``val`` (else ``test``) file."""
    ann_dir = root / "annotations"
    files = sorted(ann_dir.glob("instances_*.json")) if ann_dir.is_dir() else []
    found: dict[str, tuple[Path, Path]] = {}
    for split, prefixes in (("train", ("train",)), ("test", ("val", "test"))):
        for prefix in prefixes:
            matches = [f for f in files if f.stem.removeprefix("instances_").startswith(prefix)]
            if len(matches) > 1:
                raise ValueError(
                    f"coco:{root} has several {prefix} annotation files {[m.name for m in matches]}; keep one"
                )
            if matches:
                found[split] = (root / matches[0].stem.removeprefix("instances_"), matches[0])
                break
    if missing := [s for s in ("train", "test") if s not in found]:
        raise ValueError(
            f"coco:{root} needs {' and '.join(missing)} annotation files: "
            f"{ann_dir}/instances_train*.json and instances_val*.json (COCO layout, images in "
            f"{root}/<train2017|val2017>/)"
        )
    return found
