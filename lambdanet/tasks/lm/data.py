"""Byte corpora for the language models: the Python standard library's own sources (every machine with Python
has them, no network) or a user's text file or folder (``text:PATH``).

Bytes are the tokens (vocabulary 256, no tokenizer): any file reads, UTF-8 or not. The validation split is
chosen per file by a hash of its path relative to the corpus root (:data:`VAL_PERCENT` of the files), so it
does not depend on the machine's file order and never shares a file with training; a single file (or a folder
whose hash split leaves one side empty) keeps its last :data:`VAL_PERCENT` of bytes for validation instead.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["Corpus", "load_corpus", "windows", "stdlib_root", "is_validation_file", "VAL_PERCENT", "DATA_HELP"]

VAL_PERCENT = 5
MIN_VAL = 2  # bytes of a split: one byte predicts nothing (its first byte is only read)
DATA_HELP = "corpus: stdlib (this Python's standard library sources) or text:FILE|DIR (bytes of a file or folder)"


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into ``train`` and ``val`` (1-d ``uint8`` tensors); ``files``: (train, val) counts, or
    ``(files, 0)`` where the validation bytes are the corpus's tail (too few files for a split by file)."""

    name: str
    train: Tensor
    val: Tensor
    files: tuple[int, int]

    @property
    def max_byte(self) -> int:
        return max(int(t.max()) for t in (self.train, self.val) if t.numel())


def stdlib_root() -> Path:
    """The running interpreter's standard library folder (``Lib``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation_file(relative: str) -> bool:
    """Whether the file at ``relative`` (POSIX path under the corpus root) is in the validation split."""
    # the name's bytes as the file system has them (a name that is not UTF-8 comes back with surrogates)
    return int(hashlib.sha256(os.fsencode(relative)).hexdigest(), 16) % 100 < VAL_PERCENT


def _split_files(root: Path, paths: list[Path], name: str) -> Corpus:
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for p in paths:
        parts[is_validation_file(p.relative_to(root).as_posix())].append(p.read_bytes())
    train, val = b"".join(parts[False]), b"".join(parts[True])
    if not train + val:
        raise ValueError(f"data {name} holds no bytes")
    if len(train) < MIN_VAL or len(val) < MIN_VAL:  # too few files for a hash split: the last bytes validate
        return _split_tail(train + val, name, len(paths))
    return Corpus(name, _tensor(train), _tensor(val), (len(parts[False]), len(parts[True])))


def _split_tail(data: bytes, name: str, files: int = 1) -> Corpus:
    if len(data) < 2 * MIN_VAL:
        raise ValueError(
            f"data {name} holds {len(data)} byte(s); a corpus needs at least {2 * MIN_VAL} (training and validation "
            f"bytes, {MIN_VAL} each: the first byte of a split predicts the next)"
        )
    cut = len(data) - max(MIN_VAL, len(data) * VAL_PERCENT // 100)
    return Corpus(name, _tensor(data[:cut]), _tensor(data[cut:]), (files, 0))


def _tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(data: str = "stdlib") -> Corpus:
    """The corpus named by ``data``: ``"stdlib"`` (every ``*.py`` under :func:`stdlib_root`, site-packages
    excluded) or ``"text:PATH"`` (a file, or every file under a folder outside hidden folders)."""
    if data == "stdlib":
        root = stdlib_root()
        paths = sorted(
            (
                p
                for p in root.rglob("*.py")
                if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
            ),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not paths:
            raise ValueError(f"data stdlib: no Python sources under {root}; use --data text:PATH")
        return _split_files(root, paths, data)
    if not isinstance(data, str) or not data.startswith("text:") or len(data) == 5:
        raise ValueError(f"data must be 'stdlib' or 'text:FILE|DIR', got {data!r}")
    path = Path(data[5:]).expanduser()
    if path.is_file():
        return _split_tail(path.read_bytes(), data)
    if not path.is_dir():
        raise ValueError(f"data {data}: {path} does not exist")
    runs = _run_folders(path)
    paths = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and not runs.intersection(p.parents)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    return _split_files(path, paths, data)


def _run_folders(root: Path) -> set[Path]:
    """The folders under ``root`` that hold a lambdanet run (``config.yaml`` beside ``last.pt`` or
    ``model.safetensors``): never part of a ``text:DIR`` corpus (a run written into its own data folder would
    otherwise train on its checkpoints when resumed)."""
    return {
        c.parent
        for c in root.rglob("config.yaml")
        if (c.parent / "last.pt").is_file() or (c.parent / "model.safetensors").is_file()
    }


def windows(data: Tensor, starts: Tensor, length: int) -> Tensor:
    """The ``length`` bytes of ``data`` (1-d) from each of ``starts`` as long tokens: ``[len(starts), length]``."""
    return data[starts[:, None] + torch.arange(length)].long()  # b length
