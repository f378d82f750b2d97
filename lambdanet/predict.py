"""Classify image files with a trained or pretrained model: ``predict(model, images)``.

The model says how its inputs must look in ``model.pretrained_cfg``, in timm's keys (what
:func:`lambdanet.load_model` and ``create_model`` attach; timm's own models carry the same): ``input_size``
``(in_chans, H, W)`` (``in_chans`` 1: grayscale, 3: RGB), ``mean``, ``std``, optionally ``crop_pct`` (default 1.0:
resize straight to ``H x W``; below 1, timm's evaluation convention: resize the shorter side to
``int(H / crop_pct)``, then centre-crop), ``interpolation`` (``"bilinear"`` default, or ``"bicubic"``) and
``classes`` (the class names, or ``None``). Labels
are the model's ``classes`` when it has them, ImageNet's class names (torchvision's offline copy) for other
1000-class models, and the class index otherwise.

Precision: :func:`predict` runs in the dtype of the model's floating-point parameters (:func:`floating_dtype`):
float32, or half precision after ``model.half()`` / ``model.to(torch.bfloat16)`` (``load_for_inference(...,
dtype="float16")``, ``lambdanet predict --dtype``; :data:`DTYPES`). The lambda layers compute their lambdas in
float32 and cast back; on a CPU, float16 convolutions are much slower than float32 ones (bfloat16 ones less so).

:func:`load_for_inference` builds the model that ``lambdanet predict`` and ``lambdanet export`` work on from a
registered name (optionally with pretrained weights) or from what ``lambdanet train`` wrote."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_positive_int
from lambdanet.models import create_model, model_args
from lambdanet.models.hub import hub_repo
from lambdanet.models.pretrained import dropped_classifier
from lambdanet.files import IMAGE_SUFFIXES, check_path_given, check_run_task, is_run_weights, read_image
from lambdanet.tasks.classification.data import eval_resize
from lambdanet.tasks.classification.load import load_model

__all__ = [
    "DTYPES",
    "IMAGE_SUFFIXES",
    "INTERPOLATIONS",
    "class_labels",
    "find_images",
    "floating_dtype",
    "imagenet_classes",
    "load_for_inference",
    "load_image",
    "predict",
    "preprocess_transform",
    "resolve_dtype",
]

INTERPOLATIONS = ("bilinear", "bicubic")
_PIL_MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # in_chans -> the PIL mode images are converted to
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # inference precisions


def resolve_dtype(dtype: str | torch.dtype, name: str = "dtype") -> torch.dtype:
    """``dtype`` (a key of :data:`DTYPES`, or one of its values) as a ``torch.dtype``; a one-line
    ``ValueError`` naming ``name`` otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{name} must be one of {list(DTYPES)}, got {dtype!r}")


def floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (or buffer): the precision it computes in;
    float32 for a model without any."""
    return next((t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()), torch.float32)


# --------------------------------------------------------------------------------------------------- models
def _is_run_output(path: Path) -> bool:
    """Whether ``path`` is something ``lambdanet train`` wrote (a run directory, a ``.pt`` checkpoint, or
    safetensors weights whose header describes their model), which :func:`lambdanet.load_model` reads."""
    return path.is_dir() or path.suffix == ".pt" or is_run_weights(path)


def load_for_inference(
    checkpoint: str | os.PathLike | None = None,
    *,
    model: str | None = None,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    ema: bool = True,
    dtype: str | torch.dtype = "float32",
) -> nn.Module:
    """The model to predict with or export, in eval mode, in ``dtype``.

    Args:
        checkpoint: what ``lambdanet train`` wrote (a run directory, its ``.safetensors`` weights or its
            ``last.pt``), or ``"hf-hub:owner/name"`` (such a run shared with :func:`lambdanet.hub.push_to_hub`):
            :func:`lambdanet.load_model`, which attaches ``pretrained_cfg`` with the run's classes and
            preprocessing; or, with ``model``, another weights file for ``create_model(model,
            checkpoint_path=...)``.
        model: a registered name (:func:`lambdanet.list_models`); with ``checkpoint`` pointing at a run it must
            be the run's model.
        pretrained: ``create_model(model, pretrained=True)`` (not with ``checkpoint``).
        num_classes: classifier outputs of a model built by name (default: the model's own).
        img_size: input size a model built by name is sized for (models taking ``img_size``).
        ema: prefer a run's EMA weights.
        dtype: the precision of the returned model's parameters and buffers, one of :data:`DTYPES` (checked
            before anything is loaded).

    A model built by name without weights has random weights (useful for export only).
    """
    dtype = resolve_dtype(dtype)
    if checkpoint is None and model is None:
        raise ValueError("give a model name or a checkpoint (a run directory, .safetensors or last.pt)")
    if checkpoint is not None and pretrained:
        raise ValueError("pretrained and checkpoint exclude each other: the weights come from one of them")
    kwargs: dict = {}
    if model is not None:
        accepted = model_args(model)  # also rejects unknown names, naming the closest registered ones
        if num_classes is not None:
            kwargs["num_classes"] = num_classes
        if img_size is not None and "img_size" in accepted:
            kwargs["img_size"] = img_size
    if checkpoint is not None:
        check_path_given(checkpoint, "the checkpoint path", "pass a run directory, its .safetensors weights, its "
                         "last.pt or hf-hub:OWNER/NAME")  # fmt: skip
        hub = hub_repo(checkpoint)  # a run shared on the Hugging Face hub
        path = Path(checkpoint)
        if hub is None and not path.exists():
            raise ValueError(
                f"checkpoint {str(path)!r} does not exist; pass a run directory, its .safetensors "
                "weights, its last.pt or hf-hub:OWNER/NAME"
            )
        if hub is not None or model is None or _is_run_output(path):
            check_run_task(path, "classify")  # a language-model or detection run: say so, not a KeyError
            net = load_model(checkpoint if hub is not None else path, ema=ema)
            pretrained_cfg = cast("dict[str, Any]", net.pretrained_cfg)
            if "vocab_size" in pretrained_cfg:  # a shared language model
                raise ValueError(f"{checkpoint} is a language model (lambdanet lm train), not an image classifier; "
                                 f"continue a prompt with lambdanet lm sample --checkpoint {checkpoint}")  # fmt: skip
            trained = pretrained_cfg["architecture"]
            if model is not None and model != trained:
                raise ValueError(f"model {model!r} does not match checkpoint {str(path)!r}, which holds {trained!r}")
            if num_classes is not None and num_classes != pretrained_cfg["num_classes"]:
                raise ValueError(
                    f"num_classes={num_classes} does not match checkpoint {str(path)!r}, trained "
                    f"with {pretrained_cfg['num_classes']} classes"
                )
            return net.to(dtype).eval()
        kwargs["checkpoint_path"] = str(path)
    elif pretrained:
        kwargs["pretrained"] = True
    net = create_model(cast(str, model), **kwargs)  # model is given here (checked above)
    dropped = _dropped_classes(net) if checkpoint is not None else None
    if dropped is not None and num_classes is None:  # the file's classifier, not a random one of the default width
        kwargs["num_classes"] = dropped
        net = create_model(cast(str, model), **kwargs)
        if _dropped_classes(net) is not None:
            raise ValueError(f"checkpoint {str(path)!r}'s {dropped}-class classifier does not fit {model!r} (another "
                             "feature width): build the model with the checkpoint's options")  # fmt: skip
    elif dropped is not None and num_classes:  # (num_classes 0: the features, the classifier left out on purpose)
        raise ValueError(
            f"num_classes={num_classes} does not match checkpoint {str(path)!r}, whose classifier has {dropped} "
            "classes (the model's would be random); leave num_classes out to take the checkpoint's"
        )
    return net.to(dtype).eval()


def _dropped_classes(net: nn.Module) -> int | None:
    """The classes of the checkpoint classifier that loading ``net``'s weights left out (a width other than its
    own), ``None`` where none was."""
    return dropped_classifier(cast("dict[str, Any]", getattr(net, "pretrained_cfg", {})).get("load_notes") or [])


# --------------------------------------------------------------------------------------------------- images
def find_images(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The image files named by ``paths``: files as given, folders replaced by every file under them
    (recursively, sorted) whose suffix is one of :data:`IMAGE_SUFFIXES` (any case)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    for given in paths:
        check_path_given(given, "an image path", "give image files or folders of images")  # not the working folder
        p = Path(given)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ValueError(f"{p} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
            found += files
        elif p.is_file():
            found.append(p)
        else:
            raise ValueError(f"{p} does not exist (expected an image file or a folder of images)")
    if not found:
        raise ValueError("no images given")
    return found


def load_image(path: str | os.PathLike, in_chans: int):
    """The PIL image at ``path`` in the mode the model reads: ``"L"`` for ``in_chans=1``, ``"RGB"`` for 3,
    ``"RGBA"`` for 4 (:func:`lambdanet.files.read_image`: as training reads it)."""
    check_choice(in_chans, "in_chans", tuple(_PIL_MODES))
    return read_image(path, _PIL_MODES[in_chans])


def preprocess_transform(cfg: dict):
    """The evaluation preprocessing ``model.pretrained_cfg`` describes (see the module docstring), from a PIL
    image to a normalised float32 tensor ``[in_chans, H, W]``; the image is resized as float32 (not rounded back
    to 8 bits), antialiased."""
    from torchvision.transforms import v2

    missing = [k for k in ("input_size", "mean", "std") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"pretrained_cfg lacks {missing}: it needs input_size (in_chans, H, W), mean and std")
    if len(cfg["input_size"]) != 3:
        raise ValueError(f"pretrained_cfg['input_size'] must be (in_chans, H, W), got {cfg['input_size']!r}")
    in_chans, *size = cfg["input_size"]
    for side in size:
        check_positive_int(side, "pretrained_cfg['input_size'] H and W")
    check_choice(in_chans, "pretrained_cfg['input_size'][0] (in_chans)", tuple(_PIL_MODES))
    mean, std = list(cfg["mean"]), list(cfg["std"])
    if len(mean) != in_chans or len(std) != in_chans:
        raise ValueError(f"pretrained_cfg mean and std must have in_chans={in_chans} entries, got {mean}, {std}")
    crop_pct = 1.0 if cfg.get("crop_pct") is None else float(cfg["crop_pct"])
    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"pretrained_cfg['crop_pct'] must be in (0, 1], got {crop_pct}")
    interpolation = cfg.get("interpolation") or "bilinear"
    check_choice(interpolation, "pretrained_cfg['interpolation']", INTERPOLATIONS)
    mode = {"bilinear": v2.InterpolationMode.BILINEAR, "bicubic": v2.InterpolationMode.BICUBIC}[interpolation]
    ops = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]  # uint8 HWC -> float32 [c, h, w] in [0, 1]
    resize = eval_resize(size, crop_pct)  # timm's eval transform, as the runs evaluated
    if resize is None:
        ops.append(v2.Resize(size, interpolation=mode, antialias=True))
    else:
        ops += [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(size)]
    ops.append(v2.Normalize(mean, std))
    return v2.Compose(ops)


@functools.cache
def imagenet_classes() -> tuple[str, ...]:
    """ImageNet-1k's 1000 class names in index order (torchvision's copy, no download)."""
    from torchvision.models import ResNet50_Weights

    return tuple(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])


def class_labels(classes: Sequence | None, num_outputs: int) -> list[str]:
    """The label of each of a model's ``num_outputs`` classes: ``classes`` when given, ImageNet's names for
    1000 outputs, else the index."""
    if classes and len(classes) != num_outputs:
        raise ValueError(f"the model has {num_outputs} outputs but pretrained_cfg names {len(classes)} classes")
    if classes:
        return [str(c) for c in classes]
    return list(imagenet_classes()) if num_outputs == 1000 else [str(i) for i in range(num_outputs)]


# --------------------------------------------------------------------------------------------------- predict
def predict(
    model: nn.Module, images: str | os.PathLike | Sequence[str | os.PathLike], *, top_k: int = 5, batch_size: int = 32
) -> list[dict]:
    """The ``top_k`` classes of each image, most probable first.

    Args:
        model: a classifier with ``pretrained_cfg`` (see the module docstring); it runs in eval mode (its
            training flag is restored afterwards) on the device of its parameters, in their dtype
            (:func:`floating_dtype`: the preprocessed float32 images are cast to it).
        images: image files and folders (:func:`find_images`).
        top_k: classes reported per image (at most the number of classes).
        batch_size: images per forward pass.

    Returns:
        ``[{"image": path, "top_k": [{"label": str, "index": int, "prob": float}, ...]}, ...]``, one entry per
        image in :func:`find_images` order; ``prob`` is the softmax probability (computed in float64 from the
        logits, whatever the model's dtype).
    """
    cfg = getattr(model, "pretrained_cfg", None)
    if not cfg:
        raise ValueError(
            "the model has no pretrained_cfg describing its inputs; load it with "
            "lambdanet.load_model(RUN) or create_model(name, pretrained=True)"
        )
    check_positive_int(top_k, "top_k")
    check_positive_int(batch_size, "batch_size")
    transform = preprocess_transform(cfg)
    paths = find_images(images)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = floating_dtype(model)
    labels: list[str] | None = None
    results = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(paths), batch_size):
            batch = paths[start : start + batch_size]
            x = torch.stack([transform(load_image(p, cfg["input_size"][0])) for p in batch])  # b c h w, float32
            x = x.to(device=device, dtype=dtype)
            with torch.inference_mode():
                logits = model(x)  # b classes
            if not isinstance(logits, Tensor) or logits.dim() != 2:
                raise ValueError("the model must return logits [batch, classes] (a classifier, not features_only)")
            if labels is None:
                labels = class_labels(cfg.get("classes"), logits.shape[1])
            probs = logits.double().softmax(dim=1)  # b classes
            values, indices = probs.topk(min(top_k, probs.shape[1]), dim=1)  # b k, sorted descending
            for path, vs, ix in zip(batch, values.tolist(), indices.tolist()):
                results.append(
                    {"image": str(path), "top_k": [{"label": labels[i], "index": i, "prob": v} for v, i in zip(vs, ix)]}
                )
    finally:
        model.train(was_training)
    return results
