"""Atomic checkpoints, their validation on load, RNG state and safetensors export. A checkpoint is written to
``<name>.tmp``, flushed and fsynced, then renamed over ``<name>``: a crash (even SIGKILL) leaves either the
previous complete file or the new complete file, never a truncated one."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from torch import nn

from lambdanet.files import ZEROED_FILE, error_reason, give_usual_mode, weights_file_kind

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "export_safetensors",
    "unwrap",
    "trained_weights",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, truncated, corrupted or from another run)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / torch.compile / AveragedModel wrappers."""
    for attr in ("module", "_orig_mod"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), nn.Module):
            model = getattr(model, attr)
    return model


def save_checkpoint(state: dict, path: str | os.PathLike) -> None:
    """Write ``state`` atomically (temporary file + fsync + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # persist the rename itself
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`; a clear :class:`CheckpointError` otherwise."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory; pass the training checkpoint in it (its last.pt)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (kind := _file_kind(path)) in (ZEROED_FILE, "an empty file"):  # torch.load: "legacy tar format" for zeros
        what = "its first bytes are zeros" if kind == ZEROED_FILE else "it is an empty file"
        raise CheckpointError(
            f"checkpoint {path} is corrupted or truncated and cannot be loaded ({what}); delete it or restore a copy"
        )
    if kind is not None:
        raise CheckpointError(
            f"{path} is {kind}, not a training checkpoint; pass the last.pt that lambdanet train "
            "writes into its run directory"
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises many types for a damaged zip / pickle
        raise CheckpointError(
            f"checkpoint {path} is corrupted or truncated and cannot be loaded "
            f"({type(err).__name__}: {error_reason(err)}); delete it or restore a copy"
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a lambdanet checkpoint (no 'model' entry)")
    return state


def _file_kind(path: Path) -> str | None:
    """What a file that cannot be a torch checkpoint is (a torch checkpoint is a zip archive or, from old
    torch versions, a pickle), or ``None`` when it may be one."""
    with open(path, "rb") as f:
        head = f.read(64)
    kind = weights_file_kind(path, head)
    if kind in (None, "an empty file", ZEROED_FILE):
        return kind
    if kind == "safetensors":
        return "a safetensors weights file (model weights only, no optimiser or training configuration)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = "\x00"
    if "\x00" in text:  # binary (text holds no NUL bytes; a tar archive's header does)
        return "not a torch checkpoint (neither a zip archive nor a pickle)"
    if path.suffix in (".yaml", ".yml") or ":" in text.splitlines()[0]:
        return "a text file (YAML, e.g. a run's config.yaml)"
    if text.lstrip().startswith(("{", "[")):
        return "a text file (JSON, e.g. a run's summary.json)"
    return "a text file"


def trained_weights(state: dict, ema: bool = True) -> tuple[dict, str]:
    """``(state dict, "ema" | "raw")``: the EMA weights if the checkpoint has them and ``ema``, else the raw."""
    if ema and state.get("ema"):
        return {k.removeprefix("module."): v for k, v in state["ema"].items() if k.startswith("module.")}, "ema"
    return state["model"], "raw"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(state["torch"].cpu())  # a checkpoint loaded onto a GPU moved these too; they are bytes
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU the saving process saw: a machine with fewer GPUs sets those it has (torch's
        # set_rng_state_all raised an IndexError at the first GPU past them, and the run could not resume)
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(saved.cpu(), index)


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list | tuple) else x


def export_safetensors(model: nn.Module, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Model weights (and buffers) as safetensors; shared tensors are stored once. ``metadata`` (strings)
    goes into the file's header, from which a task rebuilds the model. Written
    to ``<name>.tmp`` and renamed over ``path``: a crash leaves the previous file or the new one."""
    from safetensors.torch import save_model

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_model(unwrap(model), str(tmp), metadata=metadata, force_contiguous=True)  # channels-last weights too
    give_usual_mode(tmp)  # safetensors creates its files 0600: the mode of the run's other files
    os.replace(tmp, path)
