"""How ``LambdaLayer(impl="auto")`` picks its position implementation: the measuring tuner on top of the static
cost model (:class:`~lambdanet.ops.position_lambda.policy.ImplPolicy`, one per device type).

**Measured** (the default, as cuDNN's benchmark mode or Triton's autotuner): the first forward call of a key
(batch and spatial size, compute dtype, device and its threads, torch version, the layer's shape, whether the
call records autograd, train or eval) times the eligible implementations on that call's own queries and values
and keeps the fastest; every later call of the key runs it. Only the position step is timed, forward and, when
the call records autograd, its backward through ``torch.autograd.grad`` (no parameter gradient is written, no
BatchNorm statistic or random number is touched; the eval cache of ``E`` is restored). Candidates that the cost
model puts beyond :data:`PRUNE_FACTOR` times the cheapest are not run; the others get one warm-up call each,
then up to :data:`REPEATS` round-robin rounds while the calls stay within :data:`BUDGET_S`, and the static pick
is kept unless another takes under :data:`SWITCH_MARGIN` of its median time.

**Static** (``set_impl_tuning("static")``, environment ``LAMBDANET_AUTOTUNE=0``, or
``torch.use_deterministic_algorithms(True)``): the :class:`ImplPolicy` cost model alone, deterministic.
Where nothing can be timed (``torch.compile``, ``torch.export``, ``torch.jit`` and FX tracing, functorch
transforms, a Python dispatch mode such as a FLOP counter, fake or meta tensors, inside a backward pass) a
winner already measured for the key is used, else the static pick.

Winners live in the process; ``set_impl_cache_file(path)`` (or ``LAMBDANET_AUTOTUNE_CACHE=path``, ``=1`` for
``~/.cache/lambdanet/impl_tuning.json``) also keeps them on disk across processes; an unreadable file is
ignored with a warning and rewritten.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lambdanet.helpers import check_choice, compute_dtype
from lambdanet.ops.position_lambda import fast as LF
from lambdanet.ops.position_lambda.cache import CACHE_VERSION, read_winners, write_winners
from lambdanet.ops.position_lambda.cache import DEFAULT_CACHE_FILE as DEFAULT_CACHE_FILE  # re-exported: its old home
from lambdanet.ops.position_lambda.cache import ENV_CACHE as ENV_CACHE
from lambdanet.ops.position_lambda.cache import env_cache_file as _env_cache_file
from lambdanet.ops.position_lambda.guard import timing_allowed
from lambdanet.ops.position_lambda.guard import tracing as _tracing
from lambdanet.ops.position_lambda.policy import ImplPolicy, impl_policy

__all__ = [
    "TUNING_MODES",
    "set_impl_tuning",
    "impl_tuning_mode",
    "set_impl_cache_file",
    "impl_cache_file",
    "clear_impl_cache",
    "tuned_impls",
    "set_impl_timer",
    "isolated_tuning",
    "can_measure",
    "tuned_plan",
    "auto_choice",
]


# ------------------------------------------------------------------------------------------ the measuring tuner
TUNING_MODES = ("measure", "static")
ENV_MODE = "LAMBDANET_AUTOTUNE"  # 0 / off / false / no / static: the static policy; else measured
PRUNE_FACTOR = 4.0  # candidates the cost model puts beyond this many times the cheapest are not run
BUDGET_S = 2.0  # seconds of calls per key (warm-ups included) after which no further round starts
REPEATS = 3  # timed rounds at most (one call of every candidate each; the median is kept)
DROP_FACTOR = 3.0  # a candidate this many times slower than a round's fastest leaves the later rounds
SWITCH_MARGIN = 0.95  # another implementation replaces the static pick only below this fraction of its time
_CANDIDATES = ("einsum_qe", "einsum", "conv", "depthwise_conv")

Timer = Callable[[str, Callable[[], None]], float]
"""``timer(impl, run) -> seconds``: one call of candidate ``impl``'s ``run`` and the time it took (tests inject
a fake clock through :func:`set_impl_timer`)."""


def time_call(impl: str, run: Callable[[], None]) -> float:
    """The default :data:`Timer`: wall-clock seconds of one ``run()`` (which synchronises a CUDA device)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _env_mode() -> str:
    value = os.environ.get(ENV_MODE, "").strip().lower()
    return "static" if value in ("0", "off", "false", "no", "static") else "measure"


_GENERATIONS = itertools.count()  # one number per state of the winners, unique in the process
_MEMOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> {call key: (policy, resolved plan)}


@dataclass
class _Tuner:
    """The process's tuning state: mode, winners by key, the optional cache file, the timer, and the generation
    of the winners (a fresh number whenever they may have changed: what the layers' memos of their resolved plans
    are valid for, :func:`tuned_plan`)."""

    mode: str = field(default_factory=_env_mode)
    winners: dict[str, str] = field(default_factory=dict)
    file: Path | None = field(default_factory=_env_cache_file)
    file_read: bool = False
    timer: Timer = time_call
    generation: int = field(default_factory=lambda: next(_GENERATIONS))

    def changed(self) -> None:
        """The winners may have changed: every memo of a resolved plan is stale."""
        self.generation = next(_GENERATIONS)


_TUNER = _Tuner()


def set_impl_tuning(mode: str | None) -> str:
    """``"measure"`` (time the candidates once per key) or ``"static"`` (the :class:`ImplPolicy` cost model only,
    deterministic); ``None``: back to the environment's choice (``LAMBDANET_AUTOTUNE=0``: static). Returns the
    mode before."""
    if mode is not None:
        check_choice(mode, "mode", TUNING_MODES)
    previous, _TUNER.mode = _TUNER.mode, _env_mode() if mode is None else mode
    return previous


def impl_tuning_mode() -> str:
    """The tuning mode now: ``"measure"`` or ``"static"``."""
    return _TUNER.mode


def set_impl_cache_file(path: str | os.PathLike | None) -> Path | None:
    """Keep measured winners in ``path`` (JSON; read on first use, written after every new winner) too, or only
    in the process (``None``). Returns the file before."""
    previous, _TUNER.file, _TUNER.file_read = _TUNER.file, None if path is None else Path(path).expanduser(), False
    _TUNER.changed()
    return previous


def impl_cache_file() -> Path | None:
    """The file measured winners are kept in, or ``None``."""
    return _TUNER.file


def clear_impl_cache() -> None:
    """Forget the winners measured in this process (the cache file is left alone and read again)."""
    _TUNER.winners.clear()
    _TUNER.file_read = False
    _TUNER.changed()


def tuned_impls() -> dict[str, str]:
    """A copy of the winners known to this process: ``{key: impl}``."""
    return dict(_TUNER.winners)


def set_impl_timer(timer: Timer | None) -> Timer:
    """Replace the function that times a candidate (``None``: :func:`time_call`); returns the one before.
    Tests inject a fake clock through it."""
    previous, _TUNER.timer = _TUNER.timer, time_call if timer is None else timer
    return previous


@contextlib.contextmanager
def isolated_tuning(mode: str = "measure", timer: Timer | None = None, cache_file=None) -> Iterator[None]:
    """A fresh tuner for a block (no winners, ``mode``, ``timer``, ``cache_file``); the process's is restored
    afterwards. What a benchmark or a test measures is then its own."""
    global _TUNER
    check_choice(mode, "mode", TUNING_MODES)
    saved = _TUNER
    _TUNER = _Tuner(mode=mode, file=None if cache_file is None else Path(cache_file).expanduser())
    _TUNER.timer = time_call if timer is None else timer
    try:
        yield
    finally:
        _TUNER = saved


# ------------------------------------------------------------------------------------------ the cache file
def _read_file() -> None:
    """Merge the cache file's winners into the process's (once per file;
    :mod:`~lambdanet.ops.position_lambda.cache`)."""
    path, _TUNER.file_read = _TUNER.file, True
    if path is None:
        return
    found = read_winners(path, _CANDIDATES, stacklevel=4)
    _TUNER.winners.update({k: v for k, v in found.items() if k not in _TUNER.winners})
    _TUNER.changed()


def _write_file() -> None:
    """Write the process's winners (over the file's, read first) atomically; a failure is a warning."""
    path = _TUNER.file
    if path is None:
        return
    _read_file()  # what other processes added meanwhile
    write_winners(path, _TUNER.winners, stacklevel=4)


# ------------------------------------------------------------------------------------------ when to time
def can_measure(*tensors: Tensor) -> bool:
    """Whether a forward call on ``tensors`` may time candidates now: the mode is ``"measure"`` and
    :func:`~lambdanet.ops.position_lambda.guard.timing_allowed` (nothing traces or compiles it, no functorch
    transform or Python dispatch mode, not inside a backward pass, plain tensors on a real device)."""
    return _TUNER.mode == "measure" and timing_allowed(*tensors)


# ------------------------------------------------------------------------------------------ the layer's side
class TunedLayer(Protocol):
    """What the tuner reads of a :class:`~lambdanet.layers.LambdaLayer`."""

    embedding: Any
    impl: str
    heads: int
    dim_k: int
    dim_v: int
    dim_u: int
    groups: int
    causal: bool
    training: bool

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def choose_impl(self, spatial: Sequence[int], device_type: str | None = None) -> str: ...

    def plan_for(self, impl: str, spatial: tuple[int, ...], policy: ImplPolicy) -> Any: ...

    def _whole_embeddings_fit(self, n: int, policy: ImplPolicy) -> bool: ...

    def _relative_scope(self) -> tuple[Sequence[int], Sequence[int]] | None: ...

    def _position(self, plan: Any, q: Tensor, vals: Tensor, spatial: tuple[int, ...]) -> tuple[Any, Any]: ...

    def _measured_winners(self, layer_id: int, dtype, device, inputs_grad: bool) -> tuple[tuple[Any, str], ...]: ...


def candidate_plans(layer: TunedLayer, spatial: tuple[int, ...], policy: ImplPolicy, static: str) -> dict[str, Any]:
    """The implementations worth timing for ``spatial``, ``{impl: plan}``, cheapest by multiply-adds first: those
    the layer can run (the lambdas-first einsum only where the policy lets ``E`` be materialised, the dense
    convolution up to ``policy.dense_conv_taps`` taps) within :data:`PRUNE_FACTOR` times the cheapest, and the
    ``static`` pick."""
    n, scope = math.prod(spatial), layer._relative_scope()
    relative = scope is not None
    taps = math.prod(LF.cropped_kernel_size(*scope, spatial)) if scope is not None else n
    plans: dict[str, Any] = {}
    for impl in _CANDIDATES:
        plan = layer.plan_for(impl, spatial, policy)
        plans.setdefault(plan.impl, plan)  # einsum_qe runs as einsum where queries-first does not apply
    if relative and not layer._whole_embeddings_fit(n, policy):
        plans.pop("einsum", None)  # it would materialise an E that the policy does not allow
    if relative and taps > policy.dense_conv_taps[1]:
        plans.pop("conv", None)  # the dense backward collapses on large kernels
    k, kv = layer.dim_k, layer.dim_k * layer.dim_v * layer.dim_u * layer.groups  # multiply-adds per (n, m) pair
    macs = {"einsum_qe": n * layer.heads * (k + layer.dim_v), "einsum": n * kv}
    cost = {impl: macs.get(impl, taps * kv) for impl in plans}
    cheapest = min(cost.values())
    keep = [i for i in sorted(plans, key=lambda i: cost[i]) if cost[i] <= PRUNE_FACTOR * cheapest or i == static]
    return {impl: plans[impl] for impl in keep}


def _descriptor(device: torch.device) -> str:
    """The hardware a timing holds for: the GPU's name, else the device type, machine and thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}:{torch.get_num_threads()} threads"


def _base_key(layer: TunedLayer, dtype, device, grad: bool) -> str:
    """What a winner depends on besides the input's size: torch, the hardware, the compute dtype, autograd and
    train or eval, the layer's shape. Keys (the JSON file's too): ``"<base>; n<spatial>; <candidates>; b<batch>"``."""
    scope = layer._relative_scope()
    table = "absolute" if scope is None else f"relative {scope[0]} at {scope[1]}"
    shape = f"h{layer.heads} k{layer.dim_k} v{layer.dim_v} u{layer.dim_u} g{layer.groups}"
    parts = [f"v{CACHE_VERSION}", f"torch {torch.__version__}", _descriptor(torch.device(device)), str(dtype)]
    parts += [f"grad {int(grad)} train {int(layer.training)}", shape + (" causal" if layer.causal else ""), table]
    return "; ".join(parts)


def _size_key(spatial: tuple[int, ...], plans: dict[str, Any]) -> str:
    """The input size and the candidates' steps (which the policy picks for that size) of a key."""
    steps = ",".join(sorted(f"{p.position}/{p.qe_chunk_fraction!r}" for p in plans.values()))
    return f"n{'x'.join(map(str, spatial))}; {steps}"


def _plans(layer: TunedLayer, spatial: tuple[int, ...], device) -> dict[str, Any]:
    """The candidates of a call (:func:`candidate_plans` under the device's policy); the cache file is read on
    first use."""
    policy = impl_policy(torch.device(device).type)
    static = layer.plan_for("auto", spatial, policy).impl
    if _TUNER.file is not None and not _TUNER.file_read:
        _read_file()
    return candidate_plans(layer, spatial, policy, static)


def _records_grad(layer: TunedLayer, inputs_grad: bool) -> bool:
    """Whether a call records autograd through the position step: grad mode on and its inputs or the position
    table requiring gradients."""
    params = inputs_grad or any(p.requires_grad for p in layer.embedding.parameters())
    return torch.is_grad_enabled() and params


def measured_winners(layer: TunedLayer, dtype, device, inputs_grad: bool) -> tuple[tuple[tuple[int, ...], str], ...]:
    """What traced, compiled and exported calls run: ``(spatial size, winner)`` for the sizes measured for the
    layer's configuration on which every batch size measured agrees (the batch and spatial sizes may be symbolic
    there, so they are compared by the caller). ``torch.compile`` calls it once while tracing, through the
    layer's ``_measured_winners`` method, and keeps the result as a constant."""
    base = _base_key(layer, dtype, device, _records_grad(layer, inputs_grad))
    found: dict[str, set[str]] = {}
    for key, impl in _TUNER.winners.items():
        if key.startswith(base + "; "):
            found.setdefault(key[len(base) + 2 :].rpartition("; b")[0], set()).add(impl)
    pairs = []
    for size_key, impls in found.items():
        spatial = tuple(int(s) for s in size_key.partition(";")[0][1:].split("x"))
        if len(impls) == 1 and size_key == _size_key(spatial, _plans(layer, spatial, device)):
            pairs.append((spatial, impls.pop()))
    return tuple(pairs)


def tuned_plan(layer: TunedLayer, plan: Any, q: Tensor, vals: Tensor, spatial: tuple[int, ...]) -> Any:
    """The plan an ``impl="auto"`` forward call runs, given the static ``plan`` and the call's queries and values
    (compute dtype): its key's measured winner, measured now if it has none and :func:`can_measure` (traced
    calls: :func:`measured_winners`); the static plan in ``"static"`` mode or with a single candidate."""
    if _TUNER.mode != "measure" or plan.position is None:
        return plan
    inputs_grad = q.requires_grad or vals.requires_grad
    if _tracing():  # compile, export, jit or FX tracing: what eager calls measured, else the static plan
        winner = plan.impl
        for size, impl in layer._measured_winners(id(layer), q.dtype, q.device, inputs_grad):
            if size == spatial:
                winner = impl
        return plan if winner == plan.impl else layer.plan_for(winner, spatial, impl_policy(q.device.type))
    grad = _records_grad(layer, inputs_grad)
    # what the key's winner resolves to, memoised per layer (weakly: nothing is pickled or copied with it): building
    # the key and the candidates is ~0.2 ms of Python, a few percent of a small layer's call; an entry holds for one
    # generation of the winners and the policy object it was resolved under
    policy = impl_policy(q.device.type)
    memo_key = (_TUNER.generation, plan, spatial, q.dtype, q.device, grad, layer.training, q.shape[0],
                torch.get_num_threads())  # fmt: skip
    memo = _MEMOS.setdefault(layer, {})
    known = memo.get(memo_key)
    if known is not None and known[0] is policy:
        return known[1]
    plans = _plans(layer, spatial, q.device)
    if len(plans) < 2 or q.numel() == 0:
        return _remember(memo, memo_key, policy, plan)
    key = f"{_base_key(layer, q.dtype, q.device, grad)}; {_size_key(spatial, plans)}; b{q.shape[0]}"
    winner = _TUNER.winners.get(key)
    if winner is None and can_measure(q, vals):
        winner = _TUNER.winners[key] = _measure(layer, plans, plan.impl, q, vals, spatial, grad)
        _write_file()
        _TUNER.changed()
        memo_key = (_TUNER.generation, *memo_key[1:])
    if winner is None:  # not measurable now (inside a backward pass, deterministic mode): asked again next call
        return plan
    return _remember(memo, memo_key, policy, plan if winner == plan.impl else plans.get(winner, plan))


def _remember(memo: dict, key: tuple, policy: ImplPolicy, plan: Any, limit: int = 64) -> Any:
    """``memo[key] = (policy, plan)`` (a memo past ``limit`` entries, of older generations mostly, starts
    afresh); returns ``plan``."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = (policy, plan)
    return plan


def _measure(layer: TunedLayer, plans: dict[str, Any], static: str, q: Tensor, vals: Tensor, spatial, grad) -> str:
    """Time the candidates' position steps round-robin (one call of each per round, so that a drifting machine
    speed affects them alike) after one warm-up call each, and return the fastest by median; the static pick
    unless another took under :data:`SWITCH_MARGIN` of its time. The eval cache of ``E`` is left as it was."""
    params = [p for p in layer.embedding.parameters() if p.requires_grad] if grad else []
    saved = layer.embedding.__dict__.get("_cache")  # (key, table values, E) or None: restored below
    order = [static] + [impl for impl in plans if impl != static]
    runs = {impl: _runner(layer, plans[impl], q, vals, spatial, grad, params) for impl in order}
    times: dict[str, list[float]] = {impl: [] for impl in order}
    # the timing saves tensors of its own: past any saved-tensor hooks of the caller (activation checkpointing,
    # offloading), which would otherwise record them as the forward's and fail on the recomputation
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    try:
        hooks.__enter__()
        spent, live = 0.0, []
        for impl in order:  # warm-up: one-time costs (E, the kernels' set-up) are not timed
            try:
                spent += _TUNER.timer(impl, runs[impl])
                live.append(impl)
            except torch.OutOfMemoryError:  # too large on this device: not a candidate
                continue
        for r in range(REPEATS):
            if not live or (r and spent > BUDGET_S):
                break
            for impl in live[r % len(live) :] + live[: r % len(live)]:
                times[impl].append(_TUNER.timer(impl, runs[impl]))
                spent += times[impl][-1]
            fastest = min(times[impl][-1] for impl in live)
            live = [impl for impl in live if times[impl][-1] <= DROP_FACTOR * fastest]
    finally:
        hooks.__exit__(None, None, None)
        if saved is None:
            layer.embedding.__dict__.pop("_cache", None)
        else:
            layer.embedding.__dict__["_cache"] = saved
    medians = {impl: statistics.median(t) for impl, t in times.items() if t}
    if not medians:
        return static
    best = min(medians, key=lambda i: medians[i])
    return static if static in medians and medians[best] > SWITCH_MARGIN * medians[static] else best


def _runner(layer: TunedLayer, plan, q: Tensor, vals: Tensor, spatial, grad: bool, params) -> Callable[[], None]:
    """One call of ``plan``'s position step on detached copies of the queries and values (plus its backward to
    them and to ``params`` through ``torch.autograd.grad`` when ``grad``), through to the position output."""
    q_grad, v_grad = grad and q.requires_grad, grad and vals.requires_grad

    def run() -> None:
        qd, vd = q.detach().requires_grad_(q_grad), vals.detach().requires_grad_(v_grad)
        with torch.set_grad_enabled(grad):
            y, lam = layer._position(plan, qd, vd, spatial)
            out = y if lam is None else LF.apply_lambdas(qd, lam)  # b n h v
            inputs = [t for t in (qd, vd, *params) if t.requires_grad]
            if inputs:
                torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)

    return run


def auto_choice(layer: TunedLayer, x: Tensor, *, grad: bool | None = None) -> str:
    """The implementation an ``impl="auto"`` forward call of ``layer`` on ``x`` runs now: its key's measured
    winner (after a first call has measured it), else the static pick. ``grad``: whether the call records
    autograd (default: grad mode on and ``x`` or a parameter of the layer requiring gradients)."""
    spatial, device = tuple(x.shape[2:]), x.device
    static = layer.choose_impl(spatial, device.type)
    if layer.impl != "auto" or static == "none" or _TUNER.mode != "measure":
        return static
    if grad is None:
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))
    plans = _plans(layer, spatial, device)
    key = f"{_base_key(layer, compute_dtype(x.dtype), device, grad)}; {_size_key(spatial, plans)}; b{x.shape[0]}"
    return _TUNER.winners.get(key, static) if len(plans) > 1 else static
