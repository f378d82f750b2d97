"""The language-model ablation study (issue 37, docs/language_models.md): the causal lambda layer's own knobs (the
paper's Tables 10-12 and App. B, for sequences) and the options beyond the paper, each trained with one recipe at
one parameter budget over several seeds, against the transformer and the other families of the same size.

Every configuration is a registered family with architecture options (:data:`ABLATIONS`): where its options
move the parameter count more than :data:`BUDGET_TOLERANCE` off the transformer's, the lambda layer's value
depth ``dim_v`` is set to bring it back (:func:`matched_kwargs`). A run is :func:`lambdanet.bench.lm_bench.train_run`
(``lambdanet lm train``'s loss, optimiser, clipping and warm-up + cosine schedule over ``steps``), scored by
validation bits per byte on the first ``eval_bytes`` of the split.

Each finished run is appended to ``<out>/lm_ablation.jsonl`` at once; a study started again with the same
``out`` skips the runs already there (a crash or a stop loses at most the run in progress). Several studies on
one ``out`` share the work: each run is claimed first (``<out>/claims/<config>-seed<seed>``, holding the
process's id; a claim whose process is gone is taken over), so two processes with one thread each keep two cores
busy without running anything twice::

    python -m lambdanet.bench.lm_ablation --out bench_results/lm_ablation             # tiny, 1,200 steps, 3 seeds
    python -m lambdanet.bench.lm_ablation --configs lambda transformer decay_gate --seeds 0
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lambdanet.bench.lm_bench import seed_stats, train_run
from lambdanet.bench.report import append_jsonl, read_jsonl
from lambdanet.models import create_model
from lambdanet.models.lm import LM_SIZES
from lambdanet.runtime import check_device

__all__ = [
    "ABLATIONS",
    "BUDGET_TOLERANCE",
    "DEFAULT_SEEDS",
    "matched_kwargs",
    "study",
    "missing_runs",
    "summarize",
    "summary_table",
    "main",
]

Log = Callable[[str], None]

# name -> (family, architecture options); "lambda" is the paper's layer alone (plain_lambda_lm_<size>, the registered
# default of 0.1.0), the reference of the knobs; lambda_lm_<size> is short_conv4 (its default for a while), then
# fixed_conv4 (its default now). Rows of decay="fixed" trained before its rates left weight decay are relabelled
# <config>_wd in the study's file (not rerun under the name: the fix changed their training)
ABLATIONS: dict[str, tuple[str, dict]] = {
    "transformer": ("transformer", {}),
    "lambda": ("plain_lambda", {}),
    "content_only": ("linear", {}),  # r = 0: no position lambdas (causal linear attention, softmax keys)
    "k8": ("plain_lambda", {"dim_k": 8}),
    "k32": ("plain_lambda", {"dim_k": 32}),
    "heads2": ("plain_lambda", {"heads": 2}),
    "heads8": ("plain_lambda", {"heads": 8}),
    "u2": ("plain_lambda", {"dim_u": 2}),
    "u4": ("plain_lambda", {"dim_u": 4}),
    "lambdas2": ("plain_lambda", {"lambdas": 2}),  # two lambdas, two query heads each
    "lambdas4": ("plain_lambda", {"lambdas": 4}),  # App. B.3's multi-head lambdas: one per head
    "position_only": ("plain_lambda", {"content": False}),  # Table 10's position-only lambdas
    "query_softmax": ("plain_lambda", {"query_softmax": True}),  # Table 12: + softmax on the queries
    "key_l2": ("plain_lambda", {"key_norm": "l2"}),  # Table 12: L2 on the keys (over the prefix)
    "key_none": ("plain_lambda", {"key_norm": "none"}),  # Table 12: no key normalisation
    "r16": ("plain_lambda", {"r": 16}),
    "r256": ("plain_lambda", {"r": 256}),
    "decay_fixed": ("plain_lambda", {"decay": "fixed"}),
    "decay_gate": ("plain_lambda", {"decay": "gate"}),
    "short_conv4": ("plain_lambda", {"short_conv": 4}),
    "gate_conv4": ("plain_lambda", {"decay": "gate", "short_conv": 4}),
    "fixed_conv4": ("plain_lambda", {"decay": "fixed", "short_conv": 4}),  # lambda_lm_<size>'s default
    "fixed_conv4_heads8": ("plain_lambda", {"decay": "fixed", "short_conv": 4, "heads": 8}),  # + heads8's queries
    "gate_conv4_heads8": ("plain_lambda", {"decay": "gate", "short_conv": 4, "heads": 8}),  # the gate, 8 queries
    "fixed_conv4_u2": ("plain_lambda", {"decay": "fixed", "short_conv": 4, "dim_u": 2}),  # + u2's intra-depth
    "hybrid": ("hybrid", {}),
}
BUDGET_TOLERANCE = 0.02  # parameters within 2% of the transformer's of the same size
DEFAULT_SEEDS = (0, 1, 2)


def _params(name: str, kwargs: dict) -> int:
    with torch.device("meta"):  # counted, not initialised
        return sum(p.numel() for p in create_model(name, **kwargs).parameters())


def matched_kwargs(family: str, size: str, kwargs: dict) -> tuple[dict, int, int]:
    """``(options, parameters, the transformer's)``: ``kwargs`` as given where the model is within
    :data:`BUDGET_TOLERANCE` of ``transformer_lm_<size>``'s parameters, else with the lambda layer's ``dim_v`` (a
    multiple of 8) that comes closest; a ``ValueError`` when none brings it within the tolerance."""
    name, reference = f"{family}_lm_{size}", _params(f"transformer_lm_{size}", {})
    params = _params(name, kwargs)
    if abs(params / reference - 1) <= BUDGET_TOLERANCE or family == "transformer" or "dim_v" in kwargs:
        return dict(kwargs), params, reference
    best, params = _closest_dim_v(name, kwargs, reference, LM_SIZES[size].dim)
    if abs(params / reference - 1) > BUDGET_TOLERANCE:
        raise ValueError(f"{name} with {kwargs} cannot be brought within 2% of {reference} parameters by dim_v")
    return {**kwargs, "dim_v": best}, params, reference


def _closest_dim_v(name: str, kwargs: dict, reference: int, dim: int) -> tuple[int, int]:
    """The ``dim_v`` among the multiples of 8 up to ``4 dim`` whose model's parameters come closest to ``reference``
    (the smaller on a tie), and that count: the count grows with ``dim_v``, so a bisection finds the first one at or
    above ``reference`` and the closest is it or the one before (a handful of models built, not ``dim / 2``)."""
    values = range(8, 4 * dim + 1, 8)
    counts: dict[int, int] = {}

    def count(v: int) -> int:  # each model built once
        if v not in counts:
            counts[v] = _params(name, {**kwargs, "dim_v": v})
        return counts[v]

    lo, hi = 0, len(values) - 1
    while lo < hi:  # the first value whose count reaches the reference (the last if none does)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(values[mid]) < reference else (lo, mid)
    best = min(values[max(lo - 1, 0) : lo + 1], key=lambda v: abs(count(v) - reference))  # the smaller on a tie
    return best, count(best)


def _matching(path: Path, settings: dict, matched: dict) -> list[dict]:
    """The finished rows of ``path`` with the study's settings, device and options."""
    return [r for r in read_jsonl(path)  # a line cut short by a crash is left out: its run reruns
            if all(r.get(k, "cpu" if k == "device" else None) == v for k, v in settings.items())
            and r.get("config") in matched and r["model_kwargs"] == matched[r["config"]][0]]  # fmt: skip


def _started(pid: int) -> str:
    """When process ``pid`` started (``/proc/<pid>/stat``'s start time, in clock ticks since boot; with the boot's
    id where there is one), ``""`` where unknown: with its id, it names one process even after the id is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22; the name before ')' may hold spaces


def _holder() -> str:
    """What this process writes into a claim: ``<pid> <start>``."""
    return f"{os.getpid()} {_started(os.getpid())}".strip()


def _alive(holder: str) -> bool:
    """Whether the process of a claim's ``<pid> [<start>]`` still runs (a reused id with another start: no)."""
    pid_text, _, start = holder.partition(" ")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's process: alive, if it is the one that claimed
        pass
    return not start or not _started(pid) or _started(pid) == start


def _claim(claim: Path) -> bool:
    """Whether this process may run the claim's configuration and seed: it creates ``claim`` with its process id
    and start time, or takes it over from a process that is gone; ``False`` while another live process holds it."""
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            holder = claim.read_text().strip()
        except OSError:
            holder = ""
        if holder and holder.split(" ")[0] != str(os.getpid()) and _alive(holder):
            return False
        claim.write_text(_holder())
        return True
    with os.fdopen(fd, "w") as f:
        f.write(_holder())
    return True


def study(
    configs: Sequence[str] = tuple(ABLATIONS),
    *,
    out: str | Path,
    size: str = "tiny",
    seeds: Sequence[int] = DEFAULT_SEEDS,
    steps: int = 1200,
    context: int = 256,
    batch: int = 16,
    eval_bytes: int = 262144,
    device: str = "cpu",
    log: Log = print,
) -> list[dict]:
    """Train every configuration of ``configs`` (names of :data:`ABLATIONS`) once per seed, seeds outermost (a
    partial study has every configuration at its first seeds); rows already in ``<out>/lm_ablation.jsonl`` for
    the same settings, device and options are kept, not rerun. Every configuration is built and matched to the
    budget before the first run (a bad one is an error at once). Returns every row of the study's settings."""
    unknown = [c for c in configs if c not in ABLATIONS]
    if unknown:
        raise ValueError(f"configs must be among {list(ABLATIONS)}, got {unknown}")
    matched = {c: matched_kwargs(ABLATIONS[c][0], size, ABLATIONS[c][1]) for c in configs}
    path = Path(out) / "lm_ablation.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    from lambdanet.tasks.lm.data import load_corpus

    corpus, settings = load_corpus("stdlib"), {"size": size, "steps": steps, "context": context, "batch": batch,
                                               "eval_bytes": eval_bytes, "device": device}  # fmt: skip
    for seed in seeds:
        for config in configs:
            rows = _matching(path, settings, matched)  # read again: another process may have finished it
            claim = path.parent / "claims" / f"{config}-seed{seed}"
            if any(r["config"] == config and r["seed"] == seed for r in rows):
                continue
            if not _claim(claim):
                log(f"  seed {seed} {config}: running in another process (claim {claim}), skipped")
                continue
            family = ABLATIONS[config][0]
            kwargs, params, reference = matched[config]
            started = time.perf_counter()
            res = train_run(f"{family}_lm_{size}", corpus, context, batch, seed, steps=steps, seconds=None,
                            device=torch.device(device), eval_bytes=eval_bytes, model_kwargs=kwargs)  # fmt: skip
            done = res.pop("steps")  # the settings' steps stay: a diverged run stops early, and still matches them
            row = {"config": config, "family": family, "model_kwargs": kwargs, "seed": seed, **settings,
                   "params": params, "params_vs_transformer": params / reference, **res, "steps_done": done,
                   "wall_s": time.perf_counter() - started}  # fmt: skip
            append_jsonl(path, row)  # at once: a stopped study keeps every finished run
            claim.unlink(missing_ok=True)
            log(f"  seed {seed} {config}: {res['val_bits_per_byte']:.4f} bits/byte, {params / 1e3:.0f}k params, "
                f"{row['wall_s']:.0f}s")  # fmt: skip
    return _matching(path, settings, matched)


def missing_runs(rows: Sequence[dict], configs: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """``"<config> seed <seed>"`` for each run of ``configs`` x ``seeds`` that ``rows`` lacks (another process held
    its claim)."""
    have = {(r["config"], r["seed"]) for r in rows}
    return [f"{c} seed {s}" for s in seeds for c in configs if (c, s) not in have]


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per configuration: seeds, mean, sample standard deviation and range of the bits per byte, the mean over the
    transformer's (seeds both have), parameters against the transformer's."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    base = {r["seed"]: r["val_bits_per_byte"] for r in by.get("transformer", [])}
    out = []
    for config, mine in by.items():
        bpb = [r["val_bits_per_byte"] for r in mine]
        paired = [r["val_bits_per_byte"] / base[r["seed"]] for r in mine if r["seed"] in base]
        mean, std, low, high = seed_stats(bpb)
        out.append({
            "config": config, "model_kwargs": mine[0]["model_kwargs"], "seeds": len(bpb),
            "rate_weight_decay": bool(mine[0].get("rate_weight_decay")),
            "mean_bits_per_byte": mean, "std_bits_per_byte": std, "min_bits_per_byte": low, "max_bits_per_byte": high,
            "vs_transformer": statistics.fmean(paired) if paired else float("nan"),
            "params_vs_transformer": mine[0]["params_vs_transformer"],
        })  # fmt: skip
    return sorted(out, key=lambda r: (math.isnan(r["mean_bits_per_byte"]), r["mean_bits_per_byte"]))  # NaN last


def summary_table(rows: Sequence[dict]) -> str:
    """:func:`summarize` as a Markdown table (bits per byte to 4 decimals: the targets are differences of 3%; no
    spread for one seed; rows trained while the fixed decay's rates took weight decay say so)."""

    def bits(v: float) -> str:
        return "diverged" if math.isnan(v) else f"{v:.4f}"

    table = ["| config | options | seeds | mean bits/byte | std | / transformer | params / transformer |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    table += [f"| {r['config']} | {r['model_kwargs'] or ''}{' (rates under weight decay)' * r['rate_weight_decay']} | "
              f"{r['seeds']} | {bits(r['mean_bits_per_byte'])} | "
              f"{bits(r['std_bits_per_byte']) if r['seeds'] > 1 else '-'} | {r['vs_transformer']:.3f} | "
              f"{r['params_vs_transformer']:.3f} |" for r in summarize(rows)]  # fmt: skip
    return "\n".join(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lambdanet.bench.lm_ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(ABLATIONS), metavar="CONFIG",
                        help=f"among {', '.join(ABLATIONS)} (default: all)")  # fmt: skip
    parser.add_argument("--size", default="tiny", help="model size: nano, tiny, small, base (default: %(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS), help="(default: 0 1 2)")
    parser.add_argument("--steps", type=int, default=1200, help="optimiser steps per run (default: %(default)s)")
    parser.add_argument("--context", type=int, default=256, help="bytes per sequence (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--eval-bytes", type=int, default=262144, help="validation bytes (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="(default: %(default)s)")
    parser.add_argument("--out", default="bench_results/lm_ablation", help="folder of lm_ablation.jsonl/.md")
    args = parser.parse_args(argv)
    try:
        check_device(args.device, "--device")
        rows = study(
            args.configs,
            out=args.out,
            size=args.size,
            seeds=args.seeds,
            steps=args.steps,
            context=args.context,
            batch=args.batch,
            eval_bytes=args.eval_bytes,
            device=args.device,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = summary_table(rows)
    (Path(args.out) / "lm_ablation.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
