"""The training and evaluation loops: ``train_one_epoch`` and ``evaluate``."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from lambdanet.runtime import autocast_context  # re-exported: the loops' autocast, validated in one place
from lambdanet.engine.distributed import DistContext, all_reduce_sum

__all__ = ["optimizer_step", "NonFiniteLossError", "train_one_epoch", "evaluate", "topk_correct", "autocast_context"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""

    def __init__(self, epoch: int, step: int, value: float):
        self.epoch, self.step, self.value = epoch, step, value
        super().__init__(f"the training loss became {value} at epoch {epoch + 1}, step {step + 1}")


def topk_correct(logits: Tensor, target: Tensor, ks=(1, 5)) -> list[int]:
    """Number of samples whose target is among the top-k predictions, for each k (k capped at #classes)."""
    maxk = min(max(ks), logits.shape[1])
    pred = logits.topk(maxk, dim=1).indices  # b maxk
    hit = pred.eq(target[:, None])
    return [int(hit[:, : min(k, maxk)].any(dim=1).sum()) for k in ks]


def _to(x: Tensor, device: torch.device, channels_last: bool) -> Tensor:
    x = x.to(device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def optimizer_step(loss: Tensor, optimizer: torch.optim.Optimizer, *, scaler: torch.amp.GradScaler | None = None,
                   clip: tuple[nn.Module, float] | None = None) -> None:
    """One optimiser step on ``loss``, the same for every task: gradients cleared, back-propagated (scaled by
    ``scaler`` under fp16 autocast), their norm clipped to ``clip = (model, max_norm)`` if given (after
    unscaling), then the step (skipped by the scaler when the gradients are not finite)."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
    else:
        loss.backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(clip[0].parameters(), clip[1])
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, scheduler, loss_fn: nn.Module, *,
                    epoch: int, device: torch.device, ctx: DistContext | None = None, amp: str = "none",
                    scaler: torch.amp.GradScaler | None = None, ema=None, channels_last: bool = False,
                    progress=None, max_batches: int | None = None, partial: dict | None = None,
                    stop=None) -> dict:
    """One pass over ``loader``: forward, loss, backward, step, schedule step, EMA update.

    Raises :class:`NonFiniteLossError` as soon as the loss is NaN or infinite (before the step that
    would spoil the weights). Returns the epoch's mean loss, top-1, samples seen (all ranks) and speed.

    ``stop`` (a :class:`lambdanet.engine.preempt.StopSignals`) is asked after every step whether a signal
    asked the run to stop; if so the pass ends there and the result holds ``"partial"``: the batches done
    and this rank's running sums, which, handed back as ``partial`` with ``loader`` positioned after those
    batches, continue the epoch as if it had never stopped.
    """
    ctx = ctx or DistContext()
    model.train()
    partial = partial or {}
    done = int(partial.get("batches", 0))  # batches of this epoch trained before (a resumed, preempted epoch)
    loss_sum, correct, seen = float(partial.get("loss_sum", 0.0)), int(partial.get("correct", 0)), int(
        partial.get("seen", 0))
    start = time.perf_counter() - float(partial.get("seconds", 0.0))
    for step, (x, y) in enumerate(loader, start=done):
        if max_batches is not None and step >= max_batches:
            break
        x, y = _to(x, device, channels_last), y.to(device, non_blocking=True)
        with autocast_context(device, amp):
            logits = model(x)
            loss = loss_fn(logits.float(), y)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(epoch, step, float(loss.detach()))
        optimizer_step(loss, optimizer, scaler=scaler)
        if scheduler is not None:
            scheduler.step()
        if ema is not None:
            ema.update_parameters(model)
        n = y.shape[0]
        loss_sum += float(loss.detach()) * n
        correct += int((logits.argmax(dim=1) == y).sum())
        seen += n
        if progress is not None:
            progress.update(n * ctx.world)
            progress.set_postfix(loss=f"{loss_sum / seen:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}",
                                 refresh=False)  # drawn at the bar's own interval
        if stop is not None and stop.requested(ctx):  # the sums of every rank, to be carried by one
            loss_sum, correct, seen = all_reduce_sum([loss_sum, correct, seen], ctx)
            return {"partial": {"batches": step + 1, "loss_sum": loss_sum, "correct": int(correct),
                                "seen": int(seen), "seconds": time.perf_counter() - start}}
    elapsed = time.perf_counter() - start
    loss_sum, correct, seen = all_reduce_sum([loss_sum, correct, seen], ctx)
    return {"loss": loss_sum / max(seen, 1), "top1": correct / max(seen, 1), "samples": int(seen),
            "seconds": elapsed, "images_per_s": seen / max(elapsed, 1e-9)}


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, device: torch.device, ctx: DistContext | None = None, amp: str = "none",
             channels_last: bool = False, loss_fn: nn.Module | None = None) -> dict:
    """Top-1 / top-5 accuracy (fractions) and mean cross-entropy over ``loader`` (summed over ranks)."""
    ctx = ctx or DistContext()
    model.eval()
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    loss_sum, c1, c5, n = 0.0, 0, 0, 0
    for x, y in loader:
        x, y = _to(x, device, channels_last), y.to(device, non_blocking=True)
        with autocast_context(device, amp):
            logits = model(x).float()
        loss_sum += float(loss_fn(logits, y)) * y.shape[0]
        k1, k5 = topk_correct(logits, y)
        c1, c5, n = c1 + k1, c5 + k5, n + y.shape[0]
    loss_sum, c1, c5, n = all_reduce_sum([loss_sum, c1, c5, n], ctx)
    return {"loss": loss_sum / max(n, 1), "top1": c1 / max(n, 1), "top5": c5 / max(n, 1), "samples": int(n)}
