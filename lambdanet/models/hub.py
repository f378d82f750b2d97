"""Models shared on the Hugging Face hub: ``create_model("hf-hub:owner/name")`` and ``load_model("hf-hub:...")``.

A repository written by :func:`lambdanet.hub.push_to_hub` holds ``model.safetensors`` (the weights, with the header
``lambdanet train`` writes: architecture, its arguments, classes, preprocessing), ``config.json`` (the same as JSON,
with a timm-style ``pretrained_cfg``) and a model card. Files come through ``huggingface_hub``'s own cache: the
first call downloads, later ones read the cache, also offline (``HF_HUB_OFFLINE=1`` or no network).

Offline, every download fails at once (:func:`hub_download`): huggingface_hub alone would retry a connection that
cannot succeed for about 25 s before saying so.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from lambdanet.files import error_reason, run_metadata

__all__ = [
    "HF_PREFIX",
    "WEIGHTS_FILE",
    "CONFIG_FILE",
    "hub_repo",
    "hub_unreachable",
    "hub_download",
    "download_hub_weights",
]

HF_PREFIX = "hf-hub:"
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def hub_repo(name) -> str | None:
    """The repository id of an ``"hf-hub:owner/name"`` model name (``"owner/name@revision"`` allowed), else ``None``."""
    if not isinstance(name, str) or not name.startswith(HF_PREFIX):
        return None
    repo = name[len(HF_PREFIX) :]
    repo_id = repo.partition("@")[0]  # a revision may hold slashes itself: refs/pr/1
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"a hub model is named 'hf-hub:owner/name' (or 'hf-hub:owner/name@revision'), got {name!r}")
    return repo


_TRUE = ("1", "ON", "YES", "TRUE")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, or ``None`` when it may be: ``HF_HUB_OFFLINE`` set, or no
    TCP connection to its host (``HF_ENDPOINT``'s) within ``timeout`` seconds, tried once. Behind a proxy
    (``HTTPS_PROXY``, ``ALL_PROXY``) the host is not tried: huggingface_hub goes through the proxy."""
    from huggingface_hub import constants

    # is_offline_mode() is huggingface_hub >= 1.2; older releases keep the flag as HF_HUB_OFFLINE
    offline = getattr(constants, "is_offline_mode", lambda: bool(getattr(constants, "HF_HUB_OFFLINE", False)))()
    if offline or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in _PROXIES):
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host} cannot be reached: {error_reason(err, 120)}"
    return None


def hub_download(repo_id: str, filename: str, revision: str | None = None) -> str:
    """``huggingface_hub.hf_hub_download`` (its cache, refreshed when online) that fails at once offline
    (:func:`hub_unreachable`): then the cached copy, or an ``OSError`` saying the hub is offline and the file
    is not in the cache."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import LocalEntryNotFoundError  # (huggingface_hub.errors only from 0.23)

    why = hub_unreachable()
    if why is None:
        return hf_hub_download(repo_id=repo_id, filename=filename, revision=revision)
    try:
        return hf_hub_download(repo_id=repo_id, filename=filename, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        raise OSError(f"offline ({why}) and not in huggingface_hub's cache") from None


def download_hub_weights(repo: str) -> tuple[Path, dict]:
    """``repo``'s :data:`WEIGHTS_FILE` (downloaded once into huggingface_hub's cache) and its lambdanet header;
    a one-line ``ValueError`` when it cannot be had or is not lambdanet's."""
    repo_id, _, revision = repo.partition("@")
    try:
        path = Path(hub_download(repo_id, WEIGHTS_FILE, revision or None))
    except Exception as err:  # offline and not cached, no such repository or file, hub errors
        raise ValueError(
            f"hf-hub:{repo}: {WEIGHTS_FILE} could not be had from the Hugging Face hub or its cache "
            f"({type(err).__name__}: {error_reason(err)})"
        ) from None
    meta = run_metadata(path)
    if not meta or "model" not in meta:
        raise ValueError(
            f"hf-hub:{repo}: {WEIGHTS_FILE} was not written by lambdanet (no model description in "
            "its header); load timm checkpoints with timm, or pass checkpoint_path=FILE"
        )
    return path, meta
