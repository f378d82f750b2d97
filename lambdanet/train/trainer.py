"""``train(cfg)``: a full run (data, model, recipe, checkpoints, resume, logs, summary) and
``evaluate_checkpoint(path)``. The CLI commands ``lambdanet train`` / ``lambdanet eval`` call these."""

from __future__ import annotations

import dataclasses
import inspect
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lambdanet.data import DatasetSpec, ImageLoader, Subset, TensorImages, build_datasets, split_indices
from lambdanet.models import create_model, model_info
from lambdanet.models.registry import _MODELS
from lambdanet.train.checkpoint import (
    CheckpointError,
    export_safetensors,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    unwrap,
)
from lambdanet.train.config import TrainConfig, load_yaml, resolve_config, save_yaml
from lambdanet.train.distributed import DistContext, barrier, cleanup, convert_sync_batchnorm, init_distributed
from lambdanet.train.engine import NonFiniteLossError, evaluate, train_one_epoch
from lambdanet.train.logger import RunLogger, plot_history, read_history, truncate_history, write_json
from lambdanet.train.optim import build_ema, build_optimizer, build_scheduler, set_bn_momentum

__all__ = ["train", "evaluate_checkpoint", "TrainingDivergedError", "build_model_for", "hardware_string",
           "load_pseudo_labels", "labeled_split"]

# resuming restores the saved configuration; only these may differ on the command line
_RESUME_FREE = ("progress", "tensorboard", "workers", "resume", "out", "device")


class TrainingDivergedError(RuntimeError):
    """The loss became NaN/inf; the run stopped and kept its last good checkpoint."""


def hardware_string(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    base = f"{platform.system()} {cpu}, {threads} CPU threads, torch {torch.__version__}"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; {base}"
    return base


def _accepted(model: str) -> set[str]:
    if model not in _MODELS:
        model_info(model)  # raises the "unknown model ...; registered models: ..." ValueError
    return set(inspect.signature(_MODELS[model]).parameters)


def build_model_for(cfg: TrainConfig, spec: DatasetSpec, img_size: int) -> tuple[nn.Module, dict]:
    """``create_model`` for a dataset: classes and channels from the data, ``img_size`` for global layers,
    the small-image stem (``stem='cifar'``) for images up to 64 pixels and the recipe's compact width when
    the model family has those options and ``model_kwargs`` does not set them; regularisation from the
    recipe or, for ``paper350``, from the model's Table 20 metadata."""
    accepted = _accepted(cfg.model)
    kwargs = dict(cfg.model_kwargs)
    if "stem" in accepted and "stem" not in kwargs and img_size <= 64:
        kwargs["stem"] = "cifar"
    if cfg.compact_width and "base_width" in accepted and "base_width" not in kwargs:
        kwargs["base_width"] = cfg.compact_width
    recipe = model_info(cfg.model).recipe if cfg.recipe == "paper350" else {}
    drop_rate = cfg.drop_rate if cfg.drop_rate is not None else recipe.get("dropout", 0.0)
    drop_path = cfg.drop_path_rate if cfg.drop_path_rate is not None else recipe.get("drop_path_rate", 0.0)
    if drop_rate:
        kwargs.setdefault("drop_rate", drop_rate)
    if drop_path:
        if "drop_path_rate" not in accepted:
            raise ValueError(f"model {cfg.model!r} has no stochastic depth; drop_path_rate must be 0 or null")
        kwargs.setdefault("drop_path_rate", drop_path)
    if "img_size" in accepted:
        kwargs.setdefault("img_size", img_size)
    model = create_model(cfg.model, num_classes=spec.num_classes, in_chans=spec.in_chans, **kwargs)
    return model, kwargs


def labeled_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labelled, unlabelled) indices of the training set for semi-supervised runs: a seeded ``fraction``
    keeps its labels."""
    labeled, unlabeled = split_indices(n, 1.0 - fraction, seed + 7)
    return labeled, unlabeled


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


def _relabeled(base, indices, labels):
    if isinstance(base, TensorImages):
        return TensorImages(base.images[torch.as_tensor(indices)], torch.as_tensor(labels))
    raise ValueError("pseudo-labels are supported for in-memory datasets (digits, mnist5k, fashion-mnist, cifar)")


def _prepare_data(cfg: TrainConfig, ctx: DistContext):
    spec, train_ds, test_ds = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    img = cfg.img_size or spec.image_size
    n = len(train_ds)
    pool = labeled_split(n, cfg.labeled_fraction, cfg.seed)[0]
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
        parts = [_relabeled(train_ds, pool, train_ds.labels[torch.as_tensor(pool)]),
                 _relabeled(train_ds, pl["indices"], pl["labels"])]
        fit_ds = TensorImages(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]))
    ra = (cfg.randaugment_layers, _ra_magnitude(cfg)) if cfg.randaugment_layers else None
    world = ctx.world
    eval_bs = max(world, cfg.eval_batch_size - cfg.eval_batch_size % world)
    train_loader = ImageLoader(fit_ds, spec, img, train=True, batch_size=cfg.batch_size, seed=cfg.seed,
                               rank=ctx.rank, world=world, workers=cfg.workers, augment=cfg.augment, randaugment=ra)
    if len(train_loader) == 0:
        raise ValueError(f"batch_size={cfg.batch_size} is larger than the {train_loader.n} training images of "
                         f"{cfg.data}; lower --batch-size")

    def eval_loader(ds):
        return ImageLoader(ds, spec, img, train=False, batch_size=eval_bs, rank=ctx.rank, world=world,
                           workers=cfg.workers)

    return spec, img, train_loader, eval_loader(val_ds) if val_ds is not None else None, eval_loader(test_ds)


def _ra_magnitude(cfg: TrainConfig) -> int:
    if cfg.recipe == "paper350":
        return int(model_info(cfg.model).recipe.get("randaugment_magnitude", cfg.randaugment_magnitude))
    return cfg.randaugment_magnitude


def _resolve_resume(cfg: TrainConfig) -> TrainConfig:
    out = Path(cfg.out)
    saved_cfg, ckpt = out / "config.yaml", out / "last.pt"
    if not saved_cfg.exists() or not ckpt.exists():
        raise ValueError(f"nothing to resume in {out}: it needs config.yaml and last.pt from an earlier run")
    saved = load_yaml(saved_cfg)
    free = {k: getattr(cfg, k) for k in _RESUME_FREE}
    return resolve_config(saved.get("recipe"), saved, free)


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train and evaluate ``cfg``; returns the run summary (also written to ``<out>/summary.json``)."""
    ctx = init_distributed(cfg.device)
    finished = False
    try:
        summary = _train(cfg, ctx, log if ctx.is_main else (lambda s: None))
        finished = True
        return summary
    finally:
        cleanup(ctx, synchronize=finished)


def _train(cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None]) -> dict:
    cfg.validate()
    out = Path(cfg.out)
    if cfg.resume:
        cfg = _resolve_resume(cfg)
    elif (out / "last.pt").exists():
        raise ValueError(f"{out} already holds a run (last.pt); pass --resume to continue it or choose another --out")
    device = ctx.device
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    spec, img, train_loader, val_loader, test_loader = _prepare_data(cfg, ctx)
    model, model_kwargs = build_model_for(cfg, spec, img)
    params = sum(p.numel() for p in model.parameters())
    if cfg.bn_momentum is not None:
        set_bn_momentum(model, cfg.bn_momentum)
    if cfg.sync_bn and ctx.enabled:
        model = convert_sync_batchnorm(model, device)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    _dry_run(model, test_loader, cfg, img, device)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out / "config.yaml")
    barrier(ctx)

    optimizer = build_optimizer(model, cfg)
    steps = len(train_loader) if cfg.max_train_batches is None else min(len(train_loader), cfg.max_train_batches)
    scheduler = build_scheduler(optimizer, cfg, steps)
    ema = build_ema(model, cfg.ema_decay) if cfg.ema_decay else None
    scaler = torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    run_model: nn.Module = torch.compile(model) if cfg.compile else model
    if ctx.enabled:
        run_model = nn.parallel.DistributedDataParallel(
            run_model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)

    ckpt_path = out / "last.pt"
    start_epoch, train_time, samples_seen = 0, 0.0, 0
    best = {"score": -1.0, "test_top1": 0.0, "epoch": 0}
    bad_epochs, last_saved = 0, 0
    if cfg.resume:
        state = load_checkpoint(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start_epoch, train_time = int(state["epoch"]), float(state["train_time_s"])
        samples_seen, best, bad_epochs = int(state["samples_seen"]), dict(state["best"]), int(state["bad_epochs"])
        set_rng_state(state["rng"])
        last_saved = start_epoch
        if ctx.is_main:
            truncate_history(out / "metrics.csv", start_epoch)
        log(f"resuming {out}: {start_epoch}/{cfg.epochs} epochs done")

    logger = RunLogger(out, enabled=ctx.is_main, tensorboard=cfg.tensorboard)
    log(f"{cfg.model} ({params / 1e6:.2f}M params, {model_kwargs}) on {cfg.data} at {img}x{img}: "
        f"{train_loader.n} train / {test_loader.n} test images, recipe {cfg.recipe}, {cfg.epochs} epochs, "
        f"batch {cfg.batch_size} x {ctx.world} process(es), lr {cfg.effective_lr():.2e}, {hardware_string(device)}")
    stopped_early = False
    epoch = start_epoch
    last_row: dict = {}
    for epoch in range(start_epoch, cfg.epochs):
        train_loader.set_epoch(epoch)
        bar = _progress(cfg, ctx, train_loader, epoch)
        try:
            stats = train_one_epoch(run_model, train_loader, optimizer, scheduler, loss_fn, epoch=epoch, device=device,
                                    ctx=ctx, amp=cfg.amp, scaler=scaler, ema=ema, channels_last=cfg.channels_last,
                                    progress=bar, max_batches=cfg.max_train_batches)
        except NonFiniteLossError as err:
            where = (f"the last good checkpoint is {ckpt_path} (epoch {last_saved})" if last_saved
                     else "no checkpoint had been written yet")
            raise TrainingDivergedError(f"{err}; training stopped, {where}. Lower --lr or check the data.") from None
        finally:
            if bar is not None:
                bar.close()
        train_time += stats["seconds"]
        samples_seen += stats["samples"]
        row = {"epoch": epoch + 1, "lr": optimizer.param_groups[0]["lr"], "train_loss": stats["loss"],
               "train_top1": stats["top1"], "images_per_s": stats["images_per_s"]}
        evals = {"test": evaluate(run_model, test_loader, device=device, ctx=ctx, amp=cfg.amp,
                                  channels_last=cfg.channels_last)}
        if val_loader is not None:
            evals["val"] = evaluate(run_model, val_loader, device=device, ctx=ctx, amp=cfg.amp,
                                    channels_last=cfg.channels_last)
        for split, res in evals.items():
            row.update({f"{split}_loss": res["loss"], f"{split}_top1": res["top1"], f"{split}_top5": res["top5"]})
        if ema is not None:
            res = evaluate(ema.module, test_loader, device=device, ctx=ctx, amp=cfg.amp, channels_last=cfg.channels_last)
            row.update({"test_top1_ema": res["top1"], "test_top5_ema": res["top5"]})
        reported = row.get("test_top1_ema", row["test_top1"])
        score = row["val_top1"] if val_loader is not None else reported
        if score > best["score"]:
            best, bad_epochs = {"score": score, "test_top1": reported, "epoch": epoch + 1}, 0
        else:
            bad_epochs += 1
        logger.log_epoch(row)
        last_row = row
        log(f"epoch {epoch + 1}/{cfg.epochs}: loss {stats['loss']:.4f}, train top-1 {stats['top1']:.4f}, "
            + (f"val top-1 {row['val_top1']:.4f}, " if val_loader is not None else "")
            + f"test top-1 {row['test_top1']:.4f}" + (f" (EMA {row['test_top1_ema']:.4f})" if ema else "")
            + f", {stats['images_per_s']:.0f} img/s")
        stopped_early = cfg.early_stop_patience is not None and bad_epochs >= cfg.early_stop_patience
        last = epoch + 1 == cfg.epochs or stopped_early
        if ctx.is_main and ((epoch + 1) % cfg.checkpoint_every == 0 or last):
            save_checkpoint({"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(), "ema": ema.state_dict() if ema else None,
                             "scaler": scaler.state_dict() if scaler else None, "epoch": epoch + 1,
                             "train_time_s": train_time, "samples_seen": samples_seen, "best": best,
                             "bad_epochs": bad_epochs, "rng": rng_state(), "config": dataclasses.asdict(cfg),
                             "model_kwargs": model_kwargs}, ckpt_path)
            last_saved = epoch + 1
        if stopped_early:
            log(f"early stopping: no validation improvement for {cfg.early_stop_patience} epochs")
            break

    completed = epoch + 1 if cfg.epochs > start_epoch else start_epoch
    history = read_history(out / "metrics.csv") if ctx.is_main else []
    final = last_row or (history[-1] if history else {})
    summary = {
        "model": cfg.model, "model_kwargs": model_kwargs, "data": cfg.data, "recipe": cfg.recipe,
        "image_size": img, "params": params, "epochs": completed, "epochs_planned": cfg.epochs,
        "best_acc": best["test_top1"], "best_epoch": best["epoch"],
        "final_acc": final.get("test_top1_ema", final.get("test_top1")),
        "final_top5": final.get("test_top5_ema", final.get("test_top5")),
        "final_acc_raw_weights": final.get("test_top1"),
        "train_time_s": train_time, "images_per_s": samples_seen / max(train_time, 1e-9),
        "processes": ctx.world, "stopped_early": stopped_early, "hardware": hardware_string(device),
        "best_selected_by": "validation top-1" if val_loader is not None else "test top-1",
    }
    if ctx.is_main:
        export_safetensors(model, out / "model.safetensors")
        if ema is not None:
            export_safetensors(ema.module, out / "model_ema.safetensors")
        summary["plots"] = [p.name for p in plot_history(history, out)]
        write_json(summary, out / "summary.json")
        logger.close()
    log(f"done: final test top-1 {summary['final_acc']:.4f}, best {summary['best_acc']:.4f} (epoch "
        f"{summary['best_epoch']}), {summary['train_time_s']:.1f}s training, {summary['images_per_s']:.0f} img/s "
        f"-> {out}")
    return summary


def _progress(cfg: TrainConfig, ctx: DistContext, loader: ImageLoader, epoch: int):
    if not (cfg.progress and ctx.is_main):
        return None
    from tqdm import tqdm

    total = loader.num_samples * ctx.world
    if cfg.max_train_batches is not None:
        total = min(total, cfg.max_train_batches * cfg.batch_size)
    # redirected to a file (cluster logs): redraws at most every 30 s instead of several per second
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, unit="img", unit_scale=True, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                dynamic_ncols=True, file=sys.stderr, mininterval=interval)


def _dry_run(model: nn.Module, loader: ImageLoader, cfg: TrainConfig, img: int, device: torch.device) -> None:
    """One eval-mode forward on two test images, to turn shape problems into a clear error up front."""
    x, _ = next(iter(loader))
    x = x[:2].to(device)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except ValueError as err:
        raise ValueError(f"model {cfg.model!r} cannot take {img}x{img} images from {cfg.data}: {err}") from None


def evaluate_checkpoint(path: str | Path, *, data: str | None = None, split: str = "test", ema: bool = True,
                        batch_size: int = 256, device: str = "auto", data_dir: str | None = None) -> dict:
    """Top-1 / top-5 of a checkpoint's model (its EMA weights when present and ``ema``) on a dataset split."""
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
    spec, _, test = build_datasets(cfg.data, data_dir=cfg.data_dir, download=cfg.download)
    img = cfg.img_size or spec.image_size
    kwargs = dict(state.get("model_kwargs") or {})
    model = create_model(cfg.model, num_classes=spec.num_classes, in_chans=spec.in_chans, **kwargs)
    weights = state["model"]
    if ema and state.get("ema"):
        weights = {k[len("module."):]: v for k, v in state["ema"].items() if k.startswith("module.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit {cfg.model}{kwargs}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if split not in ("test", "train"):
        raise ValueError(f"split must be one of ['test', 'train'], got {split!r}")
    ds = test if split == "test" else build_datasets(cfg.data, data_dir=cfg.data_dir)[1]
    loader = ImageLoader(ds, spec, img, train=False, batch_size=batch_size)
    model.to(ctx.device)
    res = evaluate(model, loader, device=ctx.device, ctx=ctx)
    res.update({"model": cfg.model, "data": cfg.data, "split": split, "checkpoint": str(path),
                "weights": "ema" if (ema and state.get("ema")) else "raw", "epoch": int(state["epoch"])})
    return res
