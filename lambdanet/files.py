"""The files lambdanet reads and writes, in one place: weights files (safetensors or ``torch.save``'d state
dicts), the header of a run's weights (:data:`METADATA_FORMAT`, which lets a file rebuild its model) and the
run directory's layout (:data:`RUN_FILES`, :func:`run_file`). The bottom of the stack: models read these
files, the training engine writes them; this module imports neither."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "give_usual_mode",
    "ZEROED_FILE",
    "absolute_data",
    "IMAGE_SUFFIXES",
    "read_image",
    "WeightsMismatchError",
    "METADATA_FORMAT",
    "RUN_FILES",
    "BEST_WEIGHTS",
    "PRETRAIN_CHECKPOINT",
    "RUN_RECORDS",
    "is_run_record",
    "run_file",
    "read_safetensors",
    "read_state_dict",
    "weights_metadata",
    "encode_metadata",
    "run_metadata",
    "is_run_weights",
    "RUN_TASKS",
    "task_of_config",
    "run_task",
    "check_run_task",
    "error_reason",
    "error_with_type",
    "weights_file_kind",
    "check_output_dir",
    "make_output_dir",
    "check_output_file",
    "check_path_given",
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
    check_path_given(path, "the checkpoint path", "pass a run directory of lambdanet train or a file in it")
    path = Path(path).expanduser()
    if not path.is_dir():
        return path
    names = ("last.pt",) if checkpoint else RUN_FILES[0 if ema else 1 :]
    found = next((path / n for n in names if (path / n).is_file()), None)
    if found is None:
        what = "training checkpoint (last.pt)" if checkpoint else f"trained model ({', '.join(names)})"
        instead = "its last.pt" if checkpoint else "a weights file"
        raise ValueError(f"{path} is a directory but holds no {what}; pass a run directory of lambdanet train or "
                         f"{instead}")  # fmt: skip
    return found


def check_path_given(path: str | os.PathLike, name: str, expected: str) -> None:
    """A one-line ``ValueError`` (``{name} is empty; {expected}``) for an empty path: ``Path("")`` is the working
    folder, which no one asks for by giving nothing (``--out ''`` would write a run there)."""
    if not str(path):
        raise ValueError(f"{name} is empty; {expected}")


def _check_writable(folder: Path, name: str, path, what: str = "", make: bool = False) -> None:
    """A one-line ``ValueError`` naming the option ``name`` (given ``path``) unless a file can be made in ``folder``
    (made with its parents first where ``make``): a file is made there and removed."""
    try:
        if make:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{name} {path}: cannot write there ({err.strerror or err}); choose another {name}"
                         + (f" ({what})" if what else "")) from None  # fmt: skip


def check_output_dir(path: str | os.PathLike, name: str, what: str = "a folder", *, writable: bool = False) -> None:
    """A one-line ``ValueError`` naming the option ``name`` when the folder ``path`` (created where missing)
    cannot be one: it is empty, or it or the nearest of its parents that exists is a file, or (``writable``) that
    one takes no files (a read-only or missing filesystem), before any work is done."""
    check_path_given(path, name, f"give {what}")
    target = Path(str(path)).expanduser()
    existing = next((p for p in (target, *target.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = f"{name} {path}" if existing == target else f"{name} {path}: {existing}"
        raise ValueError(f"{where} is a file, not a directory; choose another {name} ({what})")
    if writable:
        _check_writable(existing or Path("."), name, path, what)


def make_output_dir(path: str | os.PathLike, name: str, what: str = "a folder") -> Path:
    """The folder ``path`` (``~`` expanded), created with its parents, once files can be written in it; a one-line
    ``ValueError`` naming the option ``name`` otherwise (a file in the way, a read-only or missing filesystem),
    before any work is done."""
    check_output_dir(path, name, what)
    target = Path(str(path)).expanduser()
    _check_writable(target, name, path, what, make=True)
    return target


def check_output_file(path: str | os.PathLike, name: str) -> None:
    """A one-line ``ValueError`` naming the option ``name`` when the file ``path`` cannot be written: it is empty
    or a folder, or the nearest of its parents that exists is a file or takes no files (a read-only or missing
    filesystem: a file is made there and removed), before any work is done."""
    check_path_given(path, name, "give a file path")
    target = Path(str(path)).expanduser()
    if target.is_dir():
        raise ValueError(f"{name} {path} is a directory; give a file path (e.g. {target / 'out.pt'})")
    if target.is_file() and is_run_record(target):
        raise ValueError(f"{name} {path} is a file of the run {target.parent} (its weights or records), which this "
                         f"would overwrite; choose another {name}")  # fmt: skip
    existing = next((p for p in target.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{name} {path}: {existing} is a file, not a directory; choose another {name}")
    _check_writable(existing or Path("."), name, path)


# the weights of a classification run's best epoch (summary.json's best_epoch), raw and EMA, beside model(_ema)
BEST_WEIGHTS = ("model_best.safetensors", "model_best_ema.safetensors")
PRETRAIN_CHECKPOINT = "pretrain.pt"  # a detect run's pre-training, until last.pt holds it
# what a run directory holds of its own (beside RUN_FILES): its other checkpoint and weights, and its records
RUN_RECORDS = RUN_FILES + (PRETRAIN_CHECKPOINT, *BEST_WEIGHTS, "config.yaml", "metrics.csv", "summary.json")


def is_run_record(path: Path) -> bool:
    """Whether ``path`` is one of a run directory's own files (:data:`RUN_RECORDS`, beside its ``config.yaml``),
    which no other command's output may replace."""
    return path.name in RUN_RECORDS and (path.parent / "config.yaml").is_file()


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
            f"({type(err).__name__}: {error_reason(err)}); delete it or restore a copy"
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
    kind = weights_file_kind(path)
    if path.suffix == ".safetensors" or kind == "safetensors":
        return read_safetensors(path)[0]
    if kind is not None:
        raise WeightsMismatchError(
            f"checkpoint_path {str(path)!r} is {kind} (expected a weights file: .safetensors, .pth, .bin or a "
            "run's last.pt)"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickles with arbitrary objects, truncated files, non-torch files
        raise WeightsMismatchError(
            f"checkpoint_path {str(path)!r} is not a readable weights file ({error_with_type(err)})"
        ) from None
    for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise WeightsMismatchError(f"checkpoint_path {str(path)!r} holds no state dict of tensors")
    return obj


ZEROED_FILE = "a damaged file (its first bytes are zeros: corrupted or truncated; restore a copy)"


def weights_file_kind(path: Path, head: bytes | None = None) -> str | None:
    """What a file is when its first bytes (``head``: read here if not given) tell it: ``"safetensors"``, or why
    it cannot be a torch checkpoint (empty, or neither a zip archive nor a pickle); ``None`` when it may be a
    torch checkpoint (a zip archive, or from old torch versions a pickle)."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(16)
    if head.startswith(b"PK") or head[:1] == b"\x80":
        return None
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return "safetensors"
    if not head:
        return "an empty file"
    if not head.strip(b"\x00"):  # zeros where the data was: a filesystem's crash, a copy cut short
        return ZEROED_FILE
    return "not a torch checkpoint or safetensors file"


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
    crop_pct: float | None = None,
    interpolation: str | None = None,
) -> dict[str, str]:
    """The header of a run's safetensors weights (safetensors metadata holds strings: JSON values); ``crop_pct``
    and ``interpolation`` where the weights' preprocessing is not their data's (a model's own ``pretrained_cfg``)."""
    own = {k: v for k, v in (("crop_pct", crop_pct), ("interpolation", interpolation)) if v is not None}
    return encode_metadata(model=model, model_kwargs=model_kwargs, num_classes=num_classes, in_chans=in_chans,
                           classes=classes, data=data, image_size=image_size, mean=list(mean), std=list(std),
                           **own)  # fmt: skip


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


def error_reason(err: BaseException, limit: int = 200) -> str:
    """The message of ``err`` for a one-line error: its first line, or, where that is longer than ``limit``
    characters, its whole sentences that fit (a single sentence too long is cut at a word, ending ``...``);
    the exception's type name when it has no message."""
    text = str(err).strip()
    line = text.splitlines()[0].strip() if text else type(err).__name__
    if len(line) <= limit:
        return line
    head = line[:limit]
    ends = [i + 1 for i in range(len(head)) if head[i] in ".!?" and (i + 1 == len(head) or head[i + 1] == " ")]
    if ends:
        return head[: ends[-1]]
    return head[: limit - 3].rsplit(" ", 1)[0] + "..."


def error_with_type(err: BaseException) -> str:
    """``EOFError: Ran out of input``: :func:`error_reason` after the exception's type name (the name alone
    where it has no message)."""
    reason = error_reason(err)
    return reason if reason == type(err).__name__ else f"{type(err).__name__}: {reason}"


# ------------------------------------------------------------------------------ which task wrote a run
# task -> (what its runs are, the command that writes them, what to do with one instead; {path}: the run)
RUN_TASKS = {
    "classify": ("an image-classification run", "lambdanet train", "classify images with lambdanet predict"),
    "lm": (
        "a language-model run",
        "lambdanet lm train",
        "continue a prompt with lambdanet lm sample --checkpoint {path}",
    ),
    "detect": ("a detection run", "lambdanet detect", "its box AP (and mask AP) are in {path}/summary.json"),
}


def task_of_config(cfg: dict) -> str | None:
    """The task (a key of :data:`RUN_TASKS`) whose configuration or weights header ``cfg`` is, told by the keys
    only that task has; ``None`` when it is none of them."""
    if "backbone" in cfg:
        return "detect"
    if "vocab_size" in cfg and "num_classes" not in cfg:
        return "lm"
    if "model" in cfg:
        return "classify"
    return None


def run_task(path: str | os.PathLike) -> str | None:
    """Which task (:data:`RUN_TASKS`) wrote ``path``: a run directory or a file in one (its ``config.yaml``), or
    safetensors weights (their header); ``None`` when it cannot be told (the file's loader then says what is
    wrong). Reads no tensors."""
    import yaml

    path = Path(path).expanduser()
    if path.suffix == ".safetensors" and path.is_file():
        try:
            meta = read_safetensors(path, tensors=False)[1]
        except WeightsMismatchError:  # damaged: left for the loader to report
            return None
        if meta.get("format") == METADATA_FORMAT or "backbone" in meta:  # the detector's header: {"backbone"}
            return task_of_config(meta)
        return None
    config = (path if path.is_dir() else path.parent) / "config.yaml"
    if not config.is_file():
        return None
    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return task_of_config(saved) if isinstance(saved, dict) else None


def check_run_task(path: str | os.PathLike, task: str) -> None:
    """A one-line ``ValueError`` when ``path`` was written by another task than ``task`` (a key of
    :data:`RUN_TASKS`), naming both and what the run is for instead."""
    _refuse_other_task(path, run_task(path), task)


def check_checkpoint_task(config: object, path: str | os.PathLike, task: str) -> None:
    """:func:`check_run_task` for a checkpoint already loaded from ``path`` (its saved ``config``): a ``last.pt``
    away from its run directory, whose task no ``config.yaml`` beside it tells."""
    _refuse_other_task(path, task_of_config(config) if isinstance(config, dict) else None, task)


def _refuse_other_task(path: str | os.PathLike, found: str | None, task: str) -> None:
    if found is None or found == task:
        return
    kind, writer, advice = RUN_TASKS[found]
    folder, is_dir = (Path(path), True) if Path(path).is_dir() else (Path(path).parent, False)
    in_run = (folder / "config.yaml").is_file()  # else a file away from its run: no run folder to point at
    if found == "detect" and not (folder / "summary.json").is_file():
        advice = (
            "its box AP (and mask AP) will be in {path}/summary.json when it ends (lambdanet detect --resume --out "
            "{path} continues it)"
            if in_run  # not finished (or a backbone's pre-training)
            else "its box AP (and mask AP) are in the summary.json of the run that wrote it"
        )
    raise ValueError(
        f"{path} is {'' if is_dir else 'from '}{kind} ({writer}), not {RUN_TASKS[task][0]} ({RUN_TASKS[task][1]}); "
        f"{advice.format(path=folder if in_run else path)}"
    )


# ------------------------------------------------------------------------------ image files
# the suffixes of the image files lambdanet reads (torchvision's ImageFolder's: training and predict agree)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def read_image(path: str | os.PathLike, mode: str):
    """The PIL image at ``path`` in ``mode`` (``"L"``, ``"RGB"``, ...), its pixels read (a truncated file fails
    here). 16-bit and 32-bit integer images (``I;16``, ``I``: scientific and medical PNG / TIFF) are scaled to 8
    bits first (``x / 257``, clipped), where PIL's own conversion would clip every value above 255 to white;
    float images (``F``) in [0, 1] are scaled by 255, in [0, 255] kept, others refused.
    An unreadable file is a one-line ``ValueError`` naming it."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as img:
            if img.mode.startswith("I;16") or img.mode == "I":
                wide = np.asarray(img, dtype=np.float64)  # h w: 0 .. 65535
                return Image.fromarray(np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8)).convert(mode)
            if img.mode == "F":  # float pixels (TIFF): in [0, 1] scaled to 0 .. 255, in [0, 255] as they are
                return Image.fromarray(_float_pixels(np.asarray(img, dtype=np.float64), path)).convert(mode)
            return img.convert(mode)
    except OSError as err:  # PIL.UnidentifiedImageError is an OSError
        raise ValueError(f"{path} is not a readable image ({type(err).__name__}: {error_reason(err)})") from None


def _float_pixels(x, path):
    """8-bit pixels of a float image ``x`` whose values lie in [0, 1] or in [0, 255] (PIL's own conversion turns
    [0, 1] into black); other values are a one-line ``ValueError``: their scale is unknown."""
    import numpy as np

    top = float(x.max()) if x.size else 0.0
    if not np.isfinite(x).all() or x.size and float(x.min()) < 0 or top > 255:
        raise ValueError(f"{path} holds float pixels outside [0, 1] and [0, 255] (or not finite), whose scale is "
                         "unknown; save it as an 8- or 16-bit image")  # fmt: skip
    return np.rint(x * (255.0 if top <= 1 else 1.0)).astype(np.uint8)


DATA_PATH_KINDS = ("imagefolder", "text", "coco")  # --data KIND:PATH of the tasks (a folder or a file)


def absolute_data(data: str) -> str:
    """``--data`` with its path made absolute (``imagefolder:d1`` -> ``imagefolder:/home/me/d1``; ``~`` expanded),
    so that a run's ``config.yaml`` finds its data from any working directory (``eval``, ``--resume``,
    ``load_model``); other values as they are."""
    kind, sep, path = data.partition(":")
    if not sep or kind not in DATA_PATH_KINDS or not path:
        return data
    return f"{kind}:{Path(path).expanduser().absolute()}"


def give_usual_mode(path: str | os.PathLike) -> None:
    """Give the file ``path`` the mode a newly created file gets (``0o666`` less the process's umask):
    safetensors creates its files ``0600``, unlike the run's other outputs. The umask is read from
    ``/proc/self/status`` where there is one (setting it to read it would race with other threads); a
    filesystem that refuses the change keeps the file as it is."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        mask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    try:
        os.chmod(path, 0o666 & ~mask)
    except OSError:
        pass
