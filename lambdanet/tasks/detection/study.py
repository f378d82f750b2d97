"""The side-by-side detection study in LambdaNetworks Table 6's layout.

Per backbone, Table 6 lists box and mask AP on COCO with AP_s/m/l; HaloNet Table 5 adds the backbone-only
time. :func:`study_table` builds that table from the ``summary.json`` of one ``lambdanet detect`` run per
backbone (the same recipe) and, optionally, the rows of ``lambdanet bench detection`` (backbone-only
forward+backward time and peak memory at 1024 x 1024)::

    python -m lambdanet.tasks.detection.study runs/study [bench_results/detection.json]

reads ``runs/study/<backbone>/summary.json`` for each of :data:`lambdanet.tasks.detection.model.STUDY_BACKBONES`
and prints the Markdown table (``scripts/detect_study.sh`` runs the whole study).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from lambdanet.engine.task import data_identity
from lambdanet.engine.values import load_yaml
from lambdanet.tasks.detection.config import DETECT_RESUME_FREE, DetectConfig
from lambdanet.tasks.detection.model import STUDY_BACKBONES

__all__ = ["recipe_mismatch", "study_rows", "study_table"]

SIZE = 1024  # LambdaNetworks Table 6 and HaloNet Table 5 detect at 1024 x 1024
# the options of a run's config.yaml that may differ between the study's rows: the backbone compared, and where
# and how the run is run (what --resume may change, and the evaluation's batch): none changes what is trained or
# how it is scored
PER_RUN = frozenset({"backbone", "eval_batch_size", *DETECT_RESUME_FREE})


def _ap(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}"


def study_rows(summaries: Mapping[str, dict], bench: Sequence[dict] = ()) -> list[dict]:
    """One row per backbone: its label, parameters (the backbone's), AP columns as fractions, and the
    backbone-only forward+backward time (ms) and peak memory (MiB) at 1024 px for batches 1 and 2."""
    rows = []
    for name, summary in summaries.items():
        row = {
            "backbone": name,
            "label": STUDY_BACKBONES.get(name, name),
            "backbone_params": summary.get("backbone_params"),
            "train_time_s": summary.get("train_time_s"),
        }
        row |= {
            k: summary.get(k)
            for k in (
                f"{kind}_{metric}"
                for kind in ("bbox", "segm")
                for metric in ("AP", "AP_small", "AP_medium", "AP_large")
            )
        }
        for r in bench:
            if r["backbone"] == name and r["size"] == SIZE:
                row[f"train_ms_b{r['batch']}"] = r["train_ms"]
                row[f"train_peak_mib_b{r['batch']}"] = r["train_peak_bytes"] / 2**20
        rows.append(row)
    return rows


def study_table(summaries: Mapping[str, dict], bench: Sequence[dict] = ()) -> str:
    """:func:`study_rows` as a Markdown table in Table 6's layout (AP in percent, as the paper prints it)."""
    rows = study_rows(summaries, bench)
    batches = sorted({int(k.rsplit("_b", 1)[1]) for r in rows for k in r if k.startswith("train_ms_b")})
    head = ["Backbone", "Params (M)", "AP bb", "AP bb s/m/l", "AP mask", "AP mask s/m/l"]
    head += [f"{SIZE} px B={b}: ms / MiB" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], "-" if r["backbone_params"] is None else f"{r['backbone_params'] / 1e6:.2f}"]
        for kind in ("bbox", "segm"):
            cells += [_ap(r[f"{kind}_AP"]), "/".join(_ap(r[f"{kind}_AP_{s}"]) for s in ("small", "medium", "large"))]
        for b in batches:
            ms, mib = r.get(f"train_ms_b{b}"), r.get(f"train_peak_mib_b{b}")
            cells.append("-" if ms is None else f"{ms:.0f} / {mib:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recipe_mismatch(configs: Mapping[str, dict]) -> str | None:
    """``None`` when the runs' configurations (backbone name -> its ``config.yaml``) agree on every option but
    :data:`PER_RUN`, else a one-line description of the first option that differs and each run's value. An option
    a run's file lacks (written before the option existed) is what that run ran with: the value ``--resume`` reads
    for it (:attr:`DetectConfig.SAVED_DEFAULTS`, else the default)."""
    base = {**dataclasses.asdict(DetectConfig()), **DetectConfig.SAVED_DEFAULTS}
    configs = {name: {**base, **cfg} for name, cfg in configs.items()}
    for cfg in configs.values():  # one COCO at two mount points (runs on two machines) is one recipe's data
        if isinstance(cfg.get("data"), str):
            cfg["data"] = data_identity(cfg["data"])
    keys = sorted({k for cfg in configs.values() for k in cfg} - PER_RUN)
    for key in keys:
        values = {name: cfg.get(key, "(unset)") for name, cfg in configs.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            return f"{key} differs: " + ", ".join(f"{name} {value!r}" for name, value in values.items())
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print("usage: python -m lambdanet.tasks.detection.study RUNS_DIR [BENCH_DETECTION_JSON]", file=sys.stderr)
        return 2
    runs = Path(args[0])
    summaries = {
        name: json.loads((runs / name / "summary.json").read_text())
        for name in STUDY_BACKBONES
        if (runs / name / "summary.json").is_file()
    }
    if not summaries:
        print(f"error: no {runs}/<backbone>/summary.json for any of {', '.join(STUDY_BACKBONES)}", file=sys.stderr)
        return 2
    try:
        configs = {name: load_yaml(runs / name / "config.yaml", "the run's configuration", written=True)
                   for name in summaries if (runs / name / "config.yaml").is_file()}  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if (mismatch := recipe_mismatch(configs)) is not None:
        print(f"error: the runs in {runs} do not share one recipe ({mismatch}); Table 6 compares backbones trained "
              "alike: train them again with the same options", file=sys.stderr)  # fmt: skip
        return 2
    if len(args) == 2 and not Path(args[1]).is_file():
        print(
            f"error: no benchmark rows at {args[1]} (lambdanet bench detection --out DIR writes DIR/detection.json)",
            file=sys.stderr,
        )
        return 2
    print(study_table(summaries, json.loads(Path(args[1]).read_text()) if len(args) == 2 else []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
