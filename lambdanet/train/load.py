"""Use a trained model: ``load_model(RUN_DIR | FILE)`` rebuilds what ``lambdanet train`` trained.

The safetensors weights a run writes (``model.safetensors``, ``model_ema.safetensors``) carry their
model in the file's header (:func:`weights_metadata`): the registered name and keyword arguments, the
number of classes and input channels, the class names and the preprocessing (image size, mean, std).
``load_model`` reads that header, builds the model with ``create_model`` and loads the weights strictly;
it also takes a run directory (the EMA weights when the run kept them) or a ``last.pt`` checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from lambdanet.models import create_model
from lambdanet.models.pretrained import METADATA_FORMAT, run_metadata
from lambdanet.train.checkpoint import CheckpointError, load_checkpoint, trained_weights

__all__ = ["load_model", "restore_model", "weights_metadata", "METADATA_FORMAT"]



def weights_metadata(*, model: str, model_kwargs: dict, num_classes: int, in_chans: int, classes: list | None,
                     data: str, image_size: int, mean, std) -> dict[str, str]:
    """The header of a run's safetensors weights (safetensors metadata holds strings: JSON values)."""
    values = {"model": model, "model_kwargs": model_kwargs, "num_classes": num_classes, "in_chans": in_chans,
              "classes": classes, "data": data, "image_size": image_size, "mean": list(mean), "std": list(std)}
    return {"format": METADATA_FORMAT, **{k: json.dumps(v) for k, v in values.items()}}


def restore_model(state: dict, spec, *, ema: bool = True) -> tuple[nn.Module, str]:
    """The model of a checkpoint (``load_checkpoint``) for a dataset ``spec``, rebuilt and loaded (EMA weights
    when present and ``ema``); returns ``(model, "ema" | "raw")``."""
    saved = dict(state.get("config") or {})
    kwargs = dict(state.get("model_kwargs") or {})
    model = create_model(saved["model"], num_classes=spec.num_classes, in_chans=spec.in_chans, **kwargs)
    weights, kind = trained_weights(state, ema)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint does not fit {saved['model']}{kwargs}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    return model, kind


def _read_metadata(path: Path) -> dict:
    meta = run_metadata(path)
    if meta is None:
        raise ValueError(f"{path} holds weights without lambdanet's model description (written by an older "
                         "lambdanet or another tool); load it into create_model(...) yourself with "
                         "safetensors.torch.load_model, or pass the run's last.pt")
    return meta


def load_model(path: str | os.PathLike, *, ema: bool = True) -> nn.Module:
    """The trained model of a run directory, its safetensors weights or its ``last.pt``, in eval mode.

    Args:
        path: a run directory (``model_ema.safetensors`` when present and ``ema``, else
            ``model.safetensors``), a ``.safetensors`` file written by ``lambdanet train``, or a ``last.pt``.
        ema: prefer the EMA weights where a run has both.

    The returned model has ``pretrained_cfg``: ``{"model", "num_classes", "in_chans", "classes", "data",
    "image_size", "mean", "std"}`` (what its inputs must look like and what its outputs mean).
    """
    path = Path(path)
    if path.is_dir():
        candidates = (["model_ema.safetensors"] if ema else []) + ["model.safetensors", "last.pt"]
        found = next((path / c for c in candidates if (path / c).is_file()), None)
        if found is None:
            raise ValueError(f"{path} holds no trained model (model.safetensors, model_ema.safetensors or last.pt)")
        path = found
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass a run directory, its model.safetensors or its last.pt")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_model as load_weights

        meta = _read_metadata(path)
        model = create_model(meta["model"], num_classes=meta["num_classes"], in_chans=meta["in_chans"],
                             **meta["model_kwargs"])
        load_weights(model, str(path), strict=True)
    else:
        state = load_checkpoint(path)
        cfg = dict(state.get("config") or {})
        if not cfg:
            raise ValueError(f"checkpoint {path} has no training configuration")
        from lambdanet.data import dataset_spec

        spec = dataset_spec(cfg["data"])
        model, _ = restore_model(state, spec, ema=ema)
        meta = {"model": cfg["model"], "num_classes": spec.num_classes, "in_chans": spec.in_chans,
                "classes": spec.classes, "data": cfg["data"], "image_size": cfg.get("img_size") or spec.image_size,
                "mean": list(spec.mean), "std": list(spec.std)}
    model.pretrained_cfg = {k: meta[k] for k in ("model", "num_classes", "in_chans", "classes", "data", "image_size",
                                                 "mean", "std")}
    return model.eval()
