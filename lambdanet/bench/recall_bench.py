"""Associative recall (Zoology's multi-query associative recall, Arora et al. 2023): where a constant-size state
stops being enough.

A sequence is ``P`` key-value pairs of byte tokens (keys from ``[0, 128)``, distinct within a sequence; values from
``[128, 256)``), then ``Q`` queries, each a key seen earlier followed by its value. A model is trained by next-token
prediction on the queries' values only and scored by the fraction of them it predicts exactly (arg-max). A
transformer can look each key up; a model with a fixed-size state must hold all ``P`` associations in it, so its
accuracy falls as ``P`` grows past what the state holds. Families of one size (``<mixer>_lm_<size>``, parameters
within 2%) side by side, the same steps, batch and learning rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from lambdanet.engine.loop import optimizer_step
from lambdanet.engine.optim import lr_at
from lambdanet.models import create_model

__all__ = ["recall_batch", "recall", "RECALL_FAMILIES"]

RECALL_FAMILIES = ("lambda", "linear", "hybrid", "transformer")
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


def recall(
    families: Sequence[str] = RECALL_FAMILIES,
    size: str = "nano",
    pairs: Sequence[int] = (4, 16, 64),
    *,
    steps: int = 300,
    batch: int = 32,
    lr: float = 2e-3,
    eval_batches: int = 4,
    device: str = "cpu",
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Recall accuracy of each family at each number of pairs (``Q = P`` queries), after ``steps`` AdamW steps
    (warm-up over the first tenth, then cosine to zero), on ``eval_batches`` fresh batches."""
    dev = torch.device(device)
    rows = []
    for p in pairs:
        for family in families:
            torch.manual_seed(seed)
            g = torch.Generator().manual_seed(seed)
            model = create_model(f"{family}_lm_{size}").to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            start = time.perf_counter()
            model.train()
            for step in range(steps):
                for group in opt.param_groups:  # the engine's warm-up and cosine schedule
                    group["lr"] = lr_at(step + 1, steps, max(1, steps // 10), start_factor=0.1) * lr
                tokens, target = recall_batch(batch, p, p, g)
                logits = model(tokens[:, :-1].to(dev))  # b n vocab
                loss = F.cross_entropy(logits.flatten(0, 1), target.flatten().to(dev), ignore_index=-100)
                optimizer_step(loss, opt, clip=(model, 1.0))  # the engine's step, the gradient norm clipped to 1
            model.eval()
            eg = torch.Generator().manual_seed(seed + 10_000)
            with torch.no_grad():
                accs = []
                for _ in range(eval_batches):
                    tokens, target = recall_batch(batch, p, p, eg)
                    accs.append(_accuracy(model(tokens[:, :-1].to(dev)).cpu(), target))
            row = {"family": family, "model": f"{family}_lm_{size}", "pairs": p, "sequence": 4 * p,
                   "steps": steps, "accuracy": sum(accs) / len(accs), "chance": 1 / VALUES,
                   "train_s": time.perf_counter() - start}  # fmt: skip
            rows.append(row)
            log(f"   recall {row['model']:<22} pairs {p:>3}: accuracy {row['accuracy']:.3f} ({row['train_s']:.0f} s)")
    return rows
