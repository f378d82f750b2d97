"""Small helpers shared across the package: argument validation and n-d operator lookup."""

from __future__ import annotations

import importlib
import math
import numbers
import sys
import warnings
import operator
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, SupportsIndex, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "functorch_active",
    "in_graph",
    "check_int",
    "check_number",
    "plain_real",
    "MissingExtraError",
    "require",
    "compute_dtype",
    "autocast_active",
    "check_dtype",
    "bind_shapes",
    "is_finite_real",
    "no_autocast",
    "leave_autocast",
    "to_ntuple",
    "check_positive_int",
    "check_choice",
    "conv_nd",
    "avg_pool_nd",
    "check_input",
    "check_real",
    "moved_module",
]


@overload
def to_ntuple(value: None, n: int, name: str) -> None: ...
@overload
def to_ntuple(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]: ...


def to_ntuple(value: int | Sequence[int] | None, n: int, name: str) -> tuple[int, ...] | None:
    """``value`` as an ``n``-tuple of ints (``None`` stays ``None``); a ``ValueError`` naming ``name`` for
    anything else (a non-int entry, a sequence of the wrong length)."""
    if value is None:
        return None
    if _is_int(value):
        return (operator.index(cast(SupportsIndex, value)),) * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
    entries = tuple(value)
    if not all(_is_int(v) for v in entries):  # 4.5 is not silently truncated to 4, True is not 1
        raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
    if len(entries) != n:
        raise ValueError(f"{name} must have {n} entries (one per spatial dim), got {value!r}")
    return tuple(operator.index(v) for v in entries)


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` where nothing compiles:
    torch's decorator imports it (2.5 s of every ``import lambdanet`` and command start on a CPU) to set one mark
    on ``fn``, which dynamo reads when it traces a call (tests/test_extras.py checks the mark is torch's). Where
    dynamo is loaded already, torch's own decorator."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # torch._dynamo.decorators.assume_constant_result's whole work (2.0 - 2.14)
    return fn


def _is_int(value) -> bool:
    """An integer that is not a bool (``operator.index`` accepts ints, numpy ints and 0-d integer tensors)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_positive_int(value, name: str, *, odd: bool = False, allow_none: bool = False) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a positive (odd) int."""
    if value is None and allow_none:
        return
    if not _is_int(value) or value <= 0 or (odd and value % 2 == 0):
        kind = "a positive odd int" if odd else "a positive int"
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be {kind}{extra}, got {value!r}")


def check_int(
    value, name: str, low: int = 1, high: int | None = None, *, note: str = "", optional: bool = False,
    plain: bool = False,
) -> None:  # fmt: skip
    """Raise a one-line ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool; numpy's and 0-d
    integer tensors too, unless ``plain``: a Python int, as a configuration file holds) in ``low`` .. ``high``
    (``None``: no upper end), or ``None`` where ``optional``; ``note`` follows the kind in the message (and says
    the upper end: ``" below 2**32"``)."""
    if optional and value is None:
        return
    ok = (isinstance(value, int) and not isinstance(value, bool)) if plain else _is_int(value)
    if ok and low <= operator.index(value) and (high is None or operator.index(value) <= high):
        return
    kind = {1: "a positive int", 0: "a non-negative int"}.get(low, f"an int >= {low}")  # the note says the rest
    raise ValueError(f"{name} must be {kind}{note}{' or null' if optional else ''}, got {value!r}")


def check_choice(value, name: str, choices: Sequence) -> None:
    """Raise a ``ValueError`` naming ``name`` and listing ``choices`` unless ``value`` is one of them (not
    equality alone: ``True == 1`` and ``2.0 == 2``, but a bool or a float is no int choice)."""
    if not any(_same_choice(value, c) for c in choices):
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _same_choice(value, choice) -> bool:
    if isinstance(choice, int) and not isinstance(choice, bool):
        return _is_int(value) and value == choice
    if isinstance(choice, bool) or isinstance(value, bool):
        return value is choice
    try:
        return bool(value == choice)
    except Exception:  # an object whose == fails or is not a truth value (a tensor) is no choice
        return False


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def conv_nd(spatial_dims: int) -> Callable[..., Tensor]:
    """``F.conv1d`` / ``F.conv2d`` / ``F.conv3d`` for 1, 2 or 3 spatial dims."""
    return _CONV[spatial_dims]


def avg_pool_nd(spatial_dims: int) -> Callable[..., Tensor]:
    """``F.avg_pool1d`` / ``2d`` / ``3d`` for 1, 2 or 3 spatial dims."""
    return _AVG_POOL[spatial_dims]


def check_input(
    x: Tensor, dim: int, spatial_dims: int | None, layer: str | torch.nn.Module, *, dim_name: str = "dim"
) -> None:
    """Validate a ``[B, C, *spatial]`` input with a one-line ``ValueError``: a floating-point tensor with
    ``spatial_dims`` spatial axes (``None``: any of 1, 2 or 3), ``dim`` channels and no empty spatial axis. A
    rank mismatch names the ``spatial_dims`` the input has (``spatial_dims=3`` for a 5-d input), i.e. what a
    layer would need to take it. ``layer``: the layer's name, or the layer itself (named by its class), whose
    first parameter's dtype the input must then have outside autocast (:func:`check_dtype`). ``dim_name``: the
    constructor argument that set ``dim``."""
    module, layer = (layer, type(layer).__name__) if isinstance(layer, torch.nn.Module) else (None, layer)
    if not isinstance(x, Tensor):
        raise ValueError(f"{layer} expects a tensor input [B, C, *spatial], got {type(x).__name__}")
    expected = (1, 2, 3) if spatial_dims is None else (spatial_dims,)
    got = x.dim() - 2
    if got not in expected:
        names = " or ".join(f"rank {d + 2} {_LAYOUTS[d]}" for d in expected)
        wanted = "spatial_dims 1, 2 or 3" if spatial_dims is None else f"spatial_dims={spatial_dims}"
        if got in _LAYOUTS:
            has = f"which has spatial_dims={got}"
        elif got > 3:
            has = f"which has {got} spatial dims (spatial_dims is 1, 2 or 3)"
        else:
            has = "which has no spatial axes"
        raise ValueError(f"{layer} expects input of {names} ({wanted}), got shape {tuple(x.shape)}, {has}")
    if x.shape[1] != dim:
        raise ValueError(
            f"{layer} was built with {dim_name}={dim} input channels, got input with {x.shape[1]} channels"
        )
    if not x.is_floating_point():
        raise ValueError(f"{layer} expects a floating-point input, got dtype {x.dtype}")
    if any(s == 0 for s in x.shape[2:]):
        raise ValueError(f"{layer} expects a non-empty spatial size, got input of shape {tuple(x.shape)}")
    if module is not None and (weight := next(module.parameters(), None)) is not None:
        check_dtype(x, weight, layer)


_LAYOUTS = {1: "[B, C, L]", 2: "[B, C, H, W]", 3: "[B, C, D, H, W]"}


def bind_shapes(**named: tuple[Tensor, str]) -> dict[str, int]:
    """Check each tensor against a space-separated axis spec and that shared axes agree.

    ``bind_shapes(queries=(q, "b h n k"), keys=(k, "b m k"))`` returns ``{"b": .., "h": .., ...}`` or raises a
    ``ValueError`` that names the offending argument and the expected shape.
    """
    sizes: dict[str, tuple[int, str]] = {}
    for arg, (t, spec) in named.items():
        axes = spec.split()
        if not isinstance(t, Tensor):
            raise ValueError(f"{arg} must be a tensor of shape [{', '.join(axes)}], got {type(t).__name__}")
        if t.dim() != len(axes):
            raise ValueError(f"{arg} must have shape [{', '.join(axes)}], got shape {tuple(t.shape)}")
        for ax, s in zip(axes, t.shape):
            if ax in sizes and sizes[ax][0] != s:
                other_size, other_arg = sizes[ax]
                raise ValueError(
                    f"{arg} has {ax}={s} but {other_arg} has {ax}={other_size}; "
                    f"expected {arg} of shape [{', '.join(axes)}]"
                )
            sizes.setdefault(ax, (int(s), arg))
    return {ax: s for ax, (s, _) in sizes.items()}


def check_dtype(x: Tensor, weight: Tensor, layer: str) -> None:
    """A one-line ``ValueError`` where ``x`` cannot meet ``weight`` (the layer's first projection) in a product:
    another floating dtype outside autocast (which casts both itself). Called before the projection, whose own
    error is torch's ``mat1 and mat2 must have the same dtype``."""
    if x.dtype != weight.dtype and not autocast_active(x.device.type):
        raise ValueError(
            f"{layer}'s parameters are {str(weight.dtype).removeprefix('torch.')} but its input is "
            f"{str(x.dtype).removeprefix('torch.')}: cast the input, or the layer with .to({x.dtype})"
        )


def plain_real(value):
    """``value`` as a Python float where it is a real number of another kind (numpy's, or an int; one too large for
    a float: ``inf``; a 0-d tensor or array: its element), anything else (a bool, a string, ``None``) as it is: for
    the check that follows."""
    if (
        getattr(value, "ndim", None) == 0
        and callable(getattr(value, "item", None))
        and not getattr(value, "is_meta", 0)
    ):
        value = value.item()  # torch's or numpy's scalar (a meta tensor has no value: as it is)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    return value


def is_finite_real(value) -> bool:
    """Whether ``value`` is a finite real number: a Python int or float (what a configuration file holds and
    saves back), not a bool, not inf or nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _shown_number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def check_number(
    value,
    name: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    note: str = "",
) -> None:
    """Raise a one-line ``ValueError`` naming ``name`` unless ``value`` is a finite real number (an int or a
    float, not a bool) within ``low`` .. ``high`` (either end open where asked; ``None``: no end), or ``None``
    where ``optional``: ``lr must be positive, got 0.0``, ``val_split must be in [0, 1), got 1.5``, ``lr must
    be a positive finite number, got 'abc'``."""
    if optional and value is None:
        return
    finite = is_finite_real(value)
    above = low is None or (value > low if low_open else value >= low) if finite else False
    below = high is None or (value < high if high_open else value <= high) if finite else False
    if finite and above and below:
        return
    if low is not None and high is not None:
        what = f"in {'(' if low_open else '['}{_shown_number(low)}, {_shown_number(high)}{')' if high_open else ']'}"
    elif low is not None:
        what = "positive" if low == 0 and low_open else f"{'>' if low_open else '>='} {_shown_number(low)}"
    else:
        what = "" if high is None else f"{'<' if high_open else '<='} {_shown_number(high)}"
    if not finite:
        what = "a positive finite number" if what == "positive" else f"a finite number {what}".rstrip()
    raise ValueError(f"{name} must be {what}{note}{' or null' if optional else ''}, got {value!r}")


def check_real(value, name: str, *, low: float = 0, high: float | None = None, high_open: bool = False) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is a finite real number (an int or float, not a
    bool) in ``(low, high]`` (``(low, high)`` with ``high_open``; no upper end for ``high=None``):
    :func:`check_number` with the lower end open."""
    check_number(value, name, low, high, low_open=True, high_open=high_open)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype softmaxes, attention logits and lambdas are computed in for inputs of ``dtypes``: their
    promotion, at least float32. float16 / bfloat16 -> float32 (never half precision, also under autocast),
    float32 -> float32, float64 -> float64 (so float64 layers can be ``gradcheck``-ed and cross-checked)."""
    dtype = torch.float32
    for d in dtypes:
        dtype = torch.promote_types(dtype, d)
    return dtype


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) runs this code: the package's
    Python ``autograd.Function``s and host reads then give way to plain differentiable ops. Not under
    ``torch.compile``, whose tracing keeps an interpreter on the same stack (and takes the Functions)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def in_graph() -> bool:
    """Whether this call is traced or compiled into a graph (``torch.compile``, ``torch.jit.trace``) or transformed
    by ``torch.func`` (:func:`functorch_active`): then plain differentiable ops, no Python ``autograd.Function``,
    no host read and no cached tensor (a trace would keep it as a constant)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or functorch_active()


def host_readable(t: torch.Tensor) -> bool:
    """Whether the host can read ``t``'s values (``.item()``): not a meta tensor nor a fake one (``FakeTensorMode``,
    the shapes-only tracing of export and of compile's analysis), whose values do not exist."""
    if t.is_meta:
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # not loaded: no fake tensor exists
    return fake is None or not fake.is_fake(t)


AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")  # the device types torch.autocast serves (meta tensors: none)


def autocast_active(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (never on a device type autocast does not serve)."""
    return device_type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def no_autocast(device_type: str) -> AbstractContextManager:
    """A context with autocast off for ``device_type`` (a no-op on device types autocast does not serve). Entered
    also where autocast looks off: AOTAutograd traces a custom Function's backward with the forward's autocast
    state, which ``torch.is_autocast_enabled`` does not report there. A forward uses :func:`leave_autocast`."""
    return torch.autocast(device_type, enabled=False) if device_type in AUTOCAST_DEVICE_TYPES else nullcontext()


def leave_autocast(device_type: str) -> AbstractContextManager:
    """:func:`no_autocast` where autocast is on for ``device_type``, else no autocast context at all. For forward
    passes: ``torch.export`` records every autocast context it enters, a disabled one too, as a
    ``wrap_with_autocast`` node without the ``val`` metadata its verifier requires, so the saved ExportedProgram
    of a forward that entered one fails ``torch.export.load`` with a ``SpecViolationError``."""
    return no_autocast(device_type) if autocast_active(device_type) else nullcontext()


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it (one line)."""


def require(module: str, extra: str, what: str):
    """``module`` imported, or :class:`MissingExtraError` saying that ``what`` needs ``pip install
    "lambdanet[extra]"`` (the core install has torch, torchvision, numpy, safetensors, huggingface_hub, PyYAML
    and tqdm; ``train``, ``detect``, ``export`` and ``bench`` bring the rest)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f'{what} needs {module.split(".")[0]}, which is not installed ({err}): pip install "lambdanet[{extra}]"'
        ) from None


def moved_module(
    old: str, new: str, namespace: dict | None = None, renamed: dict[str, str] | None = None, removed_in: str = "0.4"
) -> None:
    """Keep the import path ``old`` (the caller's ``__name__``) of a module that moved to ``new`` for one release:
    a ``DeprecationWarning`` naming the new path, then ``sys.modules[old]`` is the new module itself, so that its
    every name (private ones included), ``isinstance`` checks and pickled references to the old path keep
    working. Called as the whole body of a module that moved::

        from lambdanet.helpers import moved_module

        moved_module(__name__, "lambdanet.tasks.classification.config")

    A package that moved passes its ``globals()`` as ``namespace`` instead: it stays a package of its own (its
    submodules, shims like the above, import from its folder) and receives the new package's names, and
    ``renamed`` (``{old submodule name: new module}``) binds its submodules that moved under another name.
    Run as a script (``python -m old``), the new module runs as ``__main__``."""
    warnings.warn(
        f"{old} moved to {new}; the old import path is removed in lambdanet {removed_in}",
        DeprecationWarning,
        stacklevel=3,
    )
    if old == "__main__":
        import runpy

        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    module = importlib.import_module(new)
    if namespace is None:
        sys.modules[old] = module
        return
    namespace.update({k: v for k, v in vars(module).items() if not k.startswith("__") or k == "__all__"})
    namespace.update({name: importlib.import_module(path) for name, path in (renamed or {}).items()})
