"""Run outputs: per-epoch CSV, TensorBoard, PNG plots and ``summary.json`` (rank 0 only)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

__all__ = ["RunLogger", "plot_history", "write_json", "read_json", "json_finite"]


def write_json(data: dict, path: str | Path) -> None:
    """``data`` as standard JSON, whole or not at all: a value that is not a finite number (a metric a task could not
    measure is NaN) is ``null``, which every JSON reader takes (``NaN`` is Python's extension)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(json_finite(data), indent=2, sort_keys=True, default=str, allow_nan=False))
    tmp.replace(path)


def json_finite(value):
    """``value`` with every float that is NaN or infinite, at any depth of its dicts and lists, as ``None`` (JSON
    has no NaN: a diverged run's loss, a metric not measured)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_finite(v) for v in value]
    return value


def read_json(path: str | Path) -> dict:
    """What :func:`write_json` wrote."""
    return json.loads(Path(path).read_text())


class RunLogger:
    """Appends epoch rows to ``metrics.csv`` and scalars to TensorBoard (``tb/``). Rows may differ in their keys
    (a task may evaluate every few epochs only): a row with a key the file's header lacks rewrites the file
    (atomically) under the union of the keys; a missing key is an empty cell, which :func:`read_history` leaves out
    of its row. ``first_epoch``: the first epoch this logger's run logs (a resumed run's, after its checkpoint);
    TensorBoard hides what earlier event files of ``tb/`` hold from it on (``purge_step``), which an attempt that
    died before its next checkpoint logged, so that the epochs a resumed run redoes are not shown twice."""

    def __init__(self, out: Path, enabled: bool = True, tensorboard: bool = True, first_epoch: int = 1):
        self.out, self.enabled = out, enabled
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(out / "tb"), purge_step=first_epoch)
            except ImportError:  # tensorboard is a dependency, but stay usable without it
                self.writer = None

    def log_epoch(self, row: dict) -> None:
        if not self.enabled:
            return
        path = self.out / "metrics.csv"
        fields = _header(path)
        if fields is not None and set(row) <= set(fields):
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=fields).writerow(row)
        else:
            _write_rows(path, list(dict.fromkeys([*(fields or []), *row])), _cells(path) + [row])
        if self.writer is not None:
            for key, value in row.items():
                if key != "epoch" and isinstance(value, int | float) and value == value:
                    self.writer.add_scalar(key.replace("_", "/", 1), value, row["epoch"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _write_rows(path: Path, fields: list[str], rows: list[dict]) -> None:
    """``rows`` under the header ``fields``, written to a temporary file that then replaces ``path``."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (int(float(v)) if k == "epoch" else v) for k, v in r.items()})
    tmp.replace(path)


def _cells(path: Path) -> list[dict]:
    """The rows of ``metrics.csv`` as written (strings, empty cells left out)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _header(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    with open(path, newline="") as f:
        return next(csv.reader(f), None)


def read_history(path: Path) -> list[dict]:
    """The rows of ``metrics.csv``, numbers as floats, empty cells left out."""
    return [{k: _num(v) for k, v in row.items()} for row in _cells(path)]


def _num(v: str):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def truncate_history(path: Path, epochs: int) -> None:
    """Keep the rows of the first ``epochs`` epochs (a resumed run redoes the epoch it was killed in); none left (a
    new run): no file, so that the run's first row writes its own header."""
    if not path.exists():
        return
    rows = [r for r in _cells(path) if float(r.get("epoch", 0)) <= epochs]
    if not rows:
        path.unlink()
        return
    _write_rows(path, _header(path) or [], rows)


def plot_history(history: list[dict], out: Path, panels: tuple) -> list[Path]:
    """One PNG per panel (``(file name, metric keys, y label)``), the metrics per epoch from the CSV rows;
    epochs where a metric is missing (not evaluated) are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return []
    paths = []
    for name, keys, ylabel in panels:
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in keys:
            pts = [
                (r["epoch"], r[key])
                for r in history
                if isinstance(r.get(key), int | float) and not isinstance(r[key], bool) and r[key] == r[key]
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=key)
        ax.set(xlabel="epoch", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths
