"""Measurement primitives: time, peak memory and FLOPs of a callable, on CPU or CUDA.

* Time: warm-up calls, then repeated timed calls; median and inter-quartile range. On CUDA each call
  is timed with a pair of CUDA events recorded on the current stream around it, after a synchronisation
  so that no earlier work is counted; on CPU with ``time.perf_counter``.
* Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
  On CPU PyTorch keeps no allocator statistics, so :class:`PeakMemory` tracks every tensor storage the
  call creates (through a dispatch mode) and when it is freed (through a weak reference on the storage,
  which fires exactly when the storage is deallocated): the peak of the live bytes. Tensors that existed
  before the call (parameters, inputs) are not counted; workspace inside a kernel is not visible.
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (a multiply-add counts as 2 FLOPs).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["PeakMemory", "Timing", "time_fn", "timed_call", "peak_memory", "count_flops", "sync"]


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created while active (CPU or any device without allocator stats)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._sizes:
                continue
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds one call of ``fn()`` takes: CUDA events around it on CUDA, wall time elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class Timing:
    median_s: float
    q1_s: float
    q3_s: float
    repeats: int

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s


def time_fn(fn: Callable[[], object], device: torch.device | str = "cpu", *, warmup: int = 2,
            repeats: int = 7, max_seconds: float | None = None) -> Timing:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls (fewer repeats, at least 3,
    when ``max_seconds`` would be exceeded)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    for i in range(repeats):
        times.append(timed_call(fn, device))
        if max_seconds is not None and i >= 2 and time.perf_counter() - start > max_seconds:
            break
    qs = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return Timing(statistics.median(times), qs[0], qs[2], len(times))


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated by ``fn()`` beyond what existed before (see module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with PeakMemory() as tracker:
        fn()
    return tracker.peak


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of ``fn()`` counted by ``torch.utils.flop_counter`` (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
