"""Language modelling as a task of the engine: ``train_lm(cfg)`` (``lambdanet lm train``) and ``sample``
(``lambdanet lm sample``).

Training draws ``batch_size`` random windows of ``context + 1`` bytes from the training split each step (the
windows of an epoch follow from the seed and the epoch, so a resumed run draws the same ones), minimises the
next-byte cross-entropy, and after every epoch evaluates bits per byte on the first ``eval_bytes`` of the
validation split (consecutive windows of ``context`` bytes); the end of the run evaluates the whole split,
which ``summary.json`` reports as ``val_bits_per_byte``. Everything else (recipes, YAML, AMP, checkpoints and
``--resume``, torchrun, progress, CSV / TensorBoard, plots) is the engine's. The options and recipes are
:mod:`lambdanet.tasks.lm.config`, the corpora :mod:`lambdanet.tasks.lm.data`."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lambdanet.engine.checkpoint import CheckpointError, export_safetensors, load_checkpoint, unwrap
from lambdanet.engine.distributed import all_reduce_sum
from lambdanet.engine.logger import plot_history, read_history, write_json
from lambdanet.engine.loop import NonFiniteEvalError
from lambdanet.engine.optim import build_optimizer, lr_at
from lambdanet.engine.state import RunState
from lambdanet.engine.task import Task, run
from lambdanet.files import check_path_given, encode_metadata, read_safetensors, run_metadata
from lambdanet.helpers import check_int, check_positive_int
from lambdanet.models import create_model
from lambdanet.models.hub import download_hub_weights, hub_repo
from lambdanet.models.lm_zoo import saved_lm
from lambdanet.models.lm import LanguageModel
from lambdanet.runtime import autocast_context
from lambdanet.tasks.lm.config import LMConfig
from lambdanet.tasks.lm.data import load_corpus, windows

# the names lambdanet.lm.task had before its configuration moved to config.py, importable here for one release
from dataclasses import dataclass  # noqa: F401
from lambdanet.engine.config import RunConfig, option, shared  # noqa: F401
from lambdanet.models import list_models  # noqa: F401
from lambdanet.tasks.lm.data import DATA_HELP  # noqa: F401

__all__ = [
    "LMConfig",
    "LanguageModelTask",
    "train_lm",
    "evaluate_bits_per_byte",
    "load_lm",
    "sample",
    "LM_PANELS",
    "next_byte_loss",
]

LM_PANELS = (
    ("loss.png", ("train_bits_per_byte", "val_bits_per_byte"), "bits per byte"),
    ("lr.png", ("lr",), "learning rate"),
)


@torch.no_grad()
def evaluate_bits_per_byte(
    model: nn.Module,
    data: Tensor,
    context: int,
    *,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    amp: str = "none",
    ctx=None,
) -> dict:
    """Bits per byte of ``model`` on ``data`` (1-d bytes) cut into consecutive windows of ``context`` predicted
    bytes (each window also reads the byte before it); with ``ctx`` the windows are shared among the ranks
    and the sums reduced. Returns ``{"bits_per_byte", "loss" (nats per byte), "bytes"}`` (NaN losses where
    ``data`` has no byte to predict: fewer than 2)."""
    check_positive_int(context, "context")
    check_positive_int(batch_size, "batch_size")
    device = torch.device(device)
    model.eval()
    n = data.numel() - 1  # predicted bytes
    starts = torch.arange(0, max(n, 0), context)
    if ctx is not None and ctx.enabled:
        starts = starts[ctx.rank :: ctx.world]
    count: float  # an int, a float after the reduction
    total, count = 0.0, 0
    for i in range(0, starts.numel(), batch_size):
        s = starts[i : i + batch_size]
        full = s[s + context <= n]  # whole windows in one batch, a short last window alone
        for group in (full, s[s + context > n]):
            if group.numel():
                length = min(context, n - int(group[0]))
                seq = windows(data, group, length + 1).to(device)  # b (length + 1)
                with autocast_context(device, amp):
                    logits = model(seq[:, :-1])  # b length vocab
                total += float(F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten(), reduction="sum"))
                count += seq[:, 1:].numel()
    if ctx is not None:
        total, count = all_reduce_sum([total, count], ctx)
    loss = total / count if count else math.nan  # nothing predicted is no score, not a perfect one
    return {"bits_per_byte": loss / math.log(2), "loss": loss, "bytes": int(count)}


def next_byte_loss(model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, float]]:
    """The training step's loss of a language model on ``batch [b, n + 1]`` (tokens on the model's device): the
    mean next-token cross-entropy of ``model(batch[:, :-1])`` against ``batch[:, 1:]``, and the amounts the engine
    sums over an epoch (``loss``: nats summed over the predicted tokens, ``bytes``: their count)."""
    logits = model(batch[:, :-1])  # b n vocab
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    n = batch[:, 1:].numel()
    return loss, {"loss": float(loss.detach()) * n, "bytes": n}


class LanguageModelTask(Task):
    """Next-byte prediction (:class:`LMConfig`; see the module docstring)."""

    cfg: LMConfig  # the engine's configuration is this task's
    diverged_hint = "Lower --lr, raise --warmup-steps or keep --grad-clip."
    command = "lm train"

    def build_state(self) -> RunState:
        cfg, ctx = self.cfg, self.ctx
        if cfg.batch_size % ctx.world:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {ctx.world} processes")
        self.corpus = corpus = load_corpus(cfg.data)
        if corpus.max_byte >= cfg.vocab_size:
            raise ValueError(
                f"data {cfg.data} has byte values up to {corpus.max_byte} but vocab_size is "
                f"{cfg.vocab_size}; use --vocab-size 256"
            )
        if corpus.train.numel() <= cfg.context + 1:
            raise ValueError(
                f"data {cfg.data} has {corpus.train.numel()} training bytes, fewer than context + 2 = "
                f"{cfg.context + 2}; lower --context"
            )
        model = cast(LanguageModel, create_model(cfg.model, vocab_size=cfg.vocab_size, **cfg.model_kwargs))
        model = model.to(ctx.device)
        if model.max_len is not None and cfg.context > model.max_len:
            raise ValueError(f"context={cfg.context} is longer than the model's max_len={model.max_len}")
        self.steps_per_epoch = cfg.steps_per_epoch
        total = cfg.epochs * cfg.steps_per_epoch
        peak, floor = cfg.effective_lr(), cfg.min_lr / cfg.lr  # min_lr at lr's scale: --lr-batch-scale scales both
        self.lr = lambda step: peak * lr_at(step, total, cfg.warmup_steps, min_factor=floor)
        return RunState(
            model, build_optimizer(model, cfg), scaler=torch.amp.GradScaler("cuda") if cfg.amp == "fp16" else None
        )

    def batches(self, state: RunState):
        """The epoch's windows from the first step not yet trained; this rank's share of each global batch."""
        cfg, ctx = self.cfg, self.ctx
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.epoch)
        high = self.corpus.train.numel() - cfg.context - 1
        starts = torch.randint(0, high + 1, (cfg.steps_per_epoch, cfg.batch_size), generator=g)
        done = int((state.epoch_partial or {}).get("batches", 0))
        for row in starts[done:]:
            yield windows(self.corpus.train, row[ctx.rank :: ctx.world], cfg.context + 1)

    def step_loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict]:
        return next_byte_loss(model, batch.to(self.ctx.device, non_blocking=True))

    def _evaluate(self, model: nn.Module, limit: int | None) -> dict:
        val = self.corpus.val if limit is None else self.corpus.val[:limit]
        return evaluate_bits_per_byte(
            unwrap(model),
            val,
            self.cfg.context,
            batch_size=self.cfg.eval_batch_size,
            device=self.ctx.device,
            amp=self.cfg.amp,
            ctx=self.ctx,
        )

    def epoch_row(self, state: RunState, model: nn.Module, result: dict) -> dict:
        sums = result["sums"]
        seen = max(sums.get("bytes", 0), 1)
        state.samples_seen += int(sums.get("bytes", 0))
        res = self._evaluate(model, self.cfg.eval_bytes)
        if res["bytes"] and not math.isfinite(res["loss"]):  # (NaN for no byte predicted: no score, no divergence)
            raise NonFiniteEvalError(state.epoch - 1, "validation loss", res["loss"])
        row = {
            "lr": state.optimizer.param_groups[0]["lr"],
            "train_loss": sums.get("loss", 0.0) / seen,
            "train_bits_per_byte": sums.get("loss", 0.0) / seen / math.log(2),
            "val_bits_per_byte": res["bits_per_byte"],
            "bytes_per_s": seen / max(result["seconds"], 1e-9),
        }
        state.record(-row["val_bits_per_byte"], val_bits_per_byte=row["val_bits_per_byte"])  # fewer bits is better
        return row

    def epoch_line(self, row: dict) -> str:
        return (
            f"epoch {row['epoch']}/{self.cfg.epochs}: train {row['train_bits_per_byte']:.3f} bits/byte, val "
            f"{row['val_bits_per_byte']:.3f} bits/byte, {row['bytes_per_s']:.0f} bytes/s"
        )

    def describe(self, state: RunState) -> str:
        cfg, c = self.cfg, self.corpus
        self.params = sum(p.numel() for p in state.model.parameters())
        files = f"{c.files[0]} / {c.files[1]} files" if c.files[1] else f"{c.files[0]} file(s), the last bytes validate"
        return (
            f"{cfg.model} ({self.params / 1e6:.2f}M params, {cfg.model_kwargs}) on {cfg.data}: "
            f"{c.train.numel() / 1e6:.2f} MB train / {c.val.numel() / 1e6:.2f} MB validation ({files}), "
            f"context {cfg.context}, recipe {cfg.recipe}, {cfg.epochs} x "
            f"{cfg.steps_per_epoch} steps of {self.ctx.shared(cfg.batch_size)} sequences"
        )

    def finish(self, state: RunState, row: dict, stopped: bool) -> dict:
        """The whole validation split evaluated; on the main process the weights, plots and ``summary.json``."""
        cfg = self.cfg
        res = self._evaluate(state.model, None)
        history = read_history(self.out / "metrics.csv") if self.ctx.is_main else []
        summary = {
            "model": cfg.model,
            "model_kwargs": dict(cfg.model_kwargs),
            "vocab_size": cfg.vocab_size,
            "data": cfg.data,
            "context": cfg.context,
            "recipe": cfg.recipe,
            "params": self.params,
            "epochs": state.epoch,
            "steps": state.step,
            "val_bits_per_byte": res["bits_per_byte"],
            "val_loss": res["loss"],
            "val_bytes": res["bytes"],
            "best_epoch_val_bits_per_byte": state.best.get("val_bits_per_byte"),
            "train_bytes_seen": state.samples_seen,
            "train_time_s": state.train_time_s,
            "bytes_per_s": state.samples_seen / max(state.train_time_s, 1e-9),
            "processes": self.ctx.world,
        }
        if self.ctx.is_main:
            meta = encode_metadata(
                model=cfg.model,
                model_kwargs=dict(cfg.model_kwargs),
                vocab_size=cfg.vocab_size,
                data=cfg.data,
                context=cfg.context,
            )
            export_safetensors(state.model, self.out / "model.safetensors", meta)
            summary["plots"] = [p.name for p in plot_history(history, self.out, LM_PANELS)]
            write_json(summary, self.out / "summary.json")
        self.log(
            f"done: validation {res['bits_per_byte']:.3f} bits per byte on {res['bytes']} bytes, "
            f"{state.train_time_s:.1f}s training, {summary['bytes_per_s']:.0f} bytes/s -> {self.out}"
        )
        return summary


def train_lm(cfg: LMConfig, log: Callable[[str], None] = print) -> dict:
    """Train a language model on the resolved configuration ``cfg`` (:meth:`LMConfig.resolve`) with the engine;
    returns the summary (also ``<out>/summary.json``)."""
    return run(LanguageModelTask, cfg, log)


def load_lm(path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """A trained language model from a run directory (its ``model.safetensors``, else ``last.pt``), either file, or
    ``"hf-hub:owner/name"`` (a run shared with :func:`lambdanet.hub.push_to_hub`, downloaded once into
    huggingface_hub's cache), in eval mode, with ``lm_cfg`` (model, model_kwargs, vocab_size, data, context)."""
    check_path_given(path, "the checkpoint path", "pass a run directory of lambdanet lm train, a file in it or "
                     "hf-hub:OWNER/NAME")  # not the working folder  # fmt: skip
    repo = hub_repo(path)
    name = str(path)
    if repo is not None:
        path = download_hub_weights(repo)[0]  # a one-line error when it cannot be had or is not lambdanet's
    path = Path(path).expanduser()
    weights = path / "model.safetensors" if path.is_dir() else path
    if path.is_dir() and not weights.is_file():
        weights = path / "last.pt"
    if not weights.is_file():
        raise ValueError(f"checkpoint {path}: no model.safetensors or last.pt there")
    if weights.suffix == ".safetensors":
        meta = run_metadata(weights)
        if not meta or "vocab_size" not in meta:
            raise CheckpointError(f"{name if repo else weights} is not a language model written by lambdanet lm train")
        state = read_safetensors(weights)[0]
    else:
        ckpt = load_checkpoint(weights)
        saved = ckpt.get("config") or {}
        if "vocab_size" not in saved:
            raise CheckpointError(f"{weights} is not a checkpoint of lambdanet lm train")
        meta = {k: saved[k] for k in ("model", "model_kwargs", "vocab_size", "data", "context")}
        state = ckpt["model"]
    meta["model"], meta["model_kwargs"] = saved_lm(meta["model"], meta["model_kwargs"])  # as written then
    model = create_model(meta["model"], vocab_size=meta["vocab_size"], **meta["model_kwargs"])
    model.load_state_dict(state)
    model.lm_cfg = meta  # type: ignore[assignment]  # torch types Module.__setattr__ as Tensor | Module only
    return model.to(device).eval()


def sample(
    path: str | Path,
    prompt: str | bytes,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    cuda_graph: bool = False,
) -> bytes:
    """Continue ``prompt`` (text is UTF-8 encoded) with the language model of a run (``path``: as :func:`load_lm`
    takes it, ``"hf-hub:owner/name"`` included): the prompt's bytes and the
    ``max_new_tokens`` sampled after them (``cuda_graph``: each step replayed from a CUDA graph, for the
    constant-state families on CUDA; :meth:`~lambdanet.models.lm.LanguageModel.generate`)."""
    check_int(seed, "seed", 0, 2**32 - 1, note=" below 2**32")  # as lm train's
    model = cast(LanguageModel, load_lm(path, device))  # a language model: load_lm builds only those
    data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
    if not data:
        raise ValueError("prompt must hold at least one byte")
    if max(data) >= model.vocab_size:
        raise ValueError(
            f"the prompt has byte values up to {max(data)} but the model's vocab_size is {model.vocab_size}"
        )
    tokens = torch.tensor([list(data)], dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(tokens, max_new_tokens, temperature=temperature, top_k=top_k, generator=g,
                         cuda_graph=cuda_graph, token_limit=min(model.vocab_size, 256))  # bytes only  # fmt: skip
    return bytes(out[0].tolist())
