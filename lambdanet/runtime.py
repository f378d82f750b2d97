"""How a computation runs on a device and what it costs: autocast precision, time, peak memory and FLOPs.

Below ``models``, ``train`` and ``bench``, which all use it; it imports only torch and the standard library.

* Precision: ``amp`` is ``"none"``, ``"bf16"`` or ``"fp16"`` (:data:`AMP_DTYPES`); :func:`check_amp` is the
  one place that validates it (fp16 autocast is a CUDA setting), :func:`autocast_context` the one place
  that turns it into ``torch.autocast``.
* Time: warm-up calls, then repeated timed calls; median and inter-quartile range. Several callables are
  timed round-robin (one call of each per round, the order rotating) so that a machine whose speed drifts
  affects them alike. On CUDA each call is timed with a pair of CUDA events recorded on the current stream
  around it, after a synchronisation so that no earlier work is counted; on CPU with ``time.perf_counter``.
* Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
  On CPU PyTorch keeps no allocator statistics, so :class:`PeakMemory` tracks every tensor storage the
  call creates (through a dispatch mode) and when it is freed (through a weak reference on the storage,
  which fires exactly when the storage is deallocated): the peak of the live bytes. Tensors that existed
  before the call (parameters, inputs) are not counted; workspace inside a kernel is not visible.
* FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (a multiply-add counts as 2 FLOPs).
* Threads: :func:`intra_op_threads` runs a block with a chosen number of CPU threads (``--threads``): on a busy
  machine fewer threads than cores can be several times faster, as each step waits for its slowest thread."""

from __future__ import annotations

import random

import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from lambdanet.helpers import check_int

__all__ = [
    "AMP_DTYPES",
    "check_amp",
    "check_device",
    "autocast_context",
    "intra_op_threads",
    "PeakMemory",
    "Timing",
    "sync",
    "timed_call",
    "time_fn",
    "time_round_robin",
    "peak_memory",
    "count_flops",
]

# ----------------------------------------------------------------------------------------------- precision
AMP_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_device(device: str, name: str = "--device") -> None:
    """A ``ValueError`` for ``--device cuda`` on a machine without a usable CUDA device (before anything is
    loaded, instead of torch's traceback at the first tensor moved there)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} cuda but no CUDA device is available; use {name} cpu")


def check_amp(amp: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` unless ``amp`` is one of :data:`AMP_DTYPES` and usable on ``device``."""
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {list(AMP_DTYPES)}, got {amp!r}")
    device_type = torch.device(device).type
    if amp == "fp16" and device_type != "cuda":
        raise ValueError(f"amp='fp16' needs device='cuda', got device={device_type!r}; use amp='bf16' on CPU")


def autocast_context(device: torch.device | str, amp: str) -> AbstractContextManager:
    """``torch.autocast`` to ``AMP_DTYPES[amp]`` on ``device``'s type, or a no-op for ``amp="none"``."""
    check_amp(amp, device)
    dtype = AMP_DTYPES[amp]
    return nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


# ------------------------------------------------------------------------------------------------- threads
@contextmanager
def intra_op_threads(threads: int | None, name: str = "threads") -> Iterator[None]:
    """Inside, ``torch.set_num_threads(threads)`` (``None``: the count as it is); the previous count again on
    leaving. A one-line ``ValueError`` naming ``name`` unless ``threads`` is a positive int or ``None``."""
    if threads is None:
        yield
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name} must be a positive int (CPU threads), got {threads!r}")
    if threads >= 2**31:  # torch takes a C int (beyond it: "Overflow when unpacking long", naming nothing)
        raise ValueError(f"{name} must be a positive int below 2**31 (CPU threads), got {threads!r}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -------------------------------------------------------------------------------------------------- memory
class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created while active (CPU or any device without allocator stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the storages the call reads: an output on one of them (a view, an in-place result) allocated nothing,
        # and one that is not tracked already existed before the mode (an input, a parameter): not counted
        given = {_storage_key(t) for t in tree_flatten((args, kwargs))[0]}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._sizes or key in given:
                continue
            self._sizes[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def _storage_key(t) -> int | None:
    """The address of a tensor's storage (how :class:`PeakMemory` knows a storage), ``None`` for anything else (a
    meta or sparse tensor has none)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


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


# ---------------------------------------------------------------------------------------------------- time
def sync(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
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
    """Median and quartiles of ``repeats`` timed calls, in seconds."""

    median_s: float
    q1_s: float
    q3_s: float
    repeats: int

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        qs = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
        return cls(statistics.median(times), qs[0], qs[2], len(times))


def time_round_robin(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 7,
    max_seconds: float | None = None,
) -> dict[str, Timing]:
    """:class:`Timing` of each callable over ``repeats`` rounds after ``warmup`` calls of each. Each round calls
    every callable once, the first round in the given order and every later one in a seeded shuffle of it, so
    that slow drifts of the machine's speed fall on all of them alike and none always follows the same one (a
    callable run right after one that sweeps the caches, round after round, measured up to 15% slow). Fewer
    rounds (at least 3) are run when ``max_seconds`` would be exceeded."""
    check_int(repeats, "repeats")  # a median of no rounds: statistics' StatisticsError
    check_int(warmup, "warmup", low=0)
    names = list(fns)
    if not names:
        return {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    order, shuffle = list(names), random.Random(0).shuffle
    for i in range(repeats):
        for name in order:
            times[name].append(timed_call(fns[name], device))
        shuffle(order)
        if max_seconds is not None and i >= 2 and time.perf_counter() - start > max_seconds:
            break
    return {name: Timing.of(times[name]) for name in names}


def time_fn(
    fn: Callable[[], object],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 7,
    max_seconds: float | None = None,
) -> Timing:
    """:func:`time_round_robin` of the single callable ``fn``."""
    return time_round_robin({"fn": fn}, device, warmup=warmup, repeats=repeats, max_seconds=max_seconds)["fn"]


# --------------------------------------------------------------------------------------------------- FLOPs
def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of ``fn()`` counted by ``torch.utils.flop_counter`` (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
