"""Learning-rate sensitivity study (reproduction report, Sec. 11.3 and Fig. 10): the same recipe at several
learning rates for one or more models, then a table and a plot of accuracy against learning rate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from lambdanet.engine.config import ConfigSource, config_differences, describe_differences, load_yaml
from lambdanet.engine.logger import read_json, write_json
from lambdanet.files import absolute_data
from lambdanet.tasks.classification.config import RESUME_FREE
from lambdanet.tasks.classification.task import train

__all__ = ["lr_sweep", "sweep_markdown", "plot_sweep"]


def lr_sweep(
    source: ConfigSource,
    lrs: Sequence[float],
    models: Sequence[str] | None = None,
    *,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train ``source`` once per (model, learning rate) into ``<out>/<model>/lr_<lr>``, each configuration
    resolved for its model. Resumable: a finished run (``summary.json``) whose resolved configuration equals
    the one asked for is read back instead of retrained, an unfinished one is resumed; a run directory
    holding a different configuration is refused."""
    if not lrs:
        raise ValueError("lrs must list at least one learning rate")
    if any(lr <= 0 for lr in lrs):
        raise ValueError(f"learning rates must be positive, got {list(lrs)}")
    base = source.resolve()
    out = Path(base.out)
    rows = []
    for model in models or [base.model]:
        for lr in lrs:
            run_dir = out / model / f"lr_{lr:g}"
            cfg = source.resolve(model=model, lr=lr, out=str(run_dir))
            if (run_dir / "config.yaml").exists():
                saved = load_yaml(run_dir / "config.yaml")
                if isinstance(saved.get("data"), str):  # an earlier version kept a relative path as given
                    saved["data"] = absolute_data(saved["data"])
                changed = config_differences(saved, cfg, ignore=RESUME_FREE)
                if changed:
                    raise ValueError(
                        f"{run_dir} holds a run with another configuration: "
                        f"{describe_differences(changed)}; choose another --out for this sweep"
                    )
            if (run_dir / "summary.json").exists():
                summary = read_json(run_dir / "summary.json")
                log(f"{model} lr={lr:g}: already done with this configuration ({summary['final_acc']:.4f})")
            else:
                cfg.resume = (run_dir / "last.pt").exists()
                log(f"--- {model} lr={lr:g} -> {run_dir}")
                summary = train(cfg, log=log)
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
    write_json({"rows": rows, "recipe": base.recipe, "data": base.data, "epochs": base.epochs}, out / "sweep.json")
    (out / "sweep.md").write_text(sweep_markdown(rows) + "\n")
    plot_sweep(rows, out / "sweep.png")
    return rows


def sweep_markdown(rows: list[dict]) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    lrs = sorted({r["lr"] for r in rows}, reverse=True)
    acc = {(r["model"], r["lr"]): r["final_acc"] for r in rows}
    lines = ["| learning rate | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for lr in lrs:
        cells = [f"{acc[(m, lr)]:.4f}" if (m, lr) in acc else "-" for m in models]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
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
