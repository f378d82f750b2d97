"""Export a model for deployment and check the export against the eager model.

Formats (:data:`FORMATS`):

* ``"onnx"``: the dynamo exporter (``torch.onnx.export(model, (x,), path, dynamo=True)``), checked with
  ONNX Runtime. Needs the optional packages ``onnx``, ``onnxscript`` and ``onnxruntime``
  (:data:`ONNX_INSTALL`), imported only here.
* ``"torchscript"``: ``torch.jit.trace`` in eval mode, saved with ``.save``; reload with ``torch.jit.load``.
  (PyTorch deprecates TorchScript in favour of ``torch.export``; its deprecation warnings are not repeated
  here.)
* ``"exported-program"``: ``torch.export.export`` saved with ``torch.export.save`` (``.pt2``); reload with
  ``torch.export.load(path).module()``.

Every export is traced on one example input ``[batch_size, in_chans, input_size, input_size]`` and is
specialised to that shape. With ``check`` the written file is loaded back, run on the example and compared
with the eager model: the largest absolute difference must stay within :func:`check_tolerance`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from lambdanet.helpers import check_choice, check_positive_int

__all__ = ["CHECK_RTOL", "FORMATS", "ONNX_INSTALL", "SUFFIXES", "ExportCheckError", "MissingDependencyError",
           "check_tolerance", "default_export_path", "export_model", "require_format"]

FORMATS = ("onnx", "torchscript", "exported-program")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
ONNX_INSTALL = "pip install onnx onnxscript onnxruntime (or: pip install 'lambdanet[dev]')"

# The exported graph computes what the eager model computes, with other float32 kernels (ONNX Runtime's
# convolutions and GEMMs, BatchNorm folded into convolutions) that sum in another order. Each re-ordered op
# changes its output by a few float32 roundings relative to the output's scale (a few eps32 = 1.2e-7 for
# the blocked dot products of a CPU GEMM), and to first order these errors add along the network: the
# deepest path of the registered models is below ~1000 ops, so ~4 * 1000 * eps32 ~ 5e-4 of the output's
# scale, rounded up to 1e-3. A wrong export (a dropped or misrouted op) changes the logits by O(1) of
# their scale, far above it.
CHECK_RTOL = 1e-3


class MissingDependencyError(ImportError, ValueError):
    """An optional package that an export format needs is not installed (the message says how to get it)."""


class ExportCheckError(ValueError):
    """The exported model, loaded back, disagrees with the eager model beyond :func:`check_tolerance`."""


def require_format(format: str, *, check: bool = True) -> None:
    """Check that ``format`` is one of :data:`FORMATS` and that the packages it needs import (ONNX: ``onnx``
    and ``onnxscript``, and ``onnxruntime`` when ``check``); raise a ``ValueError`` /
    :class:`MissingDependencyError` saying what to do otherwise."""
    check_choice(format, "format", FORMATS)
    if format != "onnx":
        return
    needed = ["onnx", "onnxscript"] + (["onnxruntime"] if check else [])
    missing = []
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingDependencyError(f"ONNX export needs {', '.join(missing)}, which is not installed: "
                                     f"{ONNX_INSTALL}")


def default_export_path(name: str, format: str) -> Path:
    """``<name><suffix>`` in the working directory (``.onnx``, ``.pt``, ``.pt2``)."""
    check_choice(format, "format", FORMATS)
    return Path(f"{name}{SUFFIXES[format]}")


def check_tolerance(expected: Tensor) -> float:
    """The largest absolute difference the check accepts between an export and the eager output
    ``expected``: :data:`CHECK_RTOL` times the output's largest magnitude (see the note at
    :data:`CHECK_RTOL`), and at least ``CHECK_RTOL * float32 tiny`` for an all-zero output."""
    scale = max(float(expected.detach().abs().max()), torch.finfo(torch.float32).tiny) if expected.numel() else 1.0
    return CHECK_RTOL * scale


def _tensors(out) -> list[Tensor]:
    """The tensors of a model output (a tensor, or a list / tuple of them, e.g. ``features_only``)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    raise ValueError(f"cannot compare a model output of type {type(out).__name__}")


@contextlib.contextmanager
def _quiet_onnx() -> Iterator[None]:
    """Silence the ONNX optimiser's per-node log lines ("Skipping constant folding ...") during an export."""
    logger = logging.getLogger("onnxscript")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Without TorchScript's deprecation warnings and the tracer's shape warnings (the trace is specialised to
    the example's shape, which the module docstring states once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
        yield


def _load_and_run(path: Path, format: str, x: Tensor) -> list[Tensor]:
    """The outputs of the exported file at ``path`` on ``x`` (ONNX on ONNX Runtime's CPU provider)."""
    if format == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})
        return [torch.from_numpy(o) for o in outputs]
    if format == "torchscript":
        with _quiet_torchscript():
            return _tensors(torch.jit.load(str(path), map_location=x.device)(x))
    return _tensors(torch.export.load(str(path)).module()(x))


def export_model(model: nn.Module, path: str | os.PathLike, format: str, *, input_size: int, in_chans: int,
                 check: bool = True, batch_size: int = 1) -> dict:
    """Write ``model`` to ``path`` in ``format`` (see the module docstring) and check it.

    Args:
        model: the model; exported in eval mode (its training flag is restored afterwards), on its device.
        path: the output file (its folder is created).
        format: one of :data:`FORMATS`.
        input_size: height and width of the example input the export is specialised to.
        in_chans: channels of the example input.
        check: load the file back, run it on the example and compare with the eager model; raise
            :class:`ExportCheckError` naming the largest difference if it exceeds :func:`check_tolerance`.
        batch_size: batch of the example input.

    Returns:
        ``{"path", "format", "input_shape", "checked", "max_abs_error", "tolerance"}`` (the last two ``None``
        without ``check``).
    """
    require_format(format, check=check)
    check_positive_int(input_size, "input_size")
    check_positive_int(in_chans, "in_chans")
    check_positive_int(batch_size, "batch_size")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, in_chans, input_size, input_size, generator=generator).to(device)  # b c s s
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = _tensors(model(x))
        if format == "onnx":
            with _quiet_onnx():
                torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False, input_names=["image"])
        elif format == "torchscript":
            with torch.no_grad(), _quiet_torchscript():
                traced = torch.jit.trace(model, x, check_trace=False)
                traced.save(str(path))
        else:  # "exported-program"
            torch.export.save(torch.export.export(model, (x,)), str(path))
        result = {"path": str(path), "format": format, "input_shape": list(x.shape), "checked": check,
                  "max_abs_error": None, "tolerance": None}
        if not check:
            return result
        with torch.no_grad():
            actual = _load_and_run(path, format, x)
    finally:
        model.train(was_training)
    if len(actual) != len(expected):
        raise ExportCheckError(f"{path}: the export returns {len(actual)} outputs, the model {len(expected)}")
    worst = (0.0, 0.0, float("inf"))  # (error / tolerance, error, tolerance) of the worst output
    for a, e in zip(actual, expected):
        if tuple(a.shape) != tuple(e.shape):
            raise ExportCheckError(f"{path}: the export returns shape {tuple(a.shape)}, the model {tuple(e.shape)}")
        err = float((a.to(e.device, e.dtype) - e).abs().max()) if e.numel() else 0.0
        tol = check_tolerance(e)
        ratio = float("inf") if math.isnan(err) else err / tol  # NaN: the worst
        if ratio >= worst[0]:
            worst = (ratio, err, tol)
    _, error, tolerance = worst
    if not error <= tolerance:  # also catches NaN
        raise ExportCheckError(f"{path}: the {format} export differs from the eager model by up to {error:.3g} "
                               f"(max abs), above the tolerance {tolerance:.3g}")
    return result | {"max_abs_error": error, "tolerance": tolerance}
