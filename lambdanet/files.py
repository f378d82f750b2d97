"""The files lambdanet reads and writes, in one place: weights files (safetensors or ``torch.save``'d state
dicts), the header of a run's weights (:data:`METADATA_FORMAT`, which lets a file rebuild its model) and the
run directory's layout (:data:`RUN_FILES`, :func:`run_file`). The bottom of the stack: models read these
files, the training engine writes them; this module imports neither."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "WeightsMismatchError",
    "METADATA_FORMAT",
    "RUN_FILES",
    "run_file",
    "read_safetensors",
    "read_state_dict",
    "weights_metadata",
    "encode_metadata",
    "run_metadata",
    "is_run_weights",
]

METADATA_FORMAT = "lambdanet.weights.v1"  # the header of the weights lambdanet train writes
RUN_FILES = ("model_ema.safetensors", "model.safetensors", "last.pt")  # what a run directory holds, preferred first


class WeightsMismatchError(ValueError):
    """A weights file does not fit the model it is loaded into."""


def run_file(path: str | os.PathLike, *, ema: bool = True, checkpoint: bool = False) -> Path:
    """The file a run directory of ``lambdanet train`` stands for; any other path as it is (``~`` expanded). The
    weights (default): ``model_ema.safetensors`` when present and ``ema``, else ``model.safetensors``, else
    ``last.pt`` (a run stopped before its end). With ``checkpoint``: its ``last.pt``, the training checkpoint
    (configuration, raw and EMA weights). ``ValueError`` for a directory without such a file."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return path
    names = ("last.pt",) if checkpoint else RUN_FILES[0 if ema else 1 :]
    found = next((path / n for n in names if (path / n).is_file()), None)
    if found is None:
        what = "training checkpoint (last.pt)" if checkpoint else f"trained model ({', '.join(names)})"
        raise ValueError(
            f"{path} is a directory but holds no {what}; pass a run directory of lambdanet train or a weights file"
        )
    return found


def read_safetensors(path: Path, tensors: bool = True) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The one place a safetensors file is read: ``(its tensors (none unless tensors), its header
    metadata)``; a truncated or damaged file is a one-line :class:`WeightsMismatchError`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except SafetensorError as err:
        raise WeightsMismatchError(
            f"weights file {path} is corrupted or truncated and cannot be loaded "
            f"({type(err).__name__}: {str(err)[:200]}); delete it or restore a copy"
        ) from None
    except OSError as err:
        raise WeightsMismatchError(f"weights file {path} cannot be read ({err})") from None
    return sd, meta


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a weights file: safetensors, or a ``torch.save``'d state dict (possibly wrapped under
    ``"state_dict"``, ``"model"`` or ``"state_dict_ema"``); loaded with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise WeightsMismatchError(
            f"checkpoint_path {str(path)!r} does not exist (expected a weights file: "
            ".safetensors, .pth, .bin or a run's last.pt)"
        )
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickles with arbitrary objects, truncated files, non-torch files
        raise WeightsMismatchError(f"checkpoint_path {str(path)!r} is not a readable weights file ({err})") from err
    for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise WeightsMismatchError(f"checkpoint_path {str(path)!r} holds no state dict of tensors")
    return obj


def weights_metadata(
    *,
    model: str,
    model_kwargs: dict,
    num_classes: int,
    in_chans: int,
    classes: list | None,
    data: str,
    image_size: int,
    mean,
    std,
) -> dict[str, str]:
    """The header of a run's safetensors weights (safetensors metadata holds strings: JSON values)."""
    return encode_metadata(
        model=model,
        model_kwargs=model_kwargs,
        num_classes=num_classes,
        in_chans=in_chans,
        classes=classes,
        data=data,
        image_size=image_size,
        mean=list(mean),
        std=list(std),
    )


def encode_metadata(**values) -> dict[str, str]:
    """A run-weights header of any task: :data:`METADATA_FORMAT` and the ``values`` as JSON strings (safetensors
    metadata holds strings); :func:`run_metadata` decodes it."""
    return {"format": METADATA_FORMAT, **{k: json.dumps(v) for k, v in values.items()}}


def run_metadata(path: str | os.PathLike) -> dict | None:
    """The model description in the header of weights written by ``lambdanet train`` (:data:`METADATA_FORMAT`:
    model, kwargs, classes, preprocessing; JSON values decoded), ``None`` for any other file."""
    if Path(path).suffix != ".safetensors":
        return None
    meta = read_safetensors(Path(path), tensors=False)[1]
    if meta.get("format") != METADATA_FORMAT:
        return None
    out = {}
    for k, v in meta.items():
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:  # safetensors' own entries: a shared tensor's other name -> the stored name
            pass
    out.pop("format", None)
    return out


def is_run_weights(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a readable safetensors file whose header is :data:`METADATA_FORMAT`."""
    if not Path(path).is_file():
        return False
    try:
        return run_metadata(path) is not None
    except WeightsMismatchError:  # not readable as safetensors: left for the weight loader to report
        return False
