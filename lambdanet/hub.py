"""Share trained models on the Hugging Face hub: ``push_to_hub(run_dir_or_model, "owner/name")``.

:func:`save_for_hub` writes what a hub repository holds, into a local folder:

* ``model.safetensors``: the weights with lambdanet's header (architecture, its arguments, classes,
  preprocessing), the file ``lambdanet train`` writes (a run's EMA weights when it has them);
* ``config.json``: the same as JSON, timm's layout (``architecture``, ``num_classes``, ``model_args``,
  ``pretrained_cfg`` in timm's keys) plus ``classes`` and ``library_name``;
* ``README.md``: the model card: the run's metrics from ``summary.json``, the command that trained it, how to
  load it; and the run's ``config.yaml`` and ``summary.json`` beside it.

:func:`push_to_hub` uploads that folder with ``huggingface_hub`` (one commit). Loading it back is
``lambdanet.create_model("hf-hub:owner/name")`` or ``lambdanet.load_model("hf-hub:owner/name")``
(:mod:`lambdanet.models.hub`); the logits are bit-equal to the run's own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import cast

from torch import nn

from lambdanet.files import error_reason, give_usual_mode, run_file, run_metadata, task_of_config, weights_metadata
from lambdanet.models.hub import CONFIG_FILE, WEIGHTS_FILE, hub_unreachable
from lambdanet.models.registry import run_image_cfg

__all__ = ["save_for_hub", "push_to_hub", "model_card", "lm_card"]


def _from_model(model: nn.Module, folder: Path) -> dict:
    """Weights and metadata of an in-memory image model made by ``create_model`` / ``load_model``."""
    from safetensors.torch import save_model

    cfg = getattr(model, "pretrained_cfg", None) or {}
    if "input_size" not in cfg or not hasattr(model, "model_kwargs"):
        raise ValueError(
            "push_to_hub takes a run directory, its weights file, or an image model made by "
            "lambdanet.create_model / load_model (it needs pretrained_cfg and model_kwargs)"
        )
    in_chans, size, _ = cfg["input_size"]
    meta = {
        "model": cfg["architecture"],
        "model_kwargs": dict(cast(dict, model.model_kwargs)),
        "num_classes": cfg["num_classes"],
        "in_chans": in_chans,
        "classes": cfg.get("classes"),
        "data": cfg.get("data"),
        "image_size": size,
        "mean": list(cfg["mean"]),
        "std": list(cfg["std"]),
        "crop_pct": cfg.get("crop_pct"),  # the model's own preprocessing, not only its data's
        "interpolation": cfg.get("interpolation"),
    }
    save_model(model, str(folder / WEIGHTS_FILE), metadata=weights_metadata(**meta), force_contiguous=True)
    give_usual_mode(folder / WEIGHTS_FILE)  # not safetensors' 0600
    return meta


# the hub's names: letters, digits, '-', '_', '.', at most 96 characters, no '--' or '..', not starting or ending
# with '-' or '.' (huggingface_hub's validate_repo_id)
_HUB_NAME = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
SHARED_RUN_RECORDS = ("summary.json", "config.yaml")  # copied from a run directory where it has them
REPOSITORY_FILES = (WEIGHTS_FILE, CONFIG_FILE, "README.md", *SHARED_RUN_RECORDS)


def _check_repo_id(repo_id) -> None:
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(_HUB_NAME.fullmatch(part) for part in parts):
        raise ValueError(
            f"repo_id must be 'owner/name' (letters, digits, '-', '_' or '.', each at most 96), got {repo_id!r}"
        )


def _check_folder(folder: Path, run_dir: Path | None) -> None:
    """A one-line ``ValueError`` unless ``folder`` may receive the repository's files: not the run's own directory
    (its weights would be replaced), and new, empty (but for git's dot-files: a clone of the hub repository), or an
    earlier repository folder of :func:`save_for_hub` (lambdanet's ``config.json`` and none but
    :data:`REPOSITORY_FILES`): other files are never overwritten."""
    if run_dir is not None and folder.resolve() == run_dir.resolve():
        raise ValueError(f"folder {folder} is the run directory itself: pass another folder for the repository")
    # a clone of a hub repository: .git, .gitattributes, ... are git's, never written here
    present = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []
    if not present:
        return
    try:
        ours = json.loads((folder / CONFIG_FILE).read_text()).get("library_name") == "lambdanet"
    except (OSError, ValueError, AttributeError):
        ours = False
    other = sorted(set(present) - set(REPOSITORY_FILES)) if ours else present
    if other:
        shown = ", ".join(other[:5]) + (", ..." if len(other) > 5 else "")
        what = "holds other files than lambdanet's repository" if ours else "is not empty and is not a repository"
        raise ValueError(f"folder {folder} {what} ({shown}): pass a new or empty folder, a clone of the hub "
                         "repository, or one lambdanet wrote (nothing else in it is overwritten)")  # fmt: skip


def _clear_run_files(folder: Path) -> None:
    """Remove an earlier repository's copies of its run's files from ``folder``: a source without them (a model
    object, a run without a ``config.yaml``) must not leave another run's beside its weights."""
    for name in SHARED_RUN_RECORDS:
        (folder / name).unlink(missing_ok=True)


def save_for_hub(source: str | os.PathLike | nn.Module, folder: str | os.PathLike, repo_id: str | None = None) -> Path:
    """Write the hub repository of ``source`` (a ``lambdanet train`` or ``lambdanet lm train`` run directory, its
    ``.safetensors`` weights, or an image model from ``create_model`` / ``load_model``) into ``folder`` (see the
    module docstring; a language model's ``config.json`` holds ``architecture``, ``vocab_size``, ``model_args``,
    ``context`` and ``data``); the model card's loading code names ``repo_id`` (``OWNER/NAME`` without one)."""
    if repo_id is not None:
        _check_repo_id(repo_id)
    folder = Path(folder).expanduser()
    summary, run_dir = {}, None
    meta: dict | None
    if isinstance(source, nn.Module):
        _check_folder(folder, None)
        folder.mkdir(parents=True, exist_ok=True)
        _clear_run_files(folder)
        meta = _from_model(source, folder)
    else:
        weights = run_file(source)
        if not weights.exists():
            raise ValueError(f"{source} does not exist; pass a run directory of lambdanet train or lambdanet lm train "
                             "(or its model.safetensors / model_ema.safetensors)")  # fmt: skip
        if weights.suffix == ".pt" and Path(source).expanduser().is_dir():  # what run_file falls back to
            raise ValueError(f"{source}: a run stopped before its end holds only its training checkpoint "
                             f"({weights.name}); finish it with --resume (its weights are what is shared)")  # fmt: skip
        if weights.suffix == ".pt":  # named by the caller
            raise ValueError(f"{source} is a training checkpoint; pass its run directory or the run's "
                             "model.safetensors / model_ema.safetensors")  # fmt: skip
        meta = run_metadata(weights) if weights.is_file() else None
        if not meta or task_of_config(meta) not in ("classify", "lm"):
            raise ValueError(
                f"{source}: not the weights of a lambdanet train or lambdanet lm train run (a run directory or its "
                "model.safetensors / model_ema.safetensors)"
            )
        run_dir = weights.parent
        _check_folder(folder, run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        _clear_run_files(folder)
        shutil.copyfile(weights, folder / WEIGHTS_FILE)
        for name in SHARED_RUN_RECORDS:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, folder / name)
        if (run_dir / "summary.json").is_file():
            summary = json.loads((run_dir / "summary.json").read_text())
    if task_of_config(meta) == "lm":
        return _lm_repository(folder, meta, summary, repo_id or "OWNER/NAME")
    cfg = run_image_cfg(meta)
    config = {
        "architecture": meta["model"],
        "num_classes": meta["num_classes"],
        "model_args": meta["model_kwargs"],
        "pretrained_cfg": {**cfg, "input_size": list(cfg["input_size"])},
        "classes": meta.get("classes"),
        "library_name": "lambdanet",
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    has_config = (folder / "config.yaml").is_file()
    (folder / "README.md").write_text(model_card(meta, summary, repo_id=repo_id or "OWNER/NAME", has_config=has_config))
    return folder


def _lm_repository(folder: Path, meta: dict, summary: dict, repo_id: str) -> Path:
    """``config.json`` and the model card of a language model's repository (its weights are in ``folder``)."""
    config = {
        "architecture": meta["model"],
        "vocab_size": meta["vocab_size"],
        "model_args": meta["model_kwargs"],
        "context": meta.get("context"),
        "data": meta.get("data"),
        "library_name": "lambdanet",
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    has_config = (folder / "config.yaml").is_file()
    (folder / "README.md").write_text(lm_card(meta, summary, repo_id=repo_id, has_config=has_config))
    return folder


def lm_card(meta: dict, summary: dict, *, repo_id: str = "OWNER/NAME", has_config: bool = False) -> str:
    """The ``README.md`` of a shared language model (a ``lambdanet lm train`` run): its validation bits per byte
    from ``summary`` (may be empty), how it was trained and how to load and sample it."""
    rows = [
        ("validation bits per byte", summary.get("val_bits_per_byte"), "{:.4f}"),
        ("validation bytes", summary.get("val_bytes"), "{:,}"),
        ("parameters", summary.get("params"), "{:,}"),
        ("steps", summary.get("steps"), "{:,}"),
        ("training time (s)", summary.get("train_time_s"), "{:.0f}"),
    ]
    metrics = [f"| {name} | {fmt.format(value)} |" for name, value, fmt in rows if value is not None]
    arch, data = meta["model"], meta.get("data") or "unknown data"
    lines = ["---", "library_name: lambdanet", "tags:", "- text-generation", "- lambda-networks", "---", "",
             f"# {arch} trained on {data}", "",
             f"A byte-level language model `{arch}` ({json.dumps(meta['model_kwargs'])}, vocabulary "
             f"{meta['vocab_size']}, trained on contexts of {meta.get('context')} bytes) trained with lambdanet "
             "(`pip install lambdanet`), the PyTorch reference implementation of LambdaNetworks (Bello, ICLR 2021).",
             ""]  # fmt: skip
    if metrics:
        lines += ["## Results", "", "| metric | value |", "|---|---|", *metrics, ""]
    if has_config:
        lines += ["## Training", "", "Trained with `lambdanet lm train --config config.yaml`; `config.yaml` here "
                  "holds every option of the run, `summary.json` its results.", ""]  # fmt: skip
    lines += ["## Use", "", "```python", "import torch", "import lambdanet", "",
              f'model = lambdanet.create_model("hf-hub:{repo_id}").eval()',
              'prompt = torch.tensor([list(b"def ")])',
              "out = model.generate(prompt, 64, temperature=0.8, token_limit=256)  # bytes",
              "print(bytes(out[0].tolist()).decode(errors=\"replace\"))", "```", ""]  # fmt: skip
    return "\n".join(lines)


def model_card(meta: dict, summary: dict, *, repo_id: str = "OWNER/NAME", has_config: bool = False) -> str:
    """The ``README.md`` of a shared model: front matter for the hub, the metrics of ``summary`` (a run's
    ``summary.json``; may be empty), how it was trained and how to load it."""
    rows = [
        ("test top-1", summary.get("final_acc"), "{:.2%}"),
        ("test top-5", summary.get("final_top5"), "{:.2%}"),
        (f"best test top-1 (epoch {summary.get('best_epoch')})", summary.get("best_acc"), "{:.2%}"),
        ("parameters", summary.get("params"), "{:,}"),
        ("epochs", summary.get("epochs"), "{}"),
        ("training time (s)", summary.get("train_time_s"), "{:.0f}"),
        ("hardware", summary.get("hardware"), "{}"),
    ]
    metrics = [f"| {name} | {fmt.format(value)} |" for name, value, fmt in rows if value is not None]
    data, arch = meta.get("data") or "unknown data", meta["model"]
    lines = [
        "---",
        "library_name: lambdanet",
        "tags:",
        "- image-classification",
        "- lambda-networks",
        "---",
        "",
        f"# {arch} trained on {data}",
        "",
        f"A `{arch}` ({json.dumps(meta['model_kwargs'])}) trained with lambdanet (`pip install lambdanet`), "
        "the PyTorch reference implementation of LambdaNetworks (Bello, ICLR 2021): "
        f"{meta['num_classes']} classes, {meta['in_chans']}-channel "
        f"{meta['image_size']}x{meta['image_size']} inputs normalised with mean {meta['mean']} and std "
        f"{meta['std']}.",
        "",
    ]
    if metrics:
        lines += ["## Results", "", "| metric | value |", "|---|---|", *metrics, ""]
    lines += ["## Training", ""]
    if has_config:
        lines += [
            f"Trained with `lambdanet train --config config.yaml` (recipe `{summary.get('recipe', '?')}`); "
            "`config.yaml` here holds every option of the run, `summary.json` its results.",
            "",
        ]
    else:
        lines += [
            "Weights of a model built with `lambdanet.create_model`; see the uploader for how it was trained.",
            "",
        ]
    lines += [
        "## Use",
        "",
        "```python",
        "import lambdanet",
        "from lambdanet.predict import predict",
        "",
        f'model = lambdanet.create_model("hf-hub:{repo_id}")  # or lambdanet.load_model("hf-hub:{repo_id}")',
        'print(predict(model, "image.png"))  # top-5 classes, preprocessed as model.pretrained_cfg says',
        "```",
        "",
        "The preprocessing is in `model.pretrained_cfg`, in timm's keys "
        "(`timm.data.resolve_data_config(model=model)` reads it).",
        "",
    ]
    return "\n".join(lines)


def push_to_hub(
    source: str | os.PathLike | nn.Module,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload ``source`` (see :func:`save_for_hub`) to the hub repository ``repo_id`` (created when missing) in
    one commit; returns the commit's URL. Needs a token with write access (``huggingface-cli login`` or
    ``token``). Offline (:func:`lambdanet.models.hub.hub_unreachable`) or refused by the hub: a one-line
    ``ValueError``."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError  # (huggingface_hub.errors only from 0.23)

    _check_repo_id(repo_id)
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_for_hub(source, tmp, repo_id)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                revision=revision,
                commit_message=commit_message or "Upload lambdanet model",
                # an earlier upload's files this one lacks (another run's summary.json) go; the owner's others stay
                delete_patterns=list(REPOSITORY_FILES),
            )
        except Exception as err:  # offline (connection errors of several libraries), refused (no token, ...)
            if (why := hub_unreachable()) is not None:
                raise ValueError(
                    f"cannot upload to {repo_id}: offline ({why}); write the repository's files with "
                    "save_for_hub (CLI: --folder DIR) and upload them when online"
                ) from None
            if isinstance(err, HfHubHTTPError):  # no token, no write access, ...
                raise ValueError(f"the Hugging Face hub refused the upload to {repo_id}: {error_reason(err)}") from None
            raise
    return str(getattr(info, "commit_url", info))
