"""``train(cfg)``: a full run (data, model, recipe, checkpoints, resume, logs, summary) and
``evaluate_checkpoint(path)``. The CLI commands ``lambdanet train`` / ``lambdanet eval`` call these.

A run is a :class:`RunState` advanced one epoch at a time (:func:`run_epoch`); its ``state_dict`` is the
checkpoint and ``load_state_dict`` is ``--resume``, one symmetric pair. Everything recipe- or model-specific
was settled by :func:`lambdanet.train.config.resolve_config` before the run starts.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lambdanet.data import DatasetSpec, ImageLoader, Subset, TensorImages, build_datasets, labeled_split, split_indices
from lambdanet.files import run_file, weights_metadata
from lambdanet.models import create_model
from lambdanet.engine.checkpoint import (
    CheckpointError,
    export_safetensors,
    load_checkpoint,
    unwrap,
)
from lambdanet.train.config import (
    RESUME_FREE,
    TrainConfig,
    config_differences,
    describe_differences,
    flag,
    model_build_kwargs,
    resolve_config,
    save_yaml,
)
from lambdanet.engine.distributed import (
    DistContext,
    all_reduce_sum,
    barrier,
    cleanup,
    convert_sync_batchnorm,
    data_parallel,
    init_distributed,
)
from lambdanet.engine.loop import NonFiniteLossError, evaluate, train_one_epoch
from lambdanet.train.load import restore_model
from lambdanet.engine.logger import RunLogger, plot_history, read_history, truncate_history, write_json
from lambdanet.engine.optim import build_ema, build_optimizer, build_scheduler, set_bn_momentum
from lambdanet.engine.preempt import Preempted, StopSignals, resume_point
from lambdanet.engine.rundir import RunDirBusyError, RunDirLock, check_new_run
from lambdanet.engine.state import RunState

__all__ = ["train", "evaluate_checkpoint", "TrainingDivergedError", "RunState", "build_model_for",
           "hardware_string", "load_pseudo_labels", "run_epoch"]


class TrainingDivergedError(RuntimeError):
    """The loss became NaN/inf; the run stopped and kept its last good checkpoint."""


def hardware_string(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    base = f"{platform.system()} {cpu}, {threads} CPU threads, torch {torch.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; {base}"
    return base


def build_model_for(cfg: TrainConfig, spec: DatasetSpec, *, initial_weights: bool = True) -> nn.Module:
    """``create_model`` of a resolved ``cfg`` for a dataset's classes and channels, starting from the weights
    of ``--pretrained`` / ``--checkpoint`` when ``initial_weights`` (a resumed run takes its own instead)."""
    weights = {"pretrained": cfg.pretrained, "checkpoint_path": cfg.checkpoint} if initial_weights else {}
    return create_model(cfg.model, num_classes=spec.num_classes, in_chans=spec.in_chans, **weights,
                        **model_build_kwargs(cfg))


def load_pseudo_labels(path: str | Path, cfg: TrainConfig) -> dict:
    """A pseudo-label file from ``lambdanet pseudo-label`` that matches this run's data and split."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"pseudo_labels file {path} does not exist")
    data = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("data", "labeled_fraction", "seed"):
        mine = getattr(cfg, key)
        if data.get(key) != mine:
            raise ValueError(f"pseudo_labels {path} were made for {key}={data.get(key)!r}, this run has {key}={mine!r}")
    return data


@dataclass
class RunData:
    spec: DatasetSpec
    train: ImageLoader
    val: ImageLoader | None
    test: ImageLoader


def _prepare_data(cfg: TrainConfig, ctx: DistContext) -> RunData:
    spec, train_ds, test_ds = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    pool = labeled_split(len(train_ds), cfg.labeled_fraction, cfg.seed)[0]
    val_ds = None
    if cfg.val_split:
        keep, held = split_indices(len(pool), cfg.val_split, cfg.seed + 1)
        val_ds = Subset(train_ds, pool[held])
        pool = pool[keep]
    fit_ds = Subset(train_ds, pool)
    if cfg.pseudo_labels:
        pl = load_pseudo_labels(cfg.pseudo_labels, cfg)
        if not isinstance(train_ds, TensorImages):
            raise ValueError("pseudo-labels are supported for in-memory datasets (digits, mnist5k, fashion-mnist, "
                             "cifar10/100)")
        keep = torch.as_tensor(pool)
        fit_ds = TensorImages(torch.cat([train_ds.images[keep], train_ds.images[torch.as_tensor(pl["indices"])]]),
                              torch.cat([train_ds.labels[keep], torch.as_tensor(pl["labels"])]))
    ra = (cfg.randaugment_layers, cfg.randaugment_magnitude) if cfg.randaugment_layers else None
    world, img = ctx.world, cfg.img_size
    eval_bs = max(world, cfg.eval_batch_size - cfg.eval_batch_size % world)
    train_loader = ImageLoader(fit_ds, spec, img, train=True, batch_size=cfg.batch_size, seed=cfg.seed,
                               rank=ctx.rank, world=world, workers=cfg.workers, augment=cfg.augment, randaugment=ra)
    if len(train_loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} is larger than the {train_loader.n} training images of "
                         f"{cfg.data}; lower --batch-size")

    def eval_loader(ds):
        return ImageLoader(ds, spec, img, train=False, batch_size=eval_bs, rank=ctx.rank, world=world,
                           workers=cfg.workers)

    return RunData(spec, train_loader, eval_loader(val_ds) if val_ds is not None else None, eval_loader(test_ds))


def _check_resume(cfg: TrainConfig) -> int:
    """``--resume`` continues the run as it was configured: only :data:`RESUME_FREE` options and ``epochs``
    (checked against the checkpoint later) may differ from the saved configuration. Returns the saved
    number of epochs."""
    saved = dataclasses.asdict(resolve_config(overrides={"out": cfg.out, "resume": True}))
    changed = config_differences(saved, cfg, ignore=RESUME_FREE + ("epochs",))
    if changed:
        raise ValueError(f"--resume continues {cfg.out} as it was configured, but {describe_differences(changed)} "
                         "differ; only --epochs (to "
                         f"train longer) and {', '.join(flag(k) for k in RESUME_FREE if k not in ('resume', 'out'))} "
                         "may change: drop the others, or start a new run with another --out")
    return int(saved["epochs"])


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train and evaluate ``cfg`` (a resolved configuration, see ``resolve_config``); returns the run summary
    (also written to ``<out>/summary.json``)."""
    ctx = init_distributed(cfg.device)
    finished = False
    lock = RunDirLock(cfg.out)
    try:
        busy = None
        if ctx.is_main:
            try:
                lock.acquire()
            except RunDirBusyError as err:
                busy = err
        if all_reduce_sum([float(busy is not None)], ctx)[0]:  # every rank stops when rank 0 could not lock
            raise busy or RunDirBusyError(f"run directory {cfg.out} is in use by another process")
        with StopSignals() as stop:  # SIGTERM / SIGINT: a step-level checkpoint, then Preempted
            summary = _train(cfg, ctx, log if ctx.is_main else (lambda s: None), stop)
        finished = True
        return summary
    finally:
        lock.release()
        cleanup(ctx, synchronize=finished)


def _train(cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None], stop: StopSignals | None = None) -> dict:
    cfg.validate()
    out = Path(cfg.out)
    saved_epochs = _check_resume(cfg) if cfg.resume else 0
    check_new_run(out, cfg.resume)
    device = ctx.device
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    data = _prepare_data(cfg, ctx)
    state = _initial_state(cfg, data, ctx, log)
    if cfg.resume:
        _restore(state, cfg, saved_epochs, ctx, log)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(dataclasses.replace(cfg, resume=False), out / "config.yaml")
    barrier(ctx)
    for warning in cfg.warnings():
        log(f"warning: {warning}")

    model = state.model
    params = sum(p.numel() for p in model.parameters())
    run_model: nn.Module = torch.compile(model) if cfg.compile else model
    run_model = data_parallel(run_model, ctx)
    logger = RunLogger(out, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
    log(f"{cfg.model} ({params / 1e6:.2f}M params, {cfg.model_kwargs}) on {cfg.data} at {cfg.img_size}x{cfg.img_size}: "
        f"{data.train.n} train / {data.test.n} test images, recipe {cfg.recipe}, {cfg.epochs} epochs, "
        f"batch {cfg.batch_size} x {ctx.world} process(es), lr {cfg.effective_lr():.2e}, {hardware_string(device)}")
    last_row, stopped_early = _epochs(state, run_model, data, cfg, ctx, logger, log, stop)
    history = read_history(out / "metrics.csv") if ctx.is_main else []
    final = last_row or (history[-1] if history else {})  # a resumed, already finished run trains no epoch
    summary = _summary(state, cfg, ctx, data, params, final, stopped_early)
    if ctx.is_main:
        _write_outputs(state, cfg, data, history, summary)
        logger.close()
    log(f"done: final test top-1 {summary['final_acc']:.4f}, best {summary['best_acc']:.4f} (epoch "
        f"{summary['best_epoch']}), {summary['train_time_s']:.1f}s training, {summary['images_per_s']:.0f} img/s "
        f"-> {out}")
    return summary


def _epochs(state: RunState, run_model: nn.Module, data: RunData, cfg: TrainConfig, ctx: DistContext,
            logger: RunLogger, log: Callable[[str], None], stop: StopSignals | None) -> tuple[dict, bool]:
    """The epochs left, each logged and checkpointed (every ``checkpoint_every``, at the end and on early
    stopping); a signal saves the step and raises :class:`Preempted`. Returns (the last epoch's row, whether
    the run stopped early)."""
    out = Path(cfg.out)
    ckpt_path = out / "last.pt"
    stopped_early, last_row, last_saved = False, {}, state.epoch
    while state.epoch < cfg.epochs and not stopped_early:
        try:
            row = run_epoch(state, run_model, data, cfg, ctx, stop)
        except NonFiniteLossError as err:
            where = (f"the last good checkpoint is {ckpt_path} (epoch {last_saved})" if last_saved
                     else "no checkpoint had been written yet")
            raise TrainingDivergedError(f"{err}; training stopped, {where}. Lower --lr or check the data.") from None
        if row is None:  # a signal: save where the epoch stands, then stop
            if ctx.is_main:
                _save(state, cfg, ckpt_path)
            barrier(ctx)  # under torchrun the others wait for the save before they end
            logger.close()
            raise Preempted.at(stop.received, f"in epoch {state.epoch + 1}/{cfg.epochs} after batch "
                               f"{state.epoch_partial['batches']}/{_batches_per_epoch(cfg, data)}", ckpt_path, out)
        last_row = row
        logger.log_epoch(last_row)
        log(_epoch_line(last_row, cfg))
        stopped_early = cfg.early_stop_patience is not None and state.bad_epochs >= cfg.early_stop_patience
        if ctx.is_main and (state.epoch % cfg.checkpoint_every == 0 or state.epoch == cfg.epochs or stopped_early):
            _save(state, cfg, ckpt_path)
            last_saved = state.epoch
        if stopped_early:
            log(f"early stopping: no validation improvement for {cfg.early_stop_patience} epochs")
    return last_row, stopped_early


def _write_outputs(state: RunState, cfg: TrainConfig, data: RunData, history: list[dict], summary: dict) -> None:
    """The run's weights (raw and EMA, with the header that rebuilds the model), plots and ``summary.json``."""
    out, spec = Path(cfg.out), data.spec
    meta = weights_metadata(model=cfg.model, model_kwargs=model_build_kwargs(cfg), num_classes=spec.num_classes,
                            in_chans=spec.in_chans, classes=spec.classes, data=cfg.data, image_size=cfg.img_size,
                            mean=spec.mean, std=spec.std)
    export_safetensors(state.model, out / "model.safetensors", meta)
    if state.ema is not None:
        export_safetensors(state.ema.module, out / "model_ema.safetensors", meta)
    summary["plots"] = [p.name for p in plot_history(history, out)]
    write_json(summary, out / "summary.json")


def _save(state: RunState, cfg: TrainConfig, path: Path) -> None:
    """``last.pt``: the run's state with its configuration and the model's build arguments."""
    state.save(path, cfg, model_kwargs=model_build_kwargs(cfg))


def _initial_state(cfg: TrainConfig, data: RunData, ctx: DistContext, log: Callable[[str], None]) -> RunState:
    """The model (checked on two test images), optimiser, schedule, EMA and loss scaler of a new run."""
    device = ctx.device
    model = build_model_for(cfg, data.spec, initial_weights=not cfg.resume)
    if (cfg.pretrained or cfg.checkpoint) and not cfg.resume:
        source = f"{cfg.model}'s published weights" if cfg.pretrained else cfg.checkpoint
        used = model.pretrained_cfg.get("weights")
        if not cfg.pretrained and used != str(cfg.checkpoint):  # a run directory: the file it stands for
            source = f"{cfg.checkpoint} ({used})"
        notes = "; ".join(model.pretrained_cfg.get("load_notes") or [])
        log(f"starting from {source}" + (f" ({notes})" if notes else ""))
    if cfg.bn_momentum is not None:
        set_bn_momentum(model, cfg.bn_momentum)
    if cfg.sync_bn and ctx.enabled:
        model = convert_sync_batchnorm(model, device)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    _dry_run(model, data.test, cfg, device)
    optimizer = build_optimizer(model, cfg)
    steps = _batches_per_epoch(cfg, data)
    return RunState(model, optimizer, build_scheduler(optimizer, cfg, steps),
                      ema=build_ema(model, cfg.ema_decay) if cfg.ema_decay else None,
                      scaler=torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None)


def _batches_per_epoch(cfg: TrainConfig, data: RunData) -> int:
    """The optimiser steps of one epoch (``max_train_batches`` caps the loader's batches)."""
    return len(data.train) if cfg.max_train_batches is None else min(len(data.train), cfg.max_train_batches)


def _restore(state: RunState, cfg: TrainConfig, saved_epochs: int, ctx: DistContext,
             log: Callable[[str], None]) -> None:
    """``--resume``: load ``last.pt`` into ``state``; more ``epochs`` than the run was planned with extend it."""
    out = Path(cfg.out)
    state.load_state_dict(load_checkpoint(out / "last.pt", map_location=ctx.device))
    if cfg.epochs < state.epoch:
        raise ValueError(f"--epochs {cfg.epochs} is fewer than the {state.epoch} epochs {out} has done")
    if ctx.is_main:
        truncate_history(out / "metrics.csv", state.epoch)
    log(f"resuming {out}: {state.epoch}/{saved_epochs} epochs done{resume_point(state.epoch, state.epoch_partial)}")
    if cfg.epochs != saved_epochs:
        log(f"extending the run from {saved_epochs} to {cfg.epochs} epochs: the learning-rate schedule is "
            f"recomputed over {cfg.epochs} epochs and continues from epoch {state.epoch}")


def run_epoch(state: RunState, run_model: nn.Module, data: RunData, cfg: TrainConfig, ctx: DistContext,
              stop: StopSignals | None = None) -> dict | None:
    """Train one epoch (or the rest of a preempted one), evaluate, and advance ``state``; returns the epoch's
    metrics row, or ``None`` when ``stop`` ended the epoch early (``state.epoch_partial`` then says where)."""
    device, epoch = ctx.device, state.epoch
    partial = dict(state.epoch_partial or {})
    if partial and not ctx.is_main:  # the sums of every rank were saved once: the main process carries them
        partial = {"batches": partial["batches"], "seconds": partial.get("seconds", 0.0)}
    data.train.set_epoch(epoch, start_batch=int(partial.get("batches", 0)))
    bar = _progress(cfg, ctx, data.train, epoch, initial=int(partial.get("seen", 0)))
    try:
        stats = train_one_epoch(run_model, data.train, state.optimizer, state.scheduler, _loss_fn(cfg), epoch=epoch,
                                device=device, ctx=ctx, amp=cfg.amp, scaler=state.scaler, ema=state.ema,
                                channels_last=cfg.channels_last, progress=bar, max_batches=cfg.max_train_batches,
                                partial=partial, stop=stop)
    finally:
        if bar is not None:
            bar.close()
    if "partial" in stats:
        state.epoch_partial = stats["partial"]
        return None
    state.epoch_partial = None
    state.epoch += 1
    state.train_time_s += stats["seconds"]
    state.samples_seen += stats["samples"]
    row = {"epoch": state.epoch, "lr": state.optimizer.param_groups[0]["lr"], "train_loss": stats["loss"],
           "train_top1": stats["top1"], "images_per_s": stats["images_per_s"]}
    splits = {"test": data.test} if data.val is None else {"test": data.test, "val": data.val}
    for split, loader in splits.items():
        res = evaluate(run_model, loader, device=device, ctx=ctx, amp=cfg.amp, channels_last=cfg.channels_last)
        row.update({f"{split}_loss": res["loss"], f"{split}_top1": res["top1"], f"{split}_top5": res["top5"]})
    if state.ema is not None:
        res = evaluate(state.ema.module, data.test, device=device, ctx=ctx, amp=cfg.amp,
                       channels_last=cfg.channels_last)
        row.update({"test_top1_ema": res["top1"], "test_top5_ema": res["top5"]})
    state.record(row, row["val_top1"] if data.val is not None else row.get("test_top1_ema", row["test_top1"]))
    return row


def _loss_fn(cfg: TrainConfig) -> nn.Module:
    return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)


def _epoch_line(row: dict, cfg: TrainConfig) -> str:
    return (f"epoch {row['epoch']}/{cfg.epochs}: loss {row['train_loss']:.4f}, train top-1 {row['train_top1']:.4f}, "
            + (f"val top-1 {row['val_top1']:.4f}, " if "val_top1" in row else "")
            + f"test top-1 {row['test_top1']:.4f}"
            + (f" (EMA {row['test_top1_ema']:.4f})" if "test_top1_ema" in row else "")
            + f", {row['images_per_s']:.0f} img/s")


def _summary(state: RunState, cfg: TrainConfig, ctx: DistContext, data: RunData, params: int, final: dict,
             stopped_early: bool) -> dict:
    """The run's ``summary.json``: what ran, what it reached (``final``: the last epoch's metrics row), how fast."""
    return {
        "model": cfg.model, "model_kwargs": model_build_kwargs(cfg), "num_classes": data.spec.num_classes,
        "in_chans": data.spec.in_chans, "classes": data.spec.classes, "data": cfg.data, "recipe": cfg.recipe,
        "image_size": cfg.img_size, "params": params, "epochs": state.epoch, "epochs_planned": cfg.epochs,
        "best_acc": state.best["test_top1"], "best_epoch": state.best["epoch"],
        "final_acc": final.get("test_top1_ema", final.get("test_top1")),
        "final_top5": final.get("test_top5_ema", final.get("test_top5")),
        "final_acc_raw_weights": final.get("test_top1"),
        "train_time_s": state.train_time_s, "images_per_s": state.samples_seen / max(state.train_time_s, 1e-9),
        "processes": ctx.world, "stopped_early": stopped_early, "hardware": hardware_string(ctx.device),
        "best_selected_by": "validation top-1" if data.val is not None else "test top-1",
    }


def _progress(cfg: TrainConfig, ctx: DistContext, loader: ImageLoader, epoch: int, initial: int = 0):
    if not (cfg.progress and ctx.is_main):
        return None
    from tqdm import tqdm

    total = loader.num_samples * ctx.world
    if cfg.max_train_batches is not None:
        total = min(total, cfg.max_train_batches * cfg.batch_size)
    # redirected to a file (cluster logs): redraws at most every 30 s instead of several per second
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, unit="img", unit_scale=True, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                leave=False, dynamic_ncols=True, file=sys.stderr, mininterval=interval)


def _dry_run(model: nn.Module, loader: ImageLoader, cfg: TrainConfig, device: torch.device) -> None:
    """One eval-mode forward on two test images, to turn shape problems into a clear error up front."""
    x, _ = next(iter(loader))
    x = x[:2].to(device)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model.eval()
    stride = max((f.get("reduction", 0) for f in getattr(unwrap(model), "feature_info", None) or []), default=0)
    try:
        with torch.no_grad():
            model(x)
    except (ValueError, RuntimeError) as err:
        small = cfg.img_size < stride  # a RuntimeError of larger images is no size problem: left as it is
        if isinstance(err, RuntimeError) and not small:
            raise
        hint = f"; it downsamples by {stride}: use --img-size {stride} or more" if small else ""
        raise ValueError(f"model {cfg.model!r} cannot take {cfg.img_size}x{cfg.img_size} images from {cfg.data}: "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}{hint}"
                         ) from None


def evaluate_checkpoint(path: str | Path, *, data: str | None = None, split: str = "test", ema: bool = True,
                        batch_size: int = 256, device: str = "auto", data_dir: str | None = None) -> dict:
    """Top-1 / top-5 of a checkpoint's model (its EMA weights when present and ``ema``) on a dataset split;
    ``path`` is a ``last.pt`` or a run directory (its ``last.pt``: :func:`lambdanet.files.run_file`)."""
    if split not in ("test", "train"):
        raise ValueError(f"split must be one of ['test', 'train'], got {split!r}")
    path = run_file(path, checkpoint=True)  # a run directory: its last.pt (raw and EMA weights, configuration)
    state = load_checkpoint(path)
    saved = dict(state.get("config") or {})
    if not saved:
        raise CheckpointError(f"checkpoint {path} has no training configuration")
    if data is not None:
        saved["data"] = data
    if data_dir is not None:
        saved["data_dir"] = data_dir
    cfg = TrainConfig(**saved)
    ctx = DistContext(device=torch.device("cuda" if (device == "cuda" or (device == "auto" and
                                                                         torch.cuda.is_available())) else "cpu"))
    spec, train_ds, test_ds = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    model, kind = restore_model(state, spec, ema=ema)
    loader = ImageLoader(test_ds if split == "test" else train_ds, spec, cfg.img_size or spec.image_size, train=False,
                         batch_size=batch_size)
    model.to(ctx.device)
    res = evaluate(model, loader, device=ctx.device, ctx=ctx)
    res.update({"model": cfg.model, "data": cfg.data, "split": split, "checkpoint": str(path), "weights": kind,
                "epoch": int(state["epoch"])})
    return res
