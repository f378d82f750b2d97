"""The language-model study: causal lambda LM against the same-size transformer and linear-attention LMs.

* :func:`throughput`: training (forward+backward) tokens/s at each context, round-robin timed, with
  ``max(1, tokens_per_step // context)`` sequences per step, and the peak memory of one step of a single
  sequence (:func:`lambdanet.runtime.peak_memory`); :func:`memory_slopes` fits peak memory against context.
* :func:`generation`: per-token latency of ``model.step`` after a context of ``n`` tokens (the prompt run by the
  parallel forward with ``return_state``), the bytes of the state it carries and the peak memory of one step.
* :func:`quality`: validation bits per byte after equal training time and after equal optimiser steps, per seed
  (the engine's training step, :func:`lambdanet.engine.loop.train_epoch` on the loss of ``lambdanet lm train``
  with its defaults: AdamW, gradient clipping; warm-up and cosine decay over the steps, or over the time budget
  for the equal-time runs), and :func:`quality_summary` (mean and spread over seeds).

Every model of one study has the same size (``<mixer>_lm_<size>``: width, depth, heads, MLP; parameters within
2%).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from lambdanet.bench.layer_bench import loglog_slope
from lambdanet.bench.report import RowLog
from lambdanet.engine.distributed import DistContext
from lambdanet.engine.loop import NonFiniteLossError, train_epoch
from lambdanet.engine.optim import build_optimizer, lr_at
from lambdanet.engine.state import RunState
from lambdanet.models import create_model
from lambdanet.models.lm import LanguageModel
from lambdanet.runtime import peak_memory, sync, time_round_robin
from lambdanet.tasks.lm.config import LMConfig
from lambdanet.tasks.lm.data import Corpus, windows
from lambdanet.tasks.lm.task import evaluate_bits_per_byte, next_byte_loss

__all__ = [
    "LM_MIXERS",
    "LM_SPEED_FAMILIES",
    "throughput",
    "memory_slopes",
    "generation",
    "quality",
    "quality_summary",
    "seed_stats",
    "plot_lm_study",
]

LM_MIXERS = ("lambda", "transformer", "linear")
# the speed and memory parts also time the paper's layer alone beside the default (its short convolution's price)
LM_SPEED_FAMILIES = ("lambda", "plain_lambda", "transformer", "linear")
Log = Callable[[str], None]


def _models(size: str, device: torch.device) -> dict[str, LanguageModel]:
    torch.manual_seed(0)
    return {m: cast(LanguageModel, create_model(f"{m}_lm_{size}").to(device)) for m in LM_SPEED_FAMILIES}


def _train_step(model: nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    def step():
        logits = model(tokens[:, :-1])  # b n vocab
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    return step


def throughput(
    size: str = "tiny",
    contexts: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192),
    *,
    tokens_per_step: int = 4096,
    device: str = "cpu",
    repeats: int = 3,
    log: Log = print,
) -> list[dict]:
    """Training tokens/s and single-sequence peak memory of each family at each context (see the module doc)."""
    device_ = torch.device(device)
    models = _models(size, device_)
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for n in contexts:
        batch = max(1, tokens_per_step // n)
        tokens = torch.randint(0, 256, (batch, n + 1), generator=g).to(device_)  # b (n + 1)
        timing = time_round_robin(
            {m: _train_step(model, tokens) for m, model in models.items()}, device_, warmup=1, repeats=repeats
        )
        for m, model in models.items():
            peak = peak_memory(_train_step(model, tokens[:1]), device_)
            rows.append(
                {
                    "model": f"{m}_lm_{size}",
                    "mixer": m,
                    "context": n,
                    "batch": batch,
                    "tokens_per_s": batch * n / timing[m].median_s,
                    "step_ms": timing[m].median_s * 1e3,
                    "peak_bytes_one_sequence": peak,
                }
            )
        mine = rows[-len(models) :]
        base = next(r for r in mine if r["mixer"] == "transformer")["tokens_per_s"]
        for r in mine:
            r["speed_vs_transformer"] = r["tokens_per_s"] / base
        log(
            f"  context {n} x {batch}: "
            + ", ".join(
                f"{r['mixer']} {r['tokens_per_s']:,.0f} tok/s {r['peak_bytes_one_sequence'] / 2**20:.0f} MiB"
                for r in mine
            )
        )
    return rows


def memory_slopes(rows: Sequence[dict], lo: int = 1024, hi: int = 8192) -> list[dict]:
    """Per family: the log-log slope of single-sequence peak memory against context over ``[lo, hi]`` (1: linear,
    2: quadratic) and the peak's growth per 1k tokens between ``lo`` and ``hi``."""
    out = []
    for m in dict.fromkeys(r["mixer"] for r in rows):
        pts = sorted(
            (r["context"], r["peak_bytes_one_sequence"]) for r in rows if r["mixer"] == m and lo <= r["context"] <= hi
        )
        if len(pts) >= 2:
            out.append(
                {
                    "mixer": m,
                    "contexts": f"{pts[0][0]}-{pts[-1][0]}",
                    "memory_slope": loglog_slope([p[0] for p in pts], [p[1] for p in pts]),
                    "mib_per_1k_tokens": (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]) * 1024 / 2**20,
                }
            )
    return out


def _nbytes(state) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples (a model's generation state)."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(state)[0] if isinstance(t, torch.Tensor))


@torch.no_grad()
def generation(
    size: str = "tiny",
    contexts: Sequence[int] = (1024, 2048, 4096, 8192, 16384),
    *,
    device: str = "cpu",
    steps: int = 20,
    log: Log = print,
) -> list[dict]:
    """Per-token generation latency (median of ``steps`` single steps), state bytes and one step's peak memory
    after a context of each length (batch 1). On CUDA the constant-state models also step from a CUDA graph
    (:class:`~lambdanet.models.lm_graph.StepGraph`; rows ``"<mixer> (CUDA graph)"``)."""
    from lambdanet.models.lm_graph import StepGraph

    device_ = torch.device(device)
    models = {m: model.eval() for m, model in _models(size, device_).items()}
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for n in contexts:
        prompt = torch.randint(0, 256, (1, n), generator=g).to(device_)  # 1 n
        token = prompt[:, -1]  # 1
        mine: list[dict] = []
        for m, model in models.items():
            _, state = model(prompt, return_state=True)
            ways: dict[str, Callable[[], object]] = {m: partial(model.step, state, token)}
            peaks: dict[str, int] = {}
            if device_.type == "cuda" and m not in ("transformer", "hybrid"):  # a KV cache cannot be replayed
                made: list[StepGraph] = []
                build = partial(StepGraph, model._advance, state, token, name=f"{m}_lm_{size}")
                # a replay allocates nothing (its memory is the graph's, reserved at the capture): the peak of
                # building it is the one to compare
                peaks[f"{m} (CUDA graph)"] = peak_memory(lambda: made.append(build()), device_)
                ways[f"{m} (CUDA graph)"] = partial(made[0].step, token)
            for label, step in ways.items():
                times = []
                for i in range(steps + 2):  # two warm-up steps
                    sync(device_)
                    start = time.perf_counter()
                    step()
                    sync(device_)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                mine.append(
                    {
                        "model": f"{m}_lm_{size}",
                        "mixer": label,
                        "context": n,
                        "ms_per_token": statistics.median(times) * 1e3,
                        "state_bytes": _nbytes(state),
                        "step_peak_bytes": peaks[label] if label in peaks else peak_memory(step, device_),
                    }
                )
        base = next(r for r in mine if r["mixer"] == "transformer")["ms_per_token"]
        for r in mine:
            r["speed_vs_transformer"] = base / r["ms_per_token"]
        log(
            f"  context {n}: "
            + ", ".join(
                f"{r['mixer']} {r['ms_per_token']:.2f} ms/token, state {r['state_bytes'] / 2**20:.2f} MiB" for r in mine
            )
        )
        rows += mine
    return rows


def train_run(
    name: str,
    corpus: Corpus,
    context: int,
    batch: int,
    seed: int,
    *,
    steps: int | None,
    seconds: float | None,
    device: torch.device,
    eval_bytes: int,
    model_kwargs: dict | None = None,
) -> dict:
    """One run of model ``name`` (built with ``model_kwargs``): ``steps`` optimiser steps (schedule over the steps)
    or ``seconds`` of training (schedule over the time spent), each the engine's training step on ``lambdanet lm
    train``'s loss and recipe (a diverged run scores NaN); returns its validation bits per byte (the first
    ``eval_bytes`` of the split), steps and training seconds."""
    cfg = LMConfig()
    torch.manual_seed(seed)
    model = create_model(name, **(model_kwargs or {})).to(device)
    state, ctx = RunState(model, build_optimizer(model, cfg)), DistContext(device=device)
    g = torch.Generator().manual_seed(seed)
    high = corpus.train.numel() - context - 1
    warmup = cfg.warmup_steps / (cfg.epochs * cfg.steps_per_epoch)  # the default run's warm-up fraction
    floor, spent, done = cfg.min_lr / cfg.lr, 0.0, 0
    while (steps is not None and done < steps) or (seconds is not None and spent < seconds):
        fraction = done / steps if steps is not None else spent / cast(float, seconds)  # not None without steps
        rate = cfg.lr * lr_at(round(1000 * fraction), 1000, round(1000 * warmup), min_factor=floor)
        starts = torch.randint(0, high + 1, (batch,), generator=g)
        tokens = windows(corpus.train, starts, context + 1).to(device)  # b (n + 1)
        sync(device)
        start = time.perf_counter()
        try:  # one step: the rate, the loss, the optimiser step with LMConfig's gradient clipping (1.0)
            train_epoch(state, model, [tokens], next_byte_loss, ctx=ctx, total=1, clip=cfg.grad_clip, lr=lambda _: rate)
        except NonFiniteLossError:
            return {"val_bits_per_byte": math.nan, "steps": done, "train_s": spent}
        sync(device)
        spent += time.perf_counter() - start
        done += 1
    res = evaluate_bits_per_byte(model, corpus.val[:eval_bytes], context, device=device)
    return {"val_bits_per_byte": res["bits_per_byte"], "steps": done, "train_s": spent}


def quality(
    corpus: Corpus,
    size: str = "tiny",
    *,
    context: int = 512,
    batch: int = 16,
    steps: int = 200,
    seconds: float = 120.0,
    seeds: Sequence[int] = (0, 1, 2),
    eval_bytes: int = 65536,
    device: str = "cpu",
    log: Log = print,
    kept: RowLog | None = None,
) -> list[dict]:
    """Validation bits per byte of each family after ``steps`` steps and after ``seconds`` of training, per seed
    (rows with ``budget`` ``"steps"`` or ``"time"``); the first ``eval_bytes`` of the validation split. With
    ``kept``, each row is kept there as it is measured, and rows it already holds are not measured again."""
    device_ = torch.device(device)
    rows = []
    for budget in ("time", "steps"):
        for seed in seeds:
            for m in LM_MIXERS:
                earlier = kept.done(budget=budget, seed=seed, mixer=m) if kept is not None else []
                if kept is not None and earlier:
                    rows += earlier
                    log(f"  {budget} seed {seed} {m}: kept from {kept.path.name}")
                    continue
                res = train_run(
                    f"{m}_lm_{size}",
                    corpus,
                    context,
                    batch,
                    seed,
                    device=device_,
                    eval_bytes=eval_bytes,
                    steps=steps if budget == "steps" else None,
                    seconds=seconds if budget == "time" else None,
                )
                rows.append(
                    {
                        "model": f"{m}_lm_{size}",
                        "mixer": m,
                        "budget": budget,
                        "seed": seed,
                        "context": context,
                        "batch": batch,
                        **res,
                    }
                )
                if kept is not None:
                    kept.add(rows[-1:])
                log(
                    f"  {budget} seed {seed} {m}: {res['val_bits_per_byte']:.3f} bits/byte after {res['steps']} "
                    f"steps, {res['train_s']:.0f}s"
                )
    return rows


def seed_stats(values: Sequence[float]) -> tuple[float, float, float, float]:
    """Mean, sample standard deviation (0 for one value), minimum and maximum of a measure over seeds; all NaN
    where one seed's is (a diverged run: no statistic of the others stands for the configuration)."""
    if any(math.isnan(v) for v in values):
        return (math.nan,) * 4
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, min(values),
            max(values))  # fmt: skip


def quality_summary(rows: Sequence[dict]) -> list[dict]:
    """Mean, spread (sample standard deviation) and range of bits per byte over the seeds, per budget and family,
    with the ratio of each family's mean to the transformer's."""
    out = []
    for budget in dict.fromkeys(r["budget"] for r in rows):
        means = {}
        for m in dict.fromkeys(r["mixer"] for r in rows):
            mine = [r for r in rows if r["budget"] == budget and r["mixer"] == m]
            bpb = [r["val_bits_per_byte"] for r in mine]
            means[m], std, low, high = seed_stats(bpb)
            out.append(
                {
                    "budget": budget,
                    "mixer": m,
                    "seeds": len(bpb),
                    "mean_bits_per_byte": means[m],
                    "std_bits_per_byte": std,
                    "min_bits_per_byte": low,
                    "max_bits_per_byte": high,
                    "mean_steps": statistics.fmean(r["steps"] for r in mine),
                    "mean_train_s": statistics.fmean(r["train_s"] for r in mine),
                }
            )
        for r in out[-len(means) :]:
            r["vs_transformer"] = r["mean_bits_per_byte"] / means["transformer"] if "transformer" in means else None
    return out


def plot_lm_study(train_rows: Sequence[dict], gen_rows: Sequence[dict], quality_rows: Sequence[dict], out) -> list:
    """``lm_throughput.png`` (tokens/s and peak memory against context), ``lm_generation.png`` (ms per token
    and state bytes against context) and ``lm_quality.png`` (bits per byte per seed at each budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    panels = (
        (
            "lm_throughput.png",
            train_rows,
            (
                ("tokens_per_s", "training tokens/s", 1),
                ("peak_bytes_one_sequence", "peak memory, 1 sequence (MiB)", 2**20),
            ),
        ),
        (
            "lm_generation.png",
            gen_rows,
            (("ms_per_token", "generation ms/token", 1), ("state_bytes", "state (MiB)", 2**20)),
        ),
    )
    for name, rows, keys in panels:
        if not rows:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, (key, label, scale) in zip(axes, keys):
            for m in dict.fromkeys(r["mixer"] for r in rows):
                pts = sorted((r["context"], r[key] / scale) for r in rows if r["mixer"] == m)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel=label)
            ax.grid(alpha=0.3, which="both")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    if quality_rows:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, budget in zip(axes, ("time", "steps")):
            mine = [r for r in quality_rows if r["budget"] == budget]
            mixers = list(dict.fromkeys(r["mixer"] for r in mine))
            for i, m in enumerate(mixers):
                ys = [r["val_bits_per_byte"] for r in mine if r["mixer"] == m]
                ax.scatter([i] * len(ys), ys)
                if ys:
                    ax.hlines(statistics.fmean(ys), i - 0.2, i + 0.2, colors="k")
            ax.set_xticks(range(len(mixers)), mixers)
            ax.set(title=f"equal {budget}", ylabel="validation bits per byte")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "lm_quality.png", dpi=100)
        plt.close(fig)
        paths.append(out / "lm_quality.png")
    return paths


def non_finite(rows: Sequence[dict]) -> list[str]:
    """One line per study row that holds a non-finite measurement (a diverged run or a broken timer)."""
    return [f"{r.get('model')} {r.get('budget', '')} seed {r.get('seed')}: {k} {v}".replace("  ", " ")
            for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]  # fmt: skip
