"""Associative recall (Zoology's multi-query associative recall, Arora et al. 2023): where a constant-size state
stops being enough.

A sequence is ``P`` key-value pairs of byte tokens (keys from ``[0, 128)``, distinct within a sequence; values from
``[128, 256)``), then ``Q`` queries, each a key seen earlier followed by its value. A model is trained by next-token
prediction on the queries' values only and scored by the fraction of them it predicts exactly (arg-max). A
transformer can look each key up; a model with a fixed-size state must hold all ``P`` associations in it, so its
accuracy falls as ``P`` grows past what the state holds. Families of one size (``<mixer>_lm_<size>``, parameters
within 2%) side by side, the same steps, batch, learning rate and curriculum over ``P`` (:class:`PairCurriculum`:
without one, not even attention learns the lookup at 16 pairs in thousands of steps).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from lambdanet.bench.report import RowLog
from lambdanet.engine.loop import optimizer_step
from lambdanet.engine.optim import lr_at
from lambdanet.models import create_model

__all__ = ["recall_batch", "recall", "summarize_recall", "PairCurriculum", "RECALL_FAMILIES"]

RECALL_FAMILIES = ("lambda", "plain_lambda", "linear", "hybrid", "transformer")
KEYS, VALUES = 128, 128  # keys are tokens 0..127, values 128..255


def recall_batch(batch: int, pairs: int, queries: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [b, 2 P + 2 Q], target [b, 2 P + 2 Q - 1])``: the pairs, then the queries; ``target`` is the next
    token where it is a queried value and ``-100`` (ignored) elsewhere."""
    if not 1 <= pairs <= KEYS:
        raise ValueError(f"pairs must be in [1, {KEYS}], got {pairs!r}")
    if queries < 1:
        raise ValueError(f"queries must be >= 1, got {queries!r}")
    keys = torch.stack([torch.randperm(KEYS, generator=generator)[:pairs] for _ in range(batch)])  # b P
    values = KEYS + torch.randint(0, VALUES, (batch, pairs), generator=generator)  # b P
    asked = torch.randint(0, pairs, (batch, queries), generator=generator)  # b Q: which pair each query asks
    context = torch.stack([keys, values], dim=2).flatten(1)  # b 2P: k v k v ...
    q_keys, q_values = keys.gather(1, asked), values.gather(1, asked)  # b Q
    tokens = torch.cat([context, torch.stack([q_keys, q_values], dim=2).flatten(1)], dim=1)  # b (2P + 2Q)
    target = torch.full((batch, tokens.shape[1] - 1), -100, dtype=torch.long)
    target[:, 2 * pairs :: 2] = q_values  # predicted at each query key's position
    return tokens, target


def _accuracy(logits: torch.Tensor, target: torch.Tensor) -> float:
    scored = target != -100
    return float((logits.argmax(-1)[scored] == target[scored]).float().mean())


class PairCurriculum:
    """The number of pairs each training batch holds: a curriculum that doubles the current count ``P`` from
    ``start`` to ``top`` once the running accuracy of the batches at ``P`` (an exponential mean with
    ``momentum``) passes ``promote``. Half the batches hold ``P`` pairs, half a count drawn uniformly from
    ``[1, P]``, so what was learnt is kept.

    Without it the lookup does not form: the nano transformer trained on 16 pairs from the first step stays at
    chance among the context's values after 4,000 steps, and with it learns 2 pairs in about 400 steps and 16 in
    600 (docs/language_models.md). A family that never passes ``promote`` at some ``P`` stays there, so
    :attr:`reached` is itself a result: the most pairs it learnt to look up."""

    def __init__(self, top: int, *, start: int = 2, promote: float = 0.9, momentum: float = 0.9) -> None:
        if not 1 <= start <= top:
            raise ValueError(f"start must be in [1, top={top}], got {start!r}")
        if not 0.0 < promote <= 1.0:
            raise ValueError(f"promote must be in (0, 1], got {promote!r}")
        self.top, self.pairs, self.promote, self.momentum = top, start, promote, momentum
        self.running = 0.0
        self.promoted_at: dict[int, int] = {}  # pairs -> the step at which the curriculum moved to them

    @property
    def reached(self) -> int:
        """The largest number of pairs trained on so far."""
        return self.pairs

    def sample(self, generator: torch.Generator) -> int:
        """The pairs of the next batch: the current count, or one drawn from ``[1, current]``, evenly."""
        if float(torch.rand((), generator=generator)) < 0.5:
            return self.pairs
        return int(torch.randint(1, self.pairs + 1, (), generator=generator))

    def update(self, pairs: int, accuracy: float, step: int) -> bool:
        """Record a batch's training accuracy; move to twice the pairs (at most ``top``) when the running accuracy
        at the current count passes ``promote``. True when it moved."""
        if pairs != self.pairs:
            return False
        self.running = self.momentum * self.running + (1 - self.momentum) * accuracy
        if self.running <= self.promote or self.pairs >= self.top:
            return False
        self.pairs, self.running = min(self.top, 2 * self.pairs), 0.0
        self.promoted_at[self.pairs] = step
        return True


def recall(
    families: Sequence[str] = RECALL_FAMILIES,
    size: str = "nano",
    pairs: Sequence[int] = (2, 4, 8, 16, 32),
    *,
    steps: int = 4000,
    batch: int = 64,
    lrs: Sequence[float] = (1e-3, 3e-3),
    eval_batches: int = 4,
    device: str = "cpu",
    seeds: Sequence[int] = (0, 1, 2),
    log: Callable[[str], None] = print,
    kept: RowLog | None = None,
) -> list[dict]:
    """Recall accuracy of each family at each number of pairs (``Q = P`` queries). One model per family, peak
    learning rate of ``lrs`` and seed of ``seeds``, trained ``steps`` AdamW steps (warm-up over the first tenth,
    then cosine to zero; the gradient norm clipped to 1) on batches whose pairs follow a :class:`PairCurriculum`
    up to ``max(pairs)``, then scored on ``eval_batches`` fresh batches at each count. Whether and when the lookup
    forms varies from seed to seed and the families learn it at different rates (the nano transformer at 1e-3,
    not at 3e-3 in the seed tried; the lambda models better at 3e-3), so, as Zoology does, each family is reported
    at its best learning rate, with the mean and the best over seeds (:func:`summarize_recall`). A row per
    family, learning rate, seed and count: ``accuracy``, ``reached`` (the most pairs the curriculum trained it on:
    counts above it were never trained on) and ``chance`` (one value in ``VALUES``; guessing among the values in
    the context gives ``1 / P``). With ``kept``, each model's rows are kept there as they are measured, and the
    models it already holds are not trained again."""
    if not pairs or min(pairs) < 1:
        raise ValueError(f"pairs must be a non-empty list of counts >= 1, got {list(pairs)!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    if not lrs or min(lrs) <= 0:
        raise ValueError(f"lrs must be a non-empty list of learning rates > 0, got {list(lrs)!r}")
    dev = torch.device(device)
    rows = []
    for family, lr, seed in ((f, r, s) for f in families for r in lrs for s in seeds):
        name = f"{family}_lm_{size} lr {lr:g} seed {seed}"
        earlier = kept.done(family=family, lr=lr, seed=seed) if kept is not None else []
        if kept is not None and earlier:
            rows += earlier
            log(f"   recall {name}: kept from {kept.path.name}")
            continue
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        model = create_model(f"{family}_lm_{size}").to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        curriculum = PairCurriculum(max(pairs), start=min(2, max(pairs)))
        start = time.perf_counter()
        model.train()
        for step in range(steps):
            for group in opt.param_groups:  # the engine's warm-up and cosine schedule
                group["lr"] = lr_at(step, steps, max(1, steps // 10), start_factor=0.1) * lr
            p = curriculum.sample(g)
            tokens, target = recall_batch(batch, p, p, g)
            logits = model(tokens[:, :-1].to(dev))  # b n vocab
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten().to(dev), ignore_index=-100)
            optimizer_step(loss, opt, clip=(model, 1.0))  # the engine's step
            if curriculum.update(p, _accuracy(logits.detach().cpu(), target), step):
                log(f"   recall {name}: {curriculum.pairs} pairs from step {step + 1}")
            if (step + 1) % max(1, steps // 8) == 0:  # progress on a long run
                log(f"   recall {name}: step {step + 1}/{steps}, {curriculum.pairs} pairs, "
                    f"running accuracy {curriculum.running:.2f}")  # fmt: skip
        train_s = time.perf_counter() - start
        model.eval()
        eg = torch.Generator().manual_seed(seed + 10_000)
        for p in pairs:
            with torch.no_grad():
                accs = []
                for _ in range(eval_batches):
                    tokens, target = recall_batch(batch, p, p, eg)
                    accs.append(_accuracy(model(tokens[:, :-1].to(dev)).cpu(), target))
            row = {"family": family, "model": f"{family}_lm_{size}", "lr": lr, "seed": seed, "pairs": p,
                   "sequence": 4 * p,
                   "steps": steps, "accuracy": sum(accs) / len(accs), "reached": curriculum.reached,
                   "chance": 1 / VALUES, "train_s": train_s}  # fmt: skip
            rows.append(row)
            log(f"   recall {name:<36} pairs {p:>3}: accuracy {row['accuracy']:.3f} "
                f"(trained up to {curriculum.reached} pairs, {train_s:.0f} s)")  # fmt: skip
        if kept is not None:
            kept.add(rows[-len(pairs) :])
    return rows


def summarize_recall(rows: Sequence[dict]) -> list[dict]:
    """Per model at its best learning rate (the highest mean accuracy over its counts and seeds) and per number
    of pairs, over the seeds: ``lr``, ``mean`` and ``best`` accuracy, ``learnt`` (how many seeds reached 90%),
    ``reached`` (the most pairs each seed's curriculum trained on, e.g. ``"32/32/2"``)."""
    by: dict[tuple[str, float, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["model"], r.get("lr", 0.0), r["pairs"]), []).append(r)
    score: dict[tuple[str, float], list[float]] = {}
    for (model, lr, _), mine in by.items():
        score.setdefault((model, lr), []).extend(r["accuracy"] for r in mine)
    best: dict[str, float] = {}
    for (model, lr), accs in score.items():  # ties: the first learning rate given
        if model not in best or statistics.fmean(accs) > statistics.fmean(score[(model, best[model])]):
            best[model] = lr
    return [{"model": model, "lr": lr, "pairs": p, "sequence": mine[0]["sequence"], "seeds": len(mine),
             "mean": statistics.fmean(r["accuracy"] for r in mine), "best": max(r["accuracy"] for r in mine),
             "learnt": sum(r["accuracy"] >= 0.9 for r in mine), "reached": "/".join(str(r["reached"]) for r in mine),
             "chance": mine[0]["chance"]}
            for (model, lr, p), mine in by.items() if best[model] == lr]  # fmt: skip
