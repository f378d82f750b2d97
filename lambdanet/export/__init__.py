"""Export a model for deployment and check the export against the eager model.

Formats (:data:`FORMATS`):

* ``"onnx"``: the dynamo exporter (``torch.onnx.export(model, (x,), path, dynamo=True)``), checked with
  ONNX Runtime. Needs the optional packages ``onnx``, ``onnxscript`` and ``onnxruntime``
  (:data:`ONNX_INSTALL`), imported only here. The file is self-contained (weights included, one ``.onnx``
  file) unless the weights exceed :data:`ONNX_SINGLE_FILE_MAX_BYTES` (protobuf caps a file at 2 GB): then
  they go to ``<path>.data`` next to it, which must stay there, and the result's ``external_data`` names it.
  The exporter's graph optimiser runs without onnxscript's reshape-matmul-reshape rewrites
  (:func:`~lambdanet.export.onnx_format.without_reshape_matmul_rewrites`), which broke static-batch files
  whose batch equals the lambda layers' heads.
* ``"torchscript"``: ``torch.jit.trace`` in eval mode, saved with ``.save``; reload with ``torch.jit.load``
  (PyTorch deprecates TorchScript in favour of ``torch.export``; its deprecation warnings are silenced here).
* ``"exported-program"``: ``torch.export.export`` saved with ``torch.export.save`` (``.pt2``); reload with
  ``torch.export.load(path).module()``.

Batch. Every export is traced on one example input ``[batch_size, in_chans, input_size, input_size]`` and is
specialised to its channels and size. With ``dynamic_batch`` (the default) the batch dimension stays
symbolic: ONNX and ExportedProgram declare it dynamic (``torch.export.Dim("batch")``; the ONNX input
``image`` has shape ``["batch", C, N, N]``), and a TorchScript trace, which records shapes as they are read,
works at any batch for every registered model. The example then has batch 2 (``torch.export`` specialises a
dimension of size 1 to the constant 1), and the check runs the loaded file at batches 1 and 3, neither of them
the traced one, so an export that froze the batch fails the check. Every registered model exports with a
dynamic batch in all three formats; one that cannot gets an error saying to use ``dynamic_batch=False``
(``lambdanet export --static-batch``), which exports and checks at the example's batch only (default 1).

Precision. The export computes in the dtype of the model's floating-point parameters
(:func:`lambdanet.predict.floating_dtype`; convert the model with ``.half()`` / ``.to(torch.bfloat16)``, or
``lambdanet export --dtype``), also when called under ``torch.autocast`` (switched off for the export and
the check), and its input is in that dtype. TorchScript and ExportedProgram take float32,
float16 and bfloat16; ONNX takes float32 and float16 (:data:`FORMAT_DTYPES`: ONNX Runtime's CPU provider has
no bfloat16 convolution, so a bfloat16 ONNX file could not be checked or run there).

With ``check`` the written file is loaded back, run on the check inputs and compared with the eager model:
the largest absolute difference must stay within :func:`check_tolerance`. The file is written in a temporary
folder beside ``path`` and moved to ``path`` only once exported and checked: a failed export leaves no file,
and a file already at ``path`` stays as it was."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from lambdanet.export.onnx_format import onnx_export
from lambdanet.helpers import MissingExtraError, check_choice, check_positive_int, no_autocast
from lambdanet.predict import DTYPES, floating_dtype

__all__ = [
    "CHECK_RTOL",
    "FORMATS",
    "FORMAT_DTYPES",
    "HALF_CHECK_RTOL",
    "ONNX_INSTALL",
    "ONNX_SINGLE_FILE_MAX_BYTES",
    "SUFFIXES",
    "ExportCheckError",
    "MissingDependencyError",
    "check_dtype",
    "check_tolerance",
    "default_export_path",
    "trace_batch",
    "export_model",
    "require_format",
]

FORMATS = ("onnx", "torchscript", "exported-program")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
ONNX_INSTALL = 'pip install "lambdanet[export]" (or: pip install onnx onnxscript onnxruntime)'
# the precisions each format exports in (names of lambdanet.predict.DTYPES); see the module docstring
FORMAT_DTYPES = {"onnx": ("float32", "float16"), "torchscript": tuple(DTYPES), "exported-program": tuple(DTYPES)}
# weights above this go to an external .data file: a protobuf message (an .onnx file) cannot exceed 2 GB, and
# the graph needs room next to the weights; torch.onnx externalises above the same size on its own
ONNX_SINGLE_FILE_MAX_BYTES = 1536 * 1024 * 1024
_DYNAMIC_BATCH = 2  # the example's batch with a dynamic batch: torch.export specialises a size of 1

# The exported graph computes what the eager model computes, with other float32 kernels (ONNX Runtime's
# convolutions and GEMMs, BatchNorm folded into convolutions) that sum in another order. Each re-ordered op changes
# its output by a few float32 roundings relative to the output's scale (a few eps32 = 1.2e-7 for the blocked dot
# products of a CPU GEMM), and to first order these errors add along the network: the deepest path of the
# registered models is below ~1000 ops, so ~4 * 1000 * eps32 ~ 5e-4 of the output's scale, rounded up to 1e-3. A
# wrong export (a dropped or misrouted op) changes the logits by O(1) of their scale, far above it.
CHECK_RTOL = 1e-3
# In float16 / bfloat16 every op's output is rounded to the half type (eps 2**-10 / 2**-7). ONNX Runtime's
# float16 kernels, like any other kernel, may round an op's output to the neighbouring half value, an error of
# one eps of its scale; the linear bound of CHECK_RTOL (~1000 ops) exceeds 1 here, but these roundings are
# independent in sign and add in quadrature: ~4 * sqrt(1000) * eps16 = 0.12, so 1/8 of the output's scale.
# TorchScript and ExportedProgram replay the eager ATen kernels (bit-equal outputs), so in bfloat16, the only
# precision ONNX does not take, only the few ops recorded in another, re-associated form differ: 16 roundings
# at the output's scale, 16 * eps_bf16 = 1/8 too. A wrong export changes the output by O(1) of its scale.
HALF_CHECK_RTOL = 0.125


class MissingDependencyError(MissingExtraError, ValueError):
    """An optional package that an export format needs is not installed (the message says how to get it)."""


class ExportCheckError(ValueError):
    """The exported model, loaded back, disagrees with the eager model beyond :func:`check_tolerance`."""


def check_dtype(format: str, dtype: torch.dtype, name: str = "dtype") -> None:
    """Raise a one-line ``ValueError`` naming ``name`` unless ``format`` exports in ``dtype`` (a torch dtype;
    :data:`FORMAT_DTYPES`)."""
    check_choice(format, "format", FORMATS)
    names = {v: k for k, v in DTYPES.items()}
    if names.get(dtype) not in FORMAT_DTYPES[format]:
        why = " (ONNX Runtime's CPU provider has no bfloat16 convolution)" if dtype == torch.bfloat16 else ""
        raise ValueError(
            f"{name} must be one of {list(FORMAT_DTYPES[format])} for the {format} format, got "
            f"{names.get(dtype, dtype)!r}{why}"
        )


def require_format(format: str, *, check: bool = True, dtype: torch.dtype | None = None) -> None:
    """Check that ``format`` is one of :data:`FORMATS`, that it exports in ``dtype`` when given
    (:func:`check_dtype`) and that the packages it needs import (ONNX: ``onnx`` and ``onnxscript``, and
    ``onnxruntime`` when ``check``); raise a ``ValueError`` / :class:`MissingDependencyError` saying what to do
    otherwise."""
    check_choice(format, "format", FORMATS)
    if dtype is not None:
        check_dtype(format, dtype)
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
        verb = "is" if len(missing) == 1 else "are"
        names = ", ".join(missing)
        raise MissingDependencyError(f"ONNX export needs {names}, which {verb} not installed: {ONNX_INSTALL}")


def default_export_path(name: str, format: str) -> Path:
    """``<name><suffix>`` in the working directory (``.onnx``, ``.pt``, ``.pt2``)."""
    check_choice(format, "format", FORMATS)
    return Path(f"{name}{SUFFIXES[format]}")


def check_tolerance(expected: Tensor, dtype: torch.dtype | None = None) -> float:
    """The largest absolute difference the check accepts between an export and the eager output
    ``expected`` of a model computing in ``dtype`` (default: ``expected.dtype``): :data:`CHECK_RTOL` (float32
    and wider) or :data:`HALF_CHECK_RTOL` (float16, bfloat16) times the output's largest magnitude (see the
    notes at both), and at least that times float32 tiny for an all-zero output."""
    dtype = expected.dtype if dtype is None else dtype
    rtol = HALF_CHECK_RTOL if dtype in (torch.float16, torch.bfloat16) else CHECK_RTOL
    scale = max(float(expected.detach().abs().max()), torch.finfo(torch.float32).tiny) if expected.numel() else 1.0
    return rtol * scale


def _tensors(out) -> list[Tensor]:
    """The tensors of a model output (a tensor, or a list / tuple of them, e.g. ``features_only``)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    raise ValueError(f"cannot compare a model output of type {type(out).__name__}")


@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Without TorchScript's deprecation warnings and the tracer's shape warnings (the trace is specialised to
    the example's shape, which the module docstring states once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for category in (FutureWarning, DeprecationWarning):  # torch 2.14 warns with the first, 2.11 the second
            warnings.filterwarnings("ignore", category=category, module=r"torch\.jit")
        yield


def _load(path: Path, format: str, device: torch.device):
    """The exported file at ``path`` loaded back: a callable from a tensor to the list of output tensors (ONNX
    on ONNX Runtime's CPU provider, its own warnings silenced)."""
    if format == "onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: not "could not constant-fold" notes of float16 graphs
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: [torch.from_numpy(o) for o in session.run(None, {name: x.detach().cpu().numpy()})]
    if format == "torchscript":
        with _quiet_torchscript():
            module = torch.jit.load(str(path), map_location=device)
    else:
        with warnings.catch_warnings():  # torch 2.11 warns that the file's bytes are read-only; the check only reads
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            module = torch.export.load(str(path)).module()
    return lambda x: _tensors(module(x))


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    format: str,
    *,
    input_size: int,
    in_chans: int,
    check: bool = True,
    batch_size: int | None = None,
    dynamic_batch: bool = True,
) -> dict:
    """Write ``model`` to ``path`` in ``format`` (see the module docstring) and check it.

    Args:
        model: the model; exported in eval mode (its training flag is restored afterwards), on its device, in
            the dtype of its floating-point parameters (one of ``FORMAT_DTYPES[format]``).
        path: the output file (its folder is created), replaced only by an export that succeeds.
        format: one of :data:`FORMATS`.
        input_size: height and width of the example input the export is specialised to.
        in_chans: channels of the example input.
        check: load the file back, run it on the check inputs and compare with the eager model; raise
            :class:`ExportCheckError` naming the largest difference if it exceeds :func:`check_tolerance`.
        batch_size: batch of the example input the export is traced on: default 2 with ``dynamic_batch``
            (which needs at least 2), else 1.
        dynamic_batch: export with a symbolic batch dimension, checked at batches 1 and ``batch_size + 1``;
            ``False``: specialised to ``batch_size``, checked at it.

    The example input is ``torch.randn(batch_size, in_chans, input_size, input_size)`` from a generator seeded
    with 0, cast to the model's dtype; with ``dynamic_batch`` the check inputs are drawn after it from the
    same generator, one per check batch in order; otherwise the check runs on the example.

    Returns:
        ``{"path", "format", "dtype", "input_shape" (the example's), "dynamic_batch", "check_batches",
        "external_data" (ONNX's weights file next to ``path`` when they could not be in it, else ``None``),
        "checked", "max_abs_error", "tolerance"}`` (the last two ``None`` without ``check``).
    """
    dtype = floating_dtype(model)
    batch_size = _check_arguments(format, dtype, check, input_size, in_chans, batch_size, dynamic_batch)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)

    def draw(batch: int) -> Tensor:
        return torch.randn(batch, in_chans, input_size, input_size, generator=generator).to(device, dtype)

    x = draw(batch_size)  # b c s s
    check_batches = [1, batch_size + 1] if dynamic_batch else [batch_size]
    inputs = [draw(b) for b in check_batches] if dynamic_batch else [x]
    was_training = model.training
    model.eval()
    # written into a private folder beside path and moved there once checked: a failed export leaves no file
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as staging:
        staged = Path(staging) / path.name  # the same name: ONNX's external data file is found by it
        try:
            with no_autocast(device.type):  # in the model's dtype, also when called under torch.autocast
                with torch.no_grad():
                    expected = [_tensors(model(xi)) for xi in inputs] if check else []
                external_data = _write(model, x, staged, format, dynamic_batch)
                actual = _run_export(staged, path, format, device, check_batches, inputs) if check else []
        finally:
            model.train(was_training)
        error, tolerance = _compare(path, format, check_batches, actual, expected, dtype) if check else (None, None)
        external_data = _publish(staged, path, external_data)
    return {
        "path": str(path),
        "format": format,
        "dtype": str(dtype).removeprefix("torch."),
        "input_shape": list(x.shape),
        "dynamic_batch": dynamic_batch,
        "check_batches": check_batches,
        "external_data": external_data,
        "checked": check,
        "max_abs_error": error,
        "tolerance": tolerance,
    }


def _publish(staged: Path, path: Path, external_data: str | None) -> str | None:
    """Move the checked export ``staged`` to ``path``, its external weights file (if any) first, beside it under
    the name the file refers to it by; returns that file's new path."""
    if external_data is None:
        os.replace(staged, path)
        return None
    moved = path.parent / Path(external_data).name
    os.replace(external_data, moved)
    os.replace(staged, path)
    return str(moved)


def _check_arguments(
    format: str,
    dtype: torch.dtype,
    check: bool,
    input_size: int,
    in_chans: int,
    batch_size: int | None,
    dynamic_batch: bool,
) -> int:
    """:func:`export_model`'s arguments checked (one-line ``ValueError``s); returns the batch size to trace at."""
    check_choice(format, "format", FORMATS)
    check_dtype(format, dtype, "the model's dtype")  # before the packages: a bfloat16 ONNX export needs none
    require_format(format, check=check)
    check_positive_int(input_size, "input_size")
    check_positive_int(in_chans, "in_chans")
    check_choice(dynamic_batch, "dynamic_batch", (True, False))
    return trace_batch(batch_size, dynamic_batch)


def trace_batch(
    batch_size: int | None,
    dynamic_batch: bool,
    name: str = "batch_size",
    dynamic: str = "dynamic_batch=True",
    hint: str = "",
) -> int:
    """The batch an export is traced at: ``batch_size``, by default 2 with a dynamic batch and 1 without. A
    dynamic batch needs 2 or more (torch.export specialises a dimension of size 1); a one-line ``ValueError``
    names the argument ``name``, the setting ``dynamic`` and ends with ``hint``."""
    if batch_size is None:
        return _DYNAMIC_BATCH if dynamic_batch else 1
    check_positive_int(batch_size, name)
    if dynamic_batch and batch_size < 2:
        raise ValueError(
            f"{name} must be at least 2 with {dynamic} (torch.export specialises a dimension of size 1 to the "
            f"constant 1), got {batch_size}{hint}"
        )
    return batch_size


def _write(model: nn.Module, x: Tensor, path: Path, format: str, dynamic_batch: bool) -> str | None:
    """Export ``model`` traced on ``x`` to ``path``; returns ONNX's external weights file, if any. A failure
    of a dynamic-batch export is a one-line ``ValueError`` pointing at the static export."""
    dynamic_shapes = ({0: torch.export.Dim("batch")},) if dynamic_batch else None
    try:
        if format == "onnx":
            return onnx_export(model, x, path, dynamic_shapes, ONNX_SINGLE_FILE_MAX_BYTES)
        if format == "torchscript":
            with torch.no_grad(), _quiet_torchscript():
                torch.jit.trace(model, x, check_trace=False).save(str(path))
        else:  # "exported-program"
            torch.export.save(torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes), str(path))
        return None
    except OSError:  # the file could not be written: not the batch's fault
        raise
    except Exception as err:
        if not dynamic_batch:
            raise
        raise ValueError(
            f"the {format} export with a dynamic batch failed ({_summary(err)}); "
            f"dynamic_batch=False (lambdanet export --static-batch) exports for batch "
            f"{x.shape[0]} only"
        ) from err


def _summary(err: BaseException) -> str:
    """``"<type>: <first line of the message>"`` of an exporter's or loader's error, for a one-line message."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"


def _run_export(
    staged: Path, path: Path, format: str, device: torch.device, check_batches: list[int], inputs: list[Tensor]
) -> list[list[Tensor]]:
    """The exported file ``staged`` (to be moved to ``path``, which the errors name) loaded back and run on the
    check inputs."""
    try:
        run = _load(staged, format, device)
    except Exception as err:  # e.g. an ExportedProgram that torch.export's verifier rejects
        raise ExportCheckError(f"{path}: the {format} export does not load back ({_summary(err)})") from err
    actual = []
    with torch.no_grad():
        for b, xi in zip(check_batches, inputs):
            try:
                actual.append(run(xi))
            except Exception as err:  # e.g. a trace whose reshapes froze the traced batch
                raise ExportCheckError(f"{path}: the {format} export fails at batch {b} ({_summary(err)})") from err
    return actual


def _compare(
    path: Path,
    format: str,
    check_batches: list[int],
    actual: list[list[Tensor]],
    expected: list[list[Tensor]],
    dtype: torch.dtype,
) -> tuple[float, float]:
    """(largest error, its tolerance) of the export's outputs against the eager model's, the worst relative to
    :func:`check_tolerance`; :class:`ExportCheckError` when a shape differs or an error exceeds its tolerance."""
    worst = (0.0, 0.0, float("inf"), check_batches[0])  # (error / tolerance, error, tolerance, batch), worst
    for b, got, want in zip(check_batches, actual, expected):
        if len(got) != len(want):
            raise ExportCheckError(f"{path}: the export returns {len(got)} outputs, the model {len(want)}")
        for a, e in zip(got, want):
            if tuple(a.shape) != tuple(e.shape):
                raise ExportCheckError(
                    f"{path}: at batch {b} the export returns shape {tuple(a.shape)}, the model {tuple(e.shape)}"
                )
            err = float((a.to(e.device, e.dtype) - e).abs().max()) if e.numel() else 0.0
            tol = check_tolerance(e, dtype)
            ratio = float("inf") if math.isnan(err) else err / tol  # NaN: the worst
            if ratio >= worst[0]:
                worst = (ratio, err, tol, b)
    _, error, tolerance, batch = worst
    if not error <= tolerance:  # also catches NaN
        raise ExportCheckError(
            f"{path}: the {format} export differs from the eager model by up to {error:.3g} "
            f"(max abs) at batch {batch}, above the tolerance {tolerance:.3g}"
        )
    return error, tolerance
