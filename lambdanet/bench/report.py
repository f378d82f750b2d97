"""Benchmark outputs: CSV and JSON per part, a Markdown report, and log-log plots."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from lambdanet.engine.logger import json_finite

__all__ = [
    "environment",
    "write_rows",
    "read_jsonl",
    "append_jsonl",
    "RowLog",
    "partial_path",
    "markdown",
    "plot_scaling",
]


def environment(device: str) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return env


def write_rows(rows: list[dict], out: Path, name: str) -> None:
    """``<out>/<name>.json`` and ``<out>/<name>.csv`` of ``rows`` (no CSV, and an older one removed, without rows);
    non-finite floats are ``null`` in the JSON, ``nan`` in the CSV."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(json_finite(rows), indent=2, default=str, allow_nan=False) + "\n")
    (out / f"{name}.csv").unlink(missing_ok=True)
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out / f"{name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


def read_jsonl(path: Path) -> list:
    """The records of the JSON-lines file ``path`` (none where it is missing); a line cut short by a crash
    mid-write is left out."""
    records = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def append_jsonl(path: Path, record) -> None:
    """Append ``record`` to ``path`` as one line, at once (a stop keeps it); after a last line cut short by a crash
    (no newline at the end), on a line of its own."""
    with Path(path).open("ab+") as f:
        end = f.seek(0, os.SEEK_END)
        cut = end > 0 and f.seek(end - 1) >= 0 and f.read(1) != b"\n"
        f.write(b"\n" * cut + (json.dumps(record, default=str) + "\n").encode())


def partial_path(out: Path, name: str) -> Path:
    """Where :class:`RowLog` keeps the rows of part ``name`` while it runs: ``<out>/<name>.partial.jsonl``."""
    return Path(out) / f"{name}.partial.jsonl"


class RowLog:
    """The rows of a long part as they are measured, appended to ``<out>/<name>.partial.jsonl`` (its first line
    the part's settings): a stop or a crash loses none of them, and a rerun with the same settings takes them up
    (:meth:`done`) instead of measuring them again. Rows kept under other settings (another command into the same
    folder) are set aside in ``<name>.partial-<their settings' digest>.jsonl``, and come back when a command with
    those settings runs again. The runner removes the file once the part is written whole."""

    def __init__(self, out: Path, name: str, settings: dict):
        self.path = partial_path(out, name)
        head = {"settings": json.loads(json.dumps(settings, default=str))}  # as it reads back from the file
        records = read_jsonl(self.path)
        if records and records[0] != head:  # another command's rows: set aside under their settings
            self.path.replace(self._aside(records[0]))
            records = []
        if not records and self._aside(head).is_file():  # this command's rows, set aside by another: back
            self._aside(head).replace(self.path)
            records = read_jsonl(self.path)
        if not records:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            append_jsonl(self.path, head)
        self.rows: list[dict] = [row for record in records[1:] for row in record.get("rows", [])]

    def _aside(self, head: dict) -> Path:
        """Where the rows of the settings ``head`` wait while another command's run in :attr:`path`."""
        digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:12]
        return self.path.with_name(self.path.name.replace(".partial.", f".partial-{digest}."))

    def done(self, **key) -> list[dict]:
        """The rows kept from an earlier run whose fields equal ``key``."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in key.items())]

    def add(self, rows: list[dict]) -> None:
        """Keep ``rows`` (one measurement's, written in one line: all of them or, cut short, none)."""
        append_jsonl(self.path, {"rows": rows})
        self.rows += rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("|", "\\|")


def markdown(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot_scaling(rows: list[dict], out: Path) -> list[Path]:
    """Log-log plots of fwd+bwd time and peak memory against the number of positions, one line per layer
    (at the smallest batch), with reference slopes 1 and 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return []
    batch = min(r["batch"] for r in rows)
    paths = []
    for key, ylabel, fname in (
        ("fwd_bwd_ms", "forward+backward time (ms)", "scaling_time.png"),
        ("peak_bytes", "peak memory (MiB)", "scaling_memory.png"),
    ):
        fig, ax = plt.subplots(figsize=(8, 6))
        for i, layer in enumerate(dict.fromkeys(r["layer"] for r in rows)):
            pts = sorted(
                (r["positions"], r[key] / (2**20 if key == "peak_bytes" else 1))
                for r in rows
                if r["layer"] == layer and r["batch"] == batch
            )
            if pts:  # 10 colours in the default cycle: markers and line styles keep 13+ layers apart
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="osD^v<>phX*P"[i % 12],
                    linestyle="-" if i < 10 else "-.",
                    label=layer,
                )
        xs = sorted({r["positions"] for r in rows})
        y0 = min(r[key] / (2**20 if key == "peak_bytes" else 1) for r in rows)
        for slope, style in ((1, ":"), (2, "--")):
            ax.plot(xs, [y0 * (x / xs[0]) ** slope for x in xs], "k" + style, alpha=0.5, label=f"slope {slope}")
        ax.set(xscale="log", yscale="log", xlabel="positions n = H W", ylabel=ylabel, title=f"batch {batch}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
        plt.close(fig)
        paths.append(out / fname)
    return paths
