"""The file in which the ``impl="auto"`` tuner (:mod:`lambdanet.ops.position_lambda.tuning`) keeps its measured
winners across processes: where it is (``LAMBDANET_AUTOTUNE_CACHE``), its format, reading and merging it, writing it
atomically. A file that cannot be read as this module wrote it is ignored with a warning and rewritten."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection
from pathlib import Path

__all__ = ["ENV_CACHE", "DEFAULT_CACHE_FILE", "CACHE_VERSION", "env_cache_file", "read_winners", "write_winners"]

ENV_CACHE = "LAMBDANET_AUTOTUNE_CACHE"  # a file for the winners; 1 / true / yes / on: DEFAULT_CACHE_FILE
DEFAULT_CACHE_FILE = Path("~/.cache/lambdanet/impl_tuning.json")
CACHE_VERSION = 1


def env_cache_file() -> Path | None:
    """The cache file the environment names (``LAMBDANET_AUTOTUNE_CACHE``), or ``None``."""
    value = os.environ.get(ENV_CACHE, "").strip()
    if not value or value.lower() in ("0", "off", "false", "no"):
        return None
    return (DEFAULT_CACHE_FILE if value.lower() in ("1", "on", "true", "yes") else Path(value)).expanduser()


def read_winners(path: Path, impls: Collection[str], stacklevel: int = 2) -> dict[str, str]:
    """The winners ``{key: impl}`` kept in ``path`` whose implementation is one of ``impls`` (``{}`` when the
    file does not exist, or with a warning at ``stacklevel`` when it cannot be read as this module wrote it)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"not a version-{CACHE_VERSION} impl tuning cache")
        entries = data["winners"]
        if not isinstance(entries, dict):
            raise ValueError("'winners' is not a mapping")
    except (OSError, ValueError, KeyError) as err:  # json.JSONDecodeError is a ValueError
        warnings.warn(f"ignoring the impl tuning cache {path}: {err}", RuntimeWarning, stacklevel=stacklevel + 1)
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and v in impls}


def write_winners(path: Path, winners: dict[str, str], stacklevel: int = 2) -> None:
    """Write ``winners`` to ``path`` atomically (through a temporary file beside it); a failure is a warning at
    ``stacklevel``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "winners": winners}, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"could not write the impl tuning cache {path}: {err}", RuntimeWarning, stacklevel=stacklevel + 1)
