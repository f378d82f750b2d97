"""Learning-rate sensitivity study (reproduction report, Sec. 11.3 and Fig. 10): the same recipe at several
learning rates for one or more models, then a table and a plot of accuracy against learning rate."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lambdanet.engine.config import ConfigSource, config_differences, describe_differences, load_yaml
from lambdanet.engine.logger import read_json, write_json
from lambdanet.engine.loop import TrainingDivergedError
from lambdanet.engine.preempt import Preempted
from lambdanet.helpers import is_finite_real, plain_real
from lambdanet.tasks.classification.config import RESUME_FREE
from lambdanet.tasks.classification.task import train

__all__ = ["lr_sweep", "lr_text", "run_name", "sweep_markdown", "plot_sweep"]


def lr_text(lr: float) -> str:
    """``lr`` in a folder name, a table or a log line: ``:g`` (``0.001``) where that names it exactly, else every
    digit of the float (``0.0010000001``: two rates never read the same)."""
    short, lr = f"{lr:g}", float(lr)  # a numpy rate: its repr would name its type
    return short if float(short) == lr else repr(lr)


def _saved_lr(folder: Path) -> float | None:
    """The learning rate of the run in ``folder`` (its ``config.yaml``), ``None`` without one."""
    saved = load_yaml(folder / "config.yaml", written=True).get("lr") if (folder / "config.yaml").is_file() else None
    return float(saved) if isinstance(saved, (int, float)) and not isinstance(saved, bool) else None


def run_name(lr: float, out: Path | None = None, model: str = "") -> str:
    """The run folder of ``lr`` (``lr_<lr_text>``) under ``out / model``. A folder of an earlier version, ``lr_<:g>``,
    that holds a run at exactly ``lr`` is that rate's: an earlier sweep resumes there. Where such a folder holds
    another rate that ``:g`` rounded to this one, this rate takes ``lr_<its float.hex()>``: never the same folder."""
    if out is None:
        return f"lr_{lr_text(lr)}"
    earlier = out / model / f"lr_{float(lr):g}"
    if _saved_lr(earlier) == float(lr):
        return earlier.name
    name = f"lr_{lr_text(lr)}"
    saved = _saved_lr(out / model / name)
    return f"lr_{float(lr).hex()}" if saved is not None and saved != float(lr) else name


def _plan(
    source: ConfigSource, out: Path, lrs: Sequence[float], models: Sequence[str]
) -> list[tuple[str, float, Path, Any]]:
    """``(model, lr, run folder, resolved configuration)`` of every run, each checked against what its folder holds
    (a typo in a model name or a clashing folder is an error before anything trains)."""
    plan = []
    for model in models:
        for lr in lrs:
            run_dir = out / model / run_name(lr, out, model)
            cfg = source.resolve(model=model, lr=lr, out=str(run_dir))
            if (run_dir / "config.yaml").exists():
                # an earlier version kept relative paths as given: compared as this one writes them
                saved = type(cfg).absolute_paths(load_yaml(run_dir / "config.yaml", written=True))
                changed = config_differences(saved, cfg, ignore=RESUME_FREE)
                if changed:
                    raise ValueError(
                        f"{run_dir} holds a run with another configuration: "
                        f"{describe_differences(changed)}; choose another --out for this sweep"
                    )
            plan.append((model, lr, run_dir, cfg))
    return plan


DIVERGED = "diverged.txt"  # in a run folder whose training diverged: a rerun of the sweep does not train it again
DIVERGED_SUMMARY = {"final_acc": math.nan, "best_acc": math.nan, "train_time_s": None}  # what its row shows


def _train_one(model: str, lr: float, run_dir: Path, cfg, log: Callable[[str], None]) -> dict:
    """The summary of one run: read back when finished, else trained (resumed from ``last.pt``); a run that
    diverged (``diverged.txt``, now or before) has NaN accuracies."""
    if (run_dir / "summary.json").exists():
        summary = read_json(run_dir / "summary.json")
        log(f"{model} lr={lr_text(lr)}: already done with this configuration ({summary['final_acc']:.4f})")
        return summary
    if (run_dir / DIVERGED).exists():
        log(f"{model} lr={lr_text(lr)}: diverged before ({(run_dir / DIVERGED).read_text().strip()})")
        return dict(DIVERGED_SUMMARY)
    cfg.resume = (run_dir / "last.pt").exists()
    log(f"--- {model} lr={lr_text(lr)} -> {run_dir}")
    try:
        return train(cfg, log=log)
    except TrainingDivergedError as err:  # a rate too high is a result of the study, not its end
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / DIVERGED).write_text(f"{err}\n")
        log(f"{model} lr={lr_text(lr)}: diverged ({err})")
        return dict(DIVERGED_SUMMARY)
    except Preempted as err:  # the sweep, not that one run, is what continues
        kept = str(err).split("; continue with")[0]
        raise Preempted(f"{kept}; continue with the same lambdanet sweep command") from None


def lr_sweep(
    source: ConfigSource,
    lrs: Sequence[float],
    models: Sequence[str] | None = None,
    *,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train ``source`` once per (model, learning rate) into ``<out>/<model>/lr_<lr>``, each configuration
    resolved for its model. Resumable: a finished run (``summary.json``) whose resolved configuration equals
    the one asked for is read back instead of retrained, an unfinished one is resumed (``--resume`` changes
    nothing); a run directory holding a different configuration is refused, before anything trains. A run that
    diverges is a row with NaN accuracies ("diverged" in ``sweep.md``), and the sweep goes on. One process: the
    runs train one after another (under torchrun, train each rate with ``lambdanet train``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("lambdanet sweep trains its runs one after another in one process; under torchrun, run "
                         "lambdanet train once per learning rate (--lr, --out) instead")  # fmt: skip
    if not lrs:
        raise ValueError("lrs must list at least one learning rate")
    lrs = [plain_real(lr) for lr in lrs]  # numpy rates too
    bad = [lr for lr in lrs if not (is_finite_real(lr) and lr > 0)]
    if bad:
        raise ValueError(f"lrs must be positive finite learning rates, got {bad}")
    source = replace(  # the sweep resumes by itself: --resume (or resume: true in --config) changes nothing
        source,
        yaml_values={k: v for k, v in source.yaml_values.items() if k != "resume"},
        overrides={k: v for k, v in source.overrides.items() if k != "resume"},
    )
    base = source.resolve()
    out = Path(base.out)
    rows = []
    unique = list(dict.fromkeys(lrs))
    for model, lr, run_dir, cfg in _plan(source, out, unique, list(dict.fromkeys(models or [base.model]))):
        summary = _train_one(model, lr, run_dir, cfg, log)
        rows.append(
            {
                "model": model,
                "lr": lr,
                "final_acc": summary["final_acc"],
                "best_acc": summary["best_acc"],
                "train_time_s": summary["train_time_s"],
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    shown = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
    write_json({"rows": shown, "recipe": base.recipe, "data": base.data, "epochs": base.epochs}, out / "sweep.json")
    (out / "sweep.md").write_text(sweep_markdown(rows) + "\n")
    plot_sweep(rows, out / "sweep.png")
    return rows


def sweep_markdown(rows: list[dict]) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    lrs = sorted({r["lr"] for r in rows}, reverse=True)
    acc = {(r["model"], r["lr"]): r["final_acc"] for r in rows}
    lines = ["| learning rate | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for lr in lrs:
        cells = [("diverged" if math.isnan(acc[(m, lr)]) else f"{acc[(m, lr)]:.4f}") if (m, lr) in acc else "-"
                 for m in models]  # fmt: skip
        lines.append(f"| {lr_text(lr)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        pts = sorted((r["lr"], r["final_acc"]) for r in rows if r["model"] == model)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=model)
    ax.set(xscale="log", xlabel="learning rate", ylabel="final test top-1")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
