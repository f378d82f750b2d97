"""One device to many: process-group setup from ``torchrun``'s environment, reductions, SyncBatchNorm.

``lambdanet train`` run under ``torchrun --nproc_per_node N`` (or a multi-node ``torchrun``) picks up ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK``, joins a process group (NCCL on GPUs, gloo on CPUs), shards the data and wraps
the model in ``DistributedDataParallel``; only rank 0 writes files. PyTorch's ``nn.SyncBatchNorm`` runs on GPUs
only; :class:`AllReduceBatchNorm` does the same on any device with a differentiable all-gather of the per-channel
statistics, so ``--sync-bn`` also works on CPU clusters (and makes a multi-process run compute what one process
computes on the whole batch)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "DistContext",
    "init_distributed",
    "all_reduce_sum",
    "all_gather_objects",
    "all_gather_with_grad",
    "AllReduceBatchNorm",
    "convert_sync_batchnorm",
    "barrier",
    "cleanup",
    "check_cuda",
    "uses_cuda",
    "usable_cores",
    "threads_per_process",
    "in_process_group",
    "launch_local",
    "all_threads_on_main",
    "data_parallel",
]


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shared(self, batch: int) -> str:
        """How a global ``batch`` is split, in words: ``"32"``, or ``"32 (16 per process x 2)"``."""
        return f"{batch}" + (f" ({batch // self.world} per process x {self.world})" if self.enabled else "")


def data_parallel(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` when ``ctx`` spans processes (each trains on its share of
    every batch, the gradients averaged over them), else ``model`` itself: the one place every task wraps."""
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids) if ctx.enabled else model


def init_distributed(device: str = "auto") -> DistContext:
    """Join the process group described by torchrun's environment variables (a no-op without them)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = uses_cuda(device)
    check_cuda(device)
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # one timeout for both backends, gloo's (30 min; NCCL's own is 10): the other processes wait in a collective
        # while the main one alone evaluates or writes the outputs, which NCCL's watchdog ended after 10 minutes,
        # killing the group before the epoch was saved
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=dist.default_pg_timeout)  # fmt: skip
    return DistContext(rank, world, local_rank, dev)


def check_cuda(device: str) -> None:
    """The ``device`` option ``"cuda"`` on a machine without a usable CUDA device: a one-line ``ValueError``."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use --device cpu")


def uses_cuda(device: str) -> bool:
    """Whether the ``device`` option (``"auto"``, ``"cpu"`` or ``"cuda"``) runs on CUDA."""
    return torch.cuda.is_available() if device == "auto" else device == "cuda"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(nprocs: int) -> int:
    """The intra-op threads each of ``nprocs`` local processes gets: the usable cores shared out."""
    return max(1, usable_cores() // nprocs)


def in_process_group() -> bool:
    """Whether this process was started as one of a group (torchrun's or :func:`launch_local`'s variables)."""
    return "WORLD_SIZE" in os.environ


def launch_local(
    fn: Callable[..., object],
    args: tuple,
    nprocs: int,
    relay: tuple[type[Exception], ...] = (),
    stopped: Callable[[str], Exception] = ValueError,
) -> None:
    """Run ``fn(*args)`` in ``nprocs`` new processes on this machine, joined as one process group: each gets
    torchrun's environment variables (so :func:`init_distributed` picks them up) and ``usable_cores() // nprocs``
    threads. A ``ValueError`` (a user error) in a worker is raised here as the same one-line error, and so is an
    exception of a ``relay`` type (constructed from its message), with its own type; a SIGTERM / SIGINT that ends a
    worker before it can save is ``stopped("stopped by SIGTERM ...")`` (the caller's
    :class:`~lambdanet.engine.preempt.Preempted`: the signal's exit status). On a CPU, data parallelism
    over processes uses the cores better than one process's intra-op threads when the operations are small
    (small heads, RoI ops, lambda layers on small maps)."""
    import torch.multiprocessing as mp

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
    }
    context = mp.start_processes(
        _local_worker,
        args=(fn, args, env, threads_per_process(nprocs)),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    forwarded: list[int] = []
    try:
        with _forwarded_signals(context.processes, forwarded):  # SIGTERM / SIGINT to this process reach the workers
            while not context.join():
                pass
    except mp.ProcessExitedException as err:
        if forwarded:  # a worker ended by the signal before it could catch it (starting up, say): one line
            raise stopped(
                f"stopped by {signal.Signals(forwarded[0]).name} before the worker processes could "
                f"save anything ({err}); run the command again (with --resume if a run was saved)"
            ) from None
        raise
    except mp.ProcessRaisedException as err:
        last = str(err).strip().splitlines()[-1]  # the worker's traceback ends "module.Type: message"
        kinds: tuple[type[Exception], ...] = (ValueError, *relay)
        for kind in kinds:
            name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
            if last.startswith(f"{name}: "):
                raise kind(last.removeprefix(f"{name}: ")) from None
        raise


@contextmanager
def _forwarded_signals(processes, forwarded: list[int]):
    """While inside (main thread only), SIGTERM and SIGINT sent to this process are appended to ``forwarded``
    and passed on to ``processes`` (which stop on them: :mod:`lambdanet.engine.preempt`) instead of ending it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        forwarded.append(signum)
        for p in processes:
            if p.is_alive():
                with suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _local_worker(rank: int, fn: Callable[..., object], args: tuple, env: dict[str, str], threads: int) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        fn(*args)
    except (ValueError, FileNotFoundError) as err:  # user errors (subclasses too): relayed as a plain ValueError
        raise ValueError(str(err)) from None


@contextmanager
def all_threads_on_main(ctx: DistContext):
    """While the main process works alone on a CPU (evaluation, outputs) and the others wait at a barrier or
    have finished, let it use every usable core; its own share again afterwards."""
    threads = torch.get_num_threads()
    if ctx.enabled and ctx.is_main and ctx.device.type == "cpu":
        torch.set_num_threads(max(threads, usable_cores()))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum a few scalars over the ranks."""
    if not ctx.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_objects(obj: object, ctx: DistContext) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects; ``[obj]`` in one process)."""
    if not ctx.enabled:
        return [obj]
    gathered: list = [None] * ctx.world
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        _barrier(ctx)


def _barrier(ctx: DistContext) -> None:
    """``dist.barrier`` on this process's GPU under NCCL (named: else torch picks the current device, with a
    warning on rank 0), on the CPU under gloo."""
    index = ctx.device.index
    dist.barrier(device_ids=[index] if ctx.device.type == "cuda" and index is not None else None)


def cleanup(ctx: DistContext, synchronize: bool = False) -> None:
    """Leave the process group. ``synchronize=True`` (a normal end) first waits at a barrier, so that no rank
    tears its connections down while a peer still has a message in flight to it (gloo aborts the peer's
    process then); after an error there is no barrier, since the other ranks may never reach it."""
    if ctx.enabled and dist.is_initialized():
        if synchronize:
            _barrier(ctx)
        dist.destroy_process_group()


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather of a 1-d tensor: ``[d] -> [world, d]``. Backward: this rank's slice of the
    gradient summed over all ranks (every rank holds the gathered tensor, so every rank's loss depends on every
    slice), done as one all-reduce, which every backend supports."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)  # world d

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        # a copy: autograd may hand the same gradient tensor to other branches, which must not see the sum
        total = grad.clone(memory_format=torch.contiguous_format)  # world d
        dist.all_reduce(total)
        return total[dist.get_rank()]  # d


def all_gather_with_grad(x: Tensor) -> Tensor:
    """``[d]`` on each rank -> ``[world, d]`` on every rank, with gradients flowing back to each rank's ``x``."""
    return _AllGather.apply(x)


class AllReduceBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation with statistics over the whole distributed batch, on any device. Training: each
    process's per-channel count, mean and sum of squared deviations are gathered (differentiably) and combined with
    Chan et al.'s parallel formulas (stable, unlike ``E[x^2] - E[x]^2``), so the normalisation and its gradient
    equal those of one process holding the whole batch. Evaluation uses the running statistics like
    ``nn.BatchNorm``. Accepts ``[N, C, *]`` inputs of any rank."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of rank >= 2 [N, C, ...], got shape {tuple(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        c = x.shape[1]
        shape = [1, c] + [1] * (x.dim() - 2)
        xf = x.float()
        local_mean = xf.mean(dims)  # c
        # d/dmean of sum((x - mean)^2) is exactly 0; detaching keeps its float residue (amplified by
        # (var + eps)^-3/2 in near-constant channels) out of the gradient, as BatchNorm's own backward does
        local_m2 = (xf - local_mean.detach().view(shape)).square().sum(dims)  # c: sum of squared deviations
        count = torch.full((1,), xf.numel() / c, device=x.device, dtype=torch.float32)
        gathered = all_gather_with_grad(torch.cat([local_mean, local_m2, count]))  # world (2c + 1)
        means, m2s, counts = gathered[:, :c], gathered[:, c : 2 * c], gathered[:, 2 * c :]
        n = counts.sum()
        mean = (counts * means).sum(0) / n  # Chan et al.'s parallel mean and variance: no cancellation
        var = (m2s + counts * (means - mean.detach()).square()).sum(0) / n
        if self.track_running_stats:
            with torch.no_grad():
                # the buffers exist with track_running_stats (torch types them Tensor | None)
                tracked = cast(Tensor, self.num_batches_tracked)
                tracked += 1
                self.num_batches_tracked = tracked
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                cast(Tensor, self.running_mean).mul_(1 - m).add_(mean.detach(), alpha=m)
                cast(Tensor, self.running_var).mul_(1 - m).add_(var.detach() * n / (n - 1).clamp_min(1), alpha=m)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm synchronised across processes: ``nn.SyncBatchNorm`` on CUDA, else
    :class:`AllReduceBatchNorm` (state dicts are interchangeable with plain BatchNorm)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert(model)


def _convert(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, AllReduceBatchNorm):
        out = AllReduceBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:  # the same Parameter objects, as torch's conversion keeps them: frozen stays frozen
            out.weight, out.bias = module.weight, module.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(out, name, getattr(module, name))
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert(child))
    return out
