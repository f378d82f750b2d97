"""When :mod:`~lambdanet.ops.position_lambda.tuning` may time candidate implementations: never while a compiler,
exporter or tracer runs the code, under deterministic algorithms, a functorch transform, a Python dispatch mode (FLOP
counters, fake tensors), inside a backward pass, on meta tensors or while a CUDA graph is captured."""

from __future__ import annotations

import torch
from torch import Tensor

from lambdanet.helpers import functorch_active

__all__ = ["tracing", "plain_eager", "timing_allowed"]


def tracing() -> bool:
    """Whether a compiler, exporter or tracer is running this code (then nothing is timed)."""
    compiler = torch.compiler
    if compiler.is_compiling() or getattr(compiler, "is_exporting", lambda: False)():
        return True
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return True
    from torch.fx import _symbolic_trace as fx

    return (getattr(fx, "is_fx_symbolic_tracing", None) or fx.is_fx_tracing)()


def plain_eager(*tensors: Tensor, types: tuple[type, ...] = (torch.Tensor,)) -> bool:
    """Whether a call on ``tensors`` runs plainly eager: nothing traces or compiles it, no Python dispatch mode
    (FLOP counters, fake tensors) or functorch transform is active, and every tensor's type is one of ``types``
    (no subclass such as a DTensor)."""
    if tracing():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None or functorch_active():
        return False
    return all(type(t) in types for t in tensors)


def timing_allowed(*tensors: Tensor) -> bool:
    """Whether a forward call on ``tensors`` may be timed now: deterministic algorithms are off, the call is
    :func:`plain_eager` on plain tensors, it does not run inside a backward pass, the tensors are on a real
    device, and no CUDA graph is being captured on their GPU's stream (:func:`_capturing`)."""
    if torch.are_deterministic_algorithms_enabled() or torch._C._current_graph_task_id() != -1:
        return False
    return plain_eager(*tensors) and all(t.device.type != "meta" for t in tensors) and not _capturing(*tensors)


def _capturing(*tensors: Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of a GPU that holds one of ``tensors``
    (``torch.cuda.graph``, ``make_graphed_callables``): a timing there would synchronise the device, which ends
    the capture with CUDA's error, and its candidates' calls would be recorded into the graph."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return True
    return False
