"""``train(cfg)``: a full run (data, model, recipe, checkpoints, resume, logs, summary), and
``evaluate_checkpoint(path)``; the CLI commands ``lambdanet train`` / ``lambdanet eval`` call these.
Classification is a task of the engine (:class:`ClassificationTask`, :mod:`lambdanet.engine.task`); everything
recipe- or model-specific was settled by :func:`lambdanet.tasks.classification.config.resolve_config` before the
run starts."""

from __future__ import annotations

import dataclasses
import math
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from lambdanet.engine.checkpoint import CheckpointError, export_safetensors, load_checkpoint, unwrap
from lambdanet.engine.distributed import DistContext, convert_sync_batchnorm, uses_cuda
from lambdanet.engine.logger import plot_history, read_history, write_json
from lambdanet.engine.loop import NonFiniteEvalError, TrainingDivergedError, to_device
from lambdanet.engine.optim import build_ema, build_optimizer, build_scheduler, set_bn_momentum
from lambdanet.engine.state import RunState
from lambdanet.engine.task import Task, run
from lambdanet.files import (
    BEST_WEIGHTS,
    WeightsMismatchError,
    check_checkpoint_task,
    read_safetensors,
    run_file,
    weights_metadata,
)
from lambdanet.models.hub import hub_repo
from lambdanet.models import create_model
from lambdanet.models.registry import run_image_cfg
from lambdanet.tasks.classification.config import TrainConfig, model_build_kwargs
from lambdanet.tasks.classification.data import (
    DatasetSpec,
    ImageLoader,
    RunData,
    build_datasets,
    load_pseudo_labels,
    prepare_run_data,
)
from lambdanet.tasks.classification.load import check_data_fits, checkpoint_meta, restore_model
from lambdanet.tasks.classification.metrics import CLASSIFICATION_PANELS, evaluate
from lambdanet.tasks.classification.mix import BatchMix, soft_target_cross_entropy

# the rest of what lambdanet.train.trainer had (its old path is this module), for one release
from lambdanet.tasks.classification.datasets import Subset, TensorImages, labeled_split, split_indices  # noqa: E402, F401

__all__ = [
    "train",
    "evaluate_checkpoint",
    "TrainingDivergedError",
    "ClassificationTask",
    "build_model_for",
    "hardware_string",
    "load_pseudo_labels",
    "BEST_WEIGHTS",
]


def hardware_string(device: torch.device) -> str:
    """What a run ran on, for its log and ``summary.json``: the GPU (on CUDA), the CPU, its threads, torch."""
    base = (
        f"{platform.system()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} CPU "
        f"threads, torch {torch.__version__}"
    )
    return f"{torch.cuda.get_device_name(device)}; {base}" if device.type == "cuda" else base


def build_model_for(cfg: TrainConfig, spec: DatasetSpec, *, initial_weights: bool = True) -> nn.Module:
    """``create_model`` of a resolved ``cfg`` for a dataset's classes and channels, starting from the weights
    of ``--pretrained`` / ``--checkpoint`` when ``initial_weights`` (a resumed run takes its own instead)."""
    weights: dict[str, Any] = (
        {"pretrained": cfg.pretrained, "checkpoint_path": cfg.checkpoint} if initial_weights else {}
    )
    return create_model(
        cfg.model, num_classes=spec.num_classes, in_chans=spec.in_chans, **weights, **model_build_kwargs(cfg)
    )


class ClassificationTask(Task):
    """Image classification (:class:`TrainConfig`): cross-entropy with label smoothing (soft targets under
    Mixup / CutMix: :mod:`lambdanet.tasks.classification.mix`), the recipe's optimiser and per-step schedule, EMA,
    top-1 / top-5 on the test (and validation) split after every epoch, the best epoch by validation top-1 (else
    test top-1, EMA when kept), its weights (:data:`BEST_WEIGHTS`) and early stopping on it."""

    cfg: TrainConfig  # the engine's configuration is this task's

    def upgrade_checkpoint(self, saved: dict) -> dict:
        """lambdanet <= 0.1 kept a preempted epoch's sums as ``loss_sum`` / ``correct`` / ``seen``. A checkpoint
        that says what it classifies (``run_meta``) must still fit the data (renamed class folders included), one
        that names its pseudo-labels' digest the same pseudo-labels."""
        if isinstance(saved.get("run_meta"), dict):
            check_data_fits(saved["run_meta"], self.data.spec, self.checkpoint_path)
        if saved.get("pseudo_labels_digest", self.data.pseudo_digest) != self.data.pseudo_digest:
            raise ValueError(
                f"pseudo_labels {self.cfg.pseudo_labels} are not the ones {self.checkpoint_path} trained on (the file "
                "was written again since): restore them, or train a new student with another --out"
            )
        partial = saved.get("epoch_partial")
        if not partial or "loss_sum" not in partial:
            return saved
        sums = {"loss": partial["loss_sum"], "correct": partial["correct"], "n": partial["seen"]}
        return {
            **saved,
            "epoch_partial": {"batches": partial["batches"], "seconds": partial.get("seconds", 0.0), "sums": sums},
        }

    def build_state(self) -> RunState:
        """The data, and the model (checked on two test images), optimiser, schedule, EMA and loss scaler."""
        cfg, ctx = self.cfg, self.ctx
        self.data = data = prepare_run_data(cfg, ctx)
        model = build_model_for(cfg, data.spec, initial_weights=not cfg.resume)
        if (cfg.pretrained or cfg.checkpoint) and not cfg.resume:
            self.log(_start_note(cfg, model))
        if cfg.bn_momentum is not None:
            set_bn_momentum(model, cfg.bn_momentum)
        if cfg.sync_bn and ctx.enabled:
            model = convert_sync_batchnorm(model, ctx.device)
        model = model.to(ctx.device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        _dry_run(model, data.test, cfg, ctx.device)
        optimizer = build_optimizer(model, cfg)
        self.steps_per_epoch = steps = (
            len(data.train) if cfg.max_train_batches is None else min(len(data.train), cfg.max_train_batches)
        )
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.mix = (
            BatchMix(
                cfg.mixup,
                cfg.cutmix,
                num_classes=data.spec.num_classes,
                smoothing=cfg.label_smoothing,
                seed=cfg.seed,
                rank=ctx.rank,
            )
            if cfg.mixup or cfg.cutmix
            else None
        )
        return RunState(
            model,
            optimizer,
            build_scheduler(optimizer, cfg, steps),
            ema=build_ema(model, cfg.ema_decay) if cfg.ema_decay else None,
            scaler=torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None,
        )

    def save(self, state: RunState) -> None:
        """``last.pt`` with the model's build arguments and what it classifies (``run_meta``: the weights header's
        values, so that the checkpoint loads without its data, and refuses data that changed)."""
        pseudo = {"pseudo_labels_digest": self.data.pseudo_digest} if self.data.pseudo_digest else {}
        state.save(self.checkpoint_path, self.cfg, model_kwargs=model_build_kwargs(self.cfg),
                   run_meta=_run_meta(self.cfg, self.data.spec), **pseudo)  # fmt: skip

    def initialize(self, state: RunState, resumed: bool) -> None:
        if resumed and self.ctx.is_main:
            self._sync_best(state, final=False)

    def batches(self, state: RunState):
        """The epoch's batches from the first not trained; with mixing, each with its (epoch, index)."""
        start = int((state.epoch_partial or {}).get("batches", 0))
        self.data.train.set_epoch(state.epoch, start_batch=start)
        if self.mix is None:
            return self.data.train
        return ((x, y, (state.epoch, i)) for i, (x, y) in enumerate(self.data.train, start=start))

    def step_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict]:
        x, y, *where = batch
        x, y = to_device(x, self.ctx.device, self.cfg.channels_last), y.to(self.ctx.device, non_blocking=True)
        if self.mix is not None and where:
            epoch, index = where[0]
            x, targets = self.mix(x, y, self.mix.draw(epoch, index, x.shape[-2], x.shape[-1]))
            logits = model(x)  # b classes
            loss = soft_target_cross_entropy(logits.float(), targets)
        else:
            logits = model(x)  # b classes
            loss = self.loss_fn(logits.float(), y)
        n = y.shape[0]
        return loss, {"loss": float(loss.detach()) * n, "correct": int((logits.argmax(dim=1) == y).sum()), "n": n}

    def epoch_row(self, state: RunState, model: nn.Module, result: dict) -> dict:
        """The epoch's training figures, test (and validation) accuracy, the EMA's; the best epoch updated."""
        sums, cfg, ctx, data = result["sums"], self.cfg, self.ctx, self.data
        seen = max(sums["n"], 1)
        state.samples_seen += int(sums["n"])
        row = {
            "lr": state.optimizer.param_groups[0]["lr"],
            "train_loss": sums["loss"] / seen,
            "train_top1": sums["correct"] / seen,
            "images_per_s": sums["n"] / max(result["seconds"], 1e-9),
        }
        splits = {"test": data.test} if data.val is None else {"test": data.test, "val": data.val}
        for split, loader in splits.items():
            res = evaluate(model, loader, device=ctx.device, ctx=ctx, amp=cfg.amp, channels_last=cfg.channels_last)
            if not math.isfinite(res["loss"]):  # the same on every process (reduced)
                raise NonFiniteEvalError(state.epoch - 1, f"{split} loss", res["loss"])
            row.update({f"{split}_loss": res["loss"], f"{split}_top1": res["top1"], f"{split}_top5": res["top5"]})
        if state.ema is not None:
            res = evaluate(
                state.ema.module, data.test, device=ctx.device, ctx=ctx, amp=cfg.amp, channels_last=cfg.channels_last
            )
            row.update({"test_top1_ema": res["top1"], "test_top5_ema": res["top5"]})
        test_top1 = row.get("test_top1_ema", row["test_top1"])
        if state.record(row["val_top1"] if data.val is not None else test_top1, test_top1=test_top1) and ctx.is_main:
            self._save_best(state)
        return row

    def _save_best(self, state: RunState) -> None:
        """:data:`BEST_WEIGHTS` of this epoch, the new best, with its number in their header."""
        meta = {**_weights_meta(self.cfg, self.data.spec), "epoch": str(state.epoch)}
        export_safetensors(state.model, self.out / BEST_WEIGHTS[0], meta)
        if state.ema is not None:
            export_safetensors(state.ema.module, self.out / BEST_WEIGHTS[1], meta)

    @staticmethod
    def _best_epoch_of(path: Path) -> int | None:
        """The epoch a best-weights file says it holds (``None``: no file, or a damaged one, written again)."""
        try:
            return int(read_safetensors(path, tensors=False)[1].get("epoch", -1)) if path.is_file() else None
        except WeightsMismatchError:
            return None

    def _sync_best(self, state: RunState, *, final: bool) -> None:
        """Resuming (or at the end): best weights that are not of the best epoch were written by an epoch after the
        checkpoint, which the run trains again. They are rewritten from the weights in hand when those are the best
        epoch's; at the end, weights that still are not the best epoch's are removed, with a note."""
        best = state.best["epoch"]
        names = BEST_WEIGHTS if state.ema is not None else BEST_WEIGHTS[:1]
        if not best or all(self._best_epoch_of(self.out / name) == best for name in names):
            return
        if best == state.epoch and state.epoch_partial is None:  # a mid-epoch checkpoint holds later weights
            self._save_best(state)
        elif final:
            for name in BEST_WEIGHTS:
                (self.out / name).unlink(missing_ok=True)
            self.log(
                f"note: no {BEST_WEIGHTS[0]} for the best epoch {best}: the run was resumed from a checkpoint "
                "after it, which does not hold them"
            )

    def epoch_line(self, row: dict) -> str:
        return (
            f"epoch {row['epoch']}/{self.cfg.epochs}: loss {row['train_loss']:.4f}, train top-1 "
            f"{row['train_top1']:.4f}, "
            + (f"val top-1 {row['val_top1']:.4f}, " if "val_top1" in row else "")
            + f"test top-1 {row['test_top1']:.4f}"
            + (f" (EMA {row['test_top1_ema']:.4f})" if "test_top1_ema" in row else "")
            + f", {row['images_per_s']:.0f} img/s"
        )

    def stops_early(self, state: RunState) -> bool:
        patience = self.cfg.early_stop_patience
        return patience is not None and state.bad_epochs >= patience

    def early_stop_reason(self, state: RunState) -> str:
        return f"early stopping: no validation improvement for {self.cfg.early_stop_patience} epochs"

    def describe(self, state: RunState) -> str:
        cfg, data = self.cfg, self.data
        self.params = sum(p.numel() for p in state.model.parameters())
        return "".join(f"warning: {w}\n" for w in cfg.warnings()) + (
            f"{cfg.model} ({self.params / 1e6:.2f}M params, {cfg.model_kwargs}) on {cfg.data} at {cfg.img_size}x"
            f"{cfg.img_size}: {data.train.n} train / {data.test.n} test images, recipe {cfg.recipe}, {cfg.epochs} "
            f"epochs, batch {self.ctx.shared(cfg.batch_size)}, lr {cfg.effective_lr():.2e}, "
            f"{hardware_string(self.ctx.device)}"
        )

    def finish(self, state: RunState, row: dict, stopped: bool) -> dict:
        """The summary; on the main process also the weights (raw and EMA), plots and ``summary.json``."""
        history = read_history(self.out / "metrics.csv") if self.ctx.is_main else []
        final = row or (history[-1] if history else {})  # a resumed, already finished run trains no epoch
        summary = _summary(state, self.cfg, self.ctx, self.data, self.params, final, stopped)
        if not self.ctx.is_main:  # the history is the main process's (a resumed, finished run: none on the others)
            return summary
        self._sync_best(state, final=True)
        _write_outputs(state, self.cfg, self.data, history, summary)
        self.log(
            f"done: final test top-1 {summary['final_acc']:.4f}, best {summary['best_acc']:.4f} (epoch "
            f"{summary['best_epoch']}), {summary['train_time_s']:.1f}s training, {summary['images_per_s']:.0f} "
            f"img/s -> {self.out}"
        )
        return summary


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train and evaluate ``cfg`` (a resolved configuration, see ``resolve_config``) on the engine
    (:func:`lambdanet.engine.task.run`); returns the run summary (also written to ``<out>/summary.json``)."""
    return run(ClassificationTask, cfg, log)


def _start_note(cfg: TrainConfig, model: nn.Module) -> str:
    source = f"{cfg.model}'s published weights" if cfg.pretrained else cfg.checkpoint
    pretrained_cfg = cast("dict[str, Any]", model.pretrained_cfg)
    used = pretrained_cfg.get("weights")
    if not cfg.pretrained and used != str(cfg.checkpoint):  # a run directory: the file it stands for
        source = f"{cfg.checkpoint} ({used})"
    notes = "; ".join(pretrained_cfg.get("load_notes") or [])
    return f"starting from {source}" + (f" ({notes})" if notes else "")


def trained_for(state: dict) -> str:
    """How far a checkpoint trained: ``"epoch 3"`` at an epoch's end, ``"epoch 3 and 21 batches of epoch 4"``
    where it was saved inside an epoch (a stop)."""
    epoch, partial = int(state["epoch"]), state.get("epoch_partial")
    if not partial:
        return f"epoch {epoch}"
    return f"epoch {epoch} and {partial['batches']} batches of epoch {epoch + 1}"


def _run_meta(cfg: TrainConfig, spec: DatasetSpec) -> dict:
    """What the run's model is: the values of its weights' header, which rebuilds it (:func:`lambdanet.load_model`)."""
    return dict(
        model=cfg.model,
        model_kwargs=model_build_kwargs(cfg),
        num_classes=spec.num_classes,
        in_chans=spec.in_chans,
        classes=spec.classes,
        data=cfg.data,
        image_size=cast(int, cfg.img_size),  # resolve_config set it
        mean=list(spec.mean),
        std=list(spec.std),
    )


def _weights_meta(cfg: TrainConfig, spec: DatasetSpec) -> dict[str, str]:
    """The header of the run's weights (:func:`_run_meta`, as safetensors stores it)."""
    return weights_metadata(**_run_meta(cfg, spec))


def _write_outputs(state: RunState, cfg: TrainConfig, data: RunData, history: list[dict], summary: dict) -> None:
    """The run's weights (raw and EMA, with the header that rebuilds the model), plots and ``summary.json``."""
    out, meta = Path(cfg.out), _weights_meta(cfg, data.spec)
    export_safetensors(state.model, out / "model.safetensors", meta)
    if state.ema is not None:
        export_safetensors(state.ema.module, out / "model_ema.safetensors", meta)
    summary["plots"] = [p.name for p in plot_history(history, out, CLASSIFICATION_PANELS)]
    write_json(summary, out / "summary.json")


def _summary(
    state: RunState, cfg: TrainConfig, ctx: DistContext, data: RunData, params: int, final: dict, stopped_early: bool
) -> dict:
    """The run's ``summary.json``: what ran, what it reached (``final``: the last epoch's metrics row), how fast."""
    return {
        "model": cfg.model,
        "model_kwargs": model_build_kwargs(cfg),
        "num_classes": data.spec.num_classes,
        "in_chans": data.spec.in_chans,
        "classes": data.spec.classes,
        "data": cfg.data,
        "recipe": cfg.recipe,
        "image_size": cfg.img_size,
        "params": params,
        "epochs": state.epoch,
        "epochs_planned": cfg.epochs,
        "best_acc": state.best.get("test_top1", 0.0),
        "best_epoch": state.best["epoch"],
        "final_acc": final.get("test_top1_ema", final.get("test_top1")),
        "final_top5": final.get("test_top5_ema", final.get("test_top5")),
        "final_acc_raw_weights": final.get("test_top1"),
        "train_time_s": state.train_time_s,
        "images_per_s": state.samples_seen / max(state.train_time_s, 1e-9),
        "processes": ctx.world,
        "stopped_early": stopped_early,
        "hardware": hardware_string(ctx.device),
        "best_selected_by": "validation top-1" if data.val is not None else "test top-1",
    }


def _dry_run(model: nn.Module, loader: ImageLoader, cfg: TrainConfig, device: torch.device) -> None:
    """One eval-mode forward on two test images, to turn shape problems into a clear error up front (none on a
    process whose share of a test split smaller than the process count is empty: the others try it)."""
    batch = next(iter(loader), None)
    if batch is None:
        return
    x, _ = batch
    x = to_device(x[:2], device, cfg.channels_last)
    model.eval()
    stride = max((f.get("reduction", 0) for f in getattr(unwrap(model), "feature_info", None) or []), default=0)
    try:
        with torch.no_grad():
            model(x)
    except (ValueError, RuntimeError) as err:
        small = cast(int, cfg.img_size) < stride  # a RuntimeError of larger images is no size problem: left as it is
        if isinstance(err, RuntimeError) and not small:
            raise
        hint = f"; it downsamples by {stride}: use --img-size {stride} or more" if small else ""
        raise ValueError(
            f"model {cfg.model!r} cannot take {cfg.img_size}x{cfg.img_size} images from {cfg.data}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}{hint}"
        ) from None


def evaluate_checkpoint(
    path: str | Path,
    *,
    data: str | None = None,
    split: str = "test",
    ema: bool = True,
    batch_size: int = 256,
    device: str = "auto",
    data_dir: str | None = None,
    download: bool | None = None,
) -> dict:
    """Top-1 / top-5 of a checkpoint's model (its EMA weights when present and ``ema``) on a dataset split;
    ``path`` is a ``last.pt`` or a run directory (its ``last.pt``: :func:`lambdanet.files.run_file`); ``data``,
    ``data_dir`` and ``download`` default to the run's."""
    if split not in ("test", "train"):
        raise ValueError(f"split must be one of ['test', 'train'], got {split!r}")
    if hub_repo(path) is not None:  # weights alone: no configuration to rebuild the data from
        raise ValueError(f"{path} holds weights without a training checkpoint; evaluate the run that wrote it, or "
                         f"classify images with lambdanet predict --checkpoint {path}")  # fmt: skip
    path = run_file(path, checkpoint=True)  # a run directory: its last.pt (raw and EMA weights, configuration)
    state = load_checkpoint(path)
    check_checkpoint_task(state.get("config"), path, "classify")  # a language-model or detection checkpoint
    saved = dict(state.get("config") or {})
    if not saved:
        raise CheckpointError(f"checkpoint {path} has no training configuration")
    saved.update({k: v for k, v in (("data", data), ("data_dir", data_dir), ("download", download)) if v is not None})
    cfg = TrainConfig(**saved)
    ctx = DistContext(device=torch.device("cuda" if uses_cuda(device) else "cpu"))
    spec, train_ds, test_ds = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    meta = checkpoint_meta(state, path)
    model, kind = restore_model(state, spec, ema=ema, path=path, meta=meta)
    # normalised as the model trained (and as predict feeds it), whatever data it is evaluated on
    spec = dataclasses.replace(spec, mean=tuple(meta["mean"]), std=tuple(meta["std"]))
    loader = ImageLoader(
        test_ds if split == "test" else train_ds,
        spec,
        cfg.img_size or spec.image_size,
        train=False,
        batch_size=batch_size,
        crop_pct=run_image_cfg(meta)["crop_pct"],  # cropped as the run evaluated (and as predict does)
    )
    res = evaluate(model.to(ctx.device), loader, device=ctx.device, ctx=ctx)
    return res | {
        "model": cfg.model,
        "data": cfg.data,
        "split": split,
        "checkpoint": str(path),
        "weights": kind,
        "epoch": int(state["epoch"]),
        "trained": trained_for(state),
    }
