"""Models shared on the Hugging Face hub: ``create_model("hf-hub:owner/name")`` and ``load_model("hf-hub:...")``.

A repository written by :func:`lambdanet.hub.push_to_hub` holds ``model.safetensors`` (the weights, with the header
``lambdanet train`` writes: architecture, its arguments, classes, preprocessing), ``config.json`` (the same as JSON,
with a timm-style ``pretrained_cfg``) and a model card. Files come through ``huggingface_hub``'s own cache: the
first call downloads, later ones read the cache, also offline (``HF_HUB_OFFLINE=1`` or no network).
"""

from __future__ import annotations

from pathlib import Path

from lambdanet.files import run_metadata

__all__ = ["HF_PREFIX", "WEIGHTS_FILE", "CONFIG_FILE", "hub_repo", "download_hub_weights"]

HF_PREFIX = "hf-hub:"
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def hub_repo(name) -> str | None:
    """The repository id of an ``"hf-hub:owner/name"`` model name (``"owner/name@revision"`` allowed), else ``None``."""
    if not isinstance(name, str) or not name.startswith(HF_PREFIX):
        return None
    repo = name[len(HF_PREFIX) :]
    if repo.count("/") != 1 or not all(repo.split("@")[0].split("/")):
        raise ValueError(f"a hub model is named 'hf-hub:owner/name', got {name!r}")
    return repo


def download_hub_weights(repo: str) -> tuple[Path, dict]:
    """``repo``'s :data:`WEIGHTS_FILE` (downloaded once into huggingface_hub's cache) and its lambdanet header;
    a one-line ``ValueError`` when it cannot be had or is not lambdanet's."""
    from huggingface_hub import hf_hub_download

    repo_id, _, revision = repo.partition("@")
    try:
        path = Path(hf_hub_download(repo_id=repo_id, filename=WEIGHTS_FILE, revision=revision or None))
    except Exception as err:  # offline and not cached, no such repository or file, hub errors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"hf-hub:{repo}: {WEIGHTS_FILE} could not be had from the Hugging Face hub or its cache "
            f"({type(err).__name__}: {reason})"
        ) from None
    meta = run_metadata(path)
    if not meta or "model" not in meta:
        raise ValueError(
            f"hf-hub:{repo}: {WEIGHTS_FILE} was not written by lambdanet (no model description in "
            "its header); load timm checkpoints with timm, or pass checkpoint_path=FILE"
        )
    return path, meta
