"""Use a trained model: ``load_model(RUN_DIR | FILE)`` rebuilds what ``lambdanet train`` trained.

The safetensors weights a run writes (``model.safetensors``, ``model_ema.safetensors``) carry their model in
the file's header (:func:`lambdanet.files.weights_metadata`): the registered name and keyword arguments, the
number of classes and input channels, the class names and the preprocessing (image size, mean, std).
``load_model`` reads that header, builds the model with ``create_model`` and loads the weights strictly; it
also takes a run directory (the EMA weights when the run kept them; :func:`lambdanet.files.run_file`, the rule
every command uses for a run directory) or a ``last.pt`` checkpoint. :func:`checkpoint_settings` is what
fine-tuning (``lambdanet train --checkpoint RUN_OR_FILE``) takes from the same header."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from torch import nn

from lambdanet.files import check_checkpoint_task, check_run_task, read_state_dict, run_file, run_metadata
from lambdanet.models import create_model
from lambdanet.models.hub import hub_repo
from lambdanet.models.registry import run_image_cfg
from lambdanet.models.pretrained import load_state
from lambdanet.engine.checkpoint import CheckpointError, load_checkpoint, trained_weights
from lambdanet.tasks.classification.datasets import dataset_spec

__all__ = ["load_model", "restore_model", "checkpoint_meta", "check_data_fits", "checkpoint_settings"]


def checkpoint_meta(state: dict, path: str | os.PathLike = "the checkpoint") -> dict:
    """What the model of a classification checkpoint (``load_checkpoint``) is, in the keys of its run's weights
    header (model, model_kwargs, num_classes, in_chans, classes, data, image_size, mean, std): saved in it
    (``run_meta``, since 0.2.0), else, for an older one, rebuilt from its configuration and its data as it is
    now, which must still have as many classes as its classifier has outputs (one-line ``ValueError``)."""
    saved = dict(state.get("config") or {})
    if not saved:
        raise CheckpointError(f"checkpoint {path} has no training configuration")
    if isinstance(state.get("run_meta"), dict):
        return dict(state["run_meta"])
    spec = dataset_spec(saved["data"])
    fc = state.get("model", {}).get("fc.weight")  # the classifier of every image model (pretrained_cfg's)
    if fc is not None and fc.shape[0] != spec.num_classes:
        raise ValueError(
            f"checkpoint {path} has a classifier of {fc.shape[0]} classes but its data {saved['data']} has "
            f"{spec.num_classes} now: the data changed since the run (its model.safetensors, when it has one, "
            "carries the run's classes)"
        )
    return {"model": saved["model"], "model_kwargs": dict(state.get("model_kwargs") or {}),
            "num_classes": spec.num_classes, "in_chans": spec.in_chans, "classes": spec.classes,
            "data": saved["data"], "image_size": saved.get("img_size") or spec.image_size, "mean": list(spec.mean),
            "std": list(spec.std)}  # fmt: skip


def check_data_fits(meta: dict, spec, path: str | os.PathLike) -> None:
    """A one-line ``ValueError`` when the dataset ``spec`` is not what the checkpoint at ``path`` (its
    :func:`checkpoint_meta`) classifies: another number of classes or channels, or other class names."""
    names = meta.get("classes") is not None and spec.classes is not None and list(meta["classes"]) != spec.classes
    if meta["num_classes"] == spec.num_classes and meta["in_chans"] == spec.in_chans and not names:
        return

    def what(n, chans, classes):
        shown = "" if classes is None else f" ({', '.join(map(str, classes[:5]))}{', ...' if len(classes) > 5 else ''})"
        return f"{n} class{'' if n == 1 else 'es'}{shown} of {chans}-channel images"

    raise ValueError(
        f"checkpoint {path} classifies {what(meta['num_classes'], meta['in_chans'], meta.get('classes'))}; "
        f"{spec.name} has {what(spec.num_classes, spec.in_chans, spec.classes)}: evaluate it on its own data, or "
        "fine-tune it on this data with lambdanet train --checkpoint"
    )


def restore_model(
    state: dict, spec=None, *, ema: bool = True, path: str | os.PathLike = "the checkpoint", meta: dict | None = None
):
    """The model of a checkpoint (``load_checkpoint``), built as it trained (``meta``: its
    :func:`checkpoint_meta`, read here if not given) and loaded (EMA weights when present and ``ema``); with a
    dataset ``spec`` to run it on, that data must be what it classifies (:func:`check_data_fits`). Returns
    ``(model, "ema" | "raw")``."""
    meta = meta or checkpoint_meta(state, path)
    if spec is not None:
        check_data_fits(meta, spec, path)
    model = create_model(meta["model"], num_classes=meta["num_classes"], in_chans=meta["in_chans"],
                         **meta["model_kwargs"])  # fmt: skip
    weights, kind = trained_weights(state, ema)
    load_state(model, weights, source="the checkpoint's weights", name=f"{meta['model']}{meta['model_kwargs']}")
    return model, kind


def _read_metadata(path: Path) -> dict:
    meta = run_metadata(path)
    if meta is None:
        raise ValueError(
            f"{path} holds weights without lambdanet's model description (written by an older "
            "lambdanet or another tool); load it into create_model(...) yourself with "
            "safetensors.torch.load_model, or pass the run's last.pt (a timm checkpoint: name its architecture, "
            "create_model(NAME, checkpoint_path=FILE), --model NAME at the command line)"
        )
    return meta


def load_model(path: str | os.PathLike, *, ema: bool = True) -> nn.Module:
    """The trained model of a run directory, its safetensors weights or its ``last.pt``, in eval mode.

    Args:
        path: a run directory (``model_ema.safetensors`` when present and ``ema``, else
            ``model.safetensors``), a ``.safetensors`` file written by ``lambdanet train``, a ``last.pt``, or
            ``"hf-hub:owner/name"``: a run shared with :func:`lambdanet.hub.push_to_hub` (downloaded once into
            huggingface_hub's cache).
        ema: prefer the EMA weights where a run has both.

    The returned model has ``pretrained_cfg`` in timm's keys (:func:`lambdanet.models.registry.image_cfg`):
    ``architecture``, ``num_classes``, ``input_size`` ``(in_chans, size, size)``, ``mean``, ``std``,
    ``crop_pct`` (as the run evaluated: 0.875 for image files, 1 for the built-in small datasets), ``classes``
    and ``data`` (what its inputs must look like and what its outputs mean).
    """
    if hub_repo(path) is not None:  # create_model reads a shared run (and records where it came from)
        return create_model(str(path)).eval()
    check_run_task(path, "classify")  # a language-model or detection run: say so (lambdanet.load_model takes both)
    path = run_file(path, ema=ema)
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass a run directory, its model.safetensors or its last.pt")
    if path.suffix == ".safetensors":
        meta = _read_metadata(path)
        model = create_model(
            meta["model"], num_classes=meta["num_classes"], in_chans=meta["in_chans"], **meta["model_kwargs"]
        )
        load_state(
            model,
            read_state_dict(path),
            source=f"{path} (its header: {meta['model']}{meta['model_kwargs']})",
            name=meta["model"],
            path=path,
        )
    else:  # the checkpoint's own classes (saved in it since 0.2.0: its data need not be at hand)
        state = load_checkpoint(path)
        check_checkpoint_task(state.get("config"), path, "classify")  # away from its run: config.yaml told none
        meta = checkpoint_meta(state, path)
        model, _ = restore_model(state, ema=ema, path=path, meta=meta)
    cast("dict[str, Any]", model.pretrained_cfg).update(run_image_cfg(meta))
    return model.eval()


def checkpoint_settings(path: str | os.PathLike) -> dict | None:
    """The model settings of what ``lambdanet train`` wrote (a run directory, its safetensors weights or a
    ``last.pt``): ``{"model", "model_kwargs", "image_size", "file"}`` (``file``: what
    :func:`lambdanet.files.run_file` picked), ``None`` for weights of another origin (timm's) or a file that
    cannot be read (its loader reports why); a one-line ``ValueError`` for another task's run or checkpoint."""
    file = run_file(path)
    check_run_task(path, "classify")  # a language-model or detection run: say so, not a KeyError on its header
    if file.suffix == ".safetensors" and file.is_file():
        meta = run_metadata(file)
        if meta is None:
            return None
        return {
            "model": meta["model"],
            "model_kwargs": dict(meta["model_kwargs"]),
            "image_size": meta["image_size"],
            "file": file,
        }
    if file.suffix == ".pt" and file.is_file():
        try:
            state = load_checkpoint(file)
        except CheckpointError:  # not a run's checkpoint, or damaged: create_model's loader says which
            return None
        check_checkpoint_task(state.get("config"), file, "classify")  # away from its run: config.yaml told none
        cfg = state.get("config") or {}
        if "model" not in cfg:
            return None
        kwargs = state.get("model_kwargs")  # create_model's keywords (the configuration's model_kwargs and more)
        kwargs = (cfg.get("model_kwargs") or {}) if kwargs is None else kwargs
        return {"model": cfg["model"], "model_kwargs": dict(kwargs), "image_size": cfg.get("img_size"), "file": file}
    return None
