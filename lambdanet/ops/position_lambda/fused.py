"""``torch.library`` custom ops around the Triton position kernels (:mod:`.triton_position`), with autograd and
fake (meta) kernels, so that eager mode, ``torch.compile`` and ``torch.export`` all go through them:
``lambda_position_output(q, values, table, center, spatial)`` is what ``LambdaLayer(impl="triton")`` runs.
Triton is imported only when an op runs: on a CUDA device, or on CPU tensors under ``TRITON_INTERPRET=1``
(Triton's interpreter; set it before the first run in the process).

Op ``lambdanet::lambda_position_output(q, values, table, center0, center1, height, width) -> y``:
``q [b, n, h, k]``, ``values [b, n, v, u]``, ``table [k, u, T0, T1]`` (offset zero at ``(center0, center1)``)
-> ``y [b, n, h, v]`` in ``q``'s dtype (fp32 accumulation). 1-d inputs are maps of height 1.
Op ``lambdanet::lambda_position_output_backward(grad, q, values, table, ...) -> (dq, dvalues, dtable)``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["lambda_position_output", "lambda_position_output_reference", "kernels_available"]


def kernels_available(device: torch.device | str) -> tuple[bool, str]:
    """``(True, "")`` if the Triton kernels can run on ``device``, else ``(False, why)``."""
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "Triton is not installed (pip install triton)"
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return True, ""
    return False, (
        f"the Triton kernels run on CUDA devices (or on CPU tensors under TRITON_INTERPRET=1), got {device.type}"
    )


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a launch on ``device``'s tensors runs in: Triton launches on the *current* CUDA device and its
    stream, so a tensor on another GPU would be read from the wrong device, unordered with its own stream's work
    (an illegal address, or a race where peer access is on); ``device`` is made current. Nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check(device: torch.device) -> None:
    ok, why = kernels_available(device)
    if not ok:
        raise RuntimeError(f"impl='triton': {why}")


@torch.library.custom_op("lambdanet::lambda_position_output", mutates_args=())
def _position_output(
    q: Tensor, values: Tensor, table: Tensor, center0: int, center1: int, height: int, width: int
) -> Tensor:
    from lambdanet.ops.position_lambda.triton_position import launch_forward

    _check(q.device)
    q, values, table = q.contiguous(), values.contiguous(), table.contiguous()
    out = q.new_empty(*q.shape[:3], values.shape[2])  # b n h v
    with on_device(q.device):
        return launch_forward(q, values, table, (center0, center1), (height, width), out)


@_position_output.register_fake
def _(q, values, table, center0, center1, height, width):
    return q.new_empty(*q.shape[:3], values.shape[2])  # b n h v


@torch.library.custom_op("lambdanet::lambda_position_output_backward", mutates_args=())
def _position_output_backward(
    grad: Tensor, q: Tensor, values: Tensor, table: Tensor, center0: int, center1: int, height: int, width: int
) -> tuple[Tensor, Tensor, Tensor]:
    from lambdanet.ops.position_lambda.triton_position import launch_backward

    _check(q.device)
    grad, q, values, table = grad.contiguous(), q.contiguous(), values.contiguous(), table.contiguous()
    f32: dict[str, Any] = dict(device=q.device, dtype=torch.float32)
    dq, dvalues, dtable = torch.zeros(q.shape, **f32), torch.zeros(values.shape, **f32), torch.zeros(table.shape, **f32)
    with on_device(q.device):
        launch_backward(grad, q, values, table, (center0, center1), (height, width), dq, dvalues, dtable)
    return dq.to(q.dtype), dvalues.to(values.dtype), dtable.to(table.dtype)


@_position_output_backward.register_fake
def _(grad, q, values, table, center0, center1, height, width):
    return torch.empty_like(q), torch.empty_like(values), torch.empty_like(table)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])  # q, values, table
    ctx.geometry = inputs[3:]


def _backward(ctx, grad):
    q, values, table = ctx.saved_tensors
    dq, dvalues, dtable = _position_output_backward(grad, q, values, table, *ctx.geometry)
    return dq, dvalues, dtable, None, None, None, None


_position_output.register_autograd(_backward, setup_context=_setup_context)


def _geometry(center: Sequence[int], spatial: Sequence[int]) -> tuple[int, int, int, int]:
    if len(spatial) == 1:
        return 0, int(center[0]), 1, int(spatial[0])
    if len(spatial) == 2:
        return int(center[0]), int(center[1]), int(spatial[0]), int(spatial[1])
    raise ValueError(f"impl='triton' serves 1-d and 2-d inputs, got {len(spatial)} spatial dims")


def lambda_position_output(
    q: Tensor, values: Tensor, table: Tensor, center: Sequence[int], spatial: Sequence[int]
) -> Tensor:
    """Position output ``y[b, n, h, v] = sum_{m, u} (q[b, n, h] . R[:, u, off(n, m)]) V[b, m, v, u]``.

    Args:
        q: queries ``[b, n, h, k]`` (``n = prod(spatial)``, row-major).
        values: normalised values ``[b, n, v, u]``.
        table: relative embeddings ``[k, u, *T]`` (1-d: ``[k, u, T]``; 2-d: ``[k, u, T0, T1]``); entries
            outside the table are zero (a local scope), a ``2 s - 1`` table covers a global context.
        center: per axis, the table index of offset zero (``T // 2``; ``T - 1`` for causal tables).
        spatial: the input's spatial size (1 or 2 dims).
    """
    _check_shapes(q, values, table, center, spatial)
    c0, c1, height, width = _geometry(center, spatial)
    table = table.unsqueeze(2) if len(spatial) == 1 else table  # k u T0 T1 (1-d: k u 1 T)
    return _position_output(q, values, table, c0, c1, height, width)


GRID_Y = 65535  # the most programs a CUDA grid's second (and third) axis holds (the first: 2^31 - 1)


def _check_shapes(q: Tensor, values: Tensor, table: Tensor, center: Sequence[int], spatial: Sequence[int]) -> None:
    """A one-line ``ValueError`` naming the argument whose shape does not fit the others (the kernels index the
    buffers by these sizes: a mismatch would read past them)."""
    n = math.prod(int(s) for s in spatial)
    got = (f"q {tuple(q.shape)}, values {tuple(values.shape)}, table {tuple(table.shape)}, center {tuple(center)}, "
           f"spatial {tuple(spatial)}")  # fmt: skip
    if q.dim() != 4 or values.dim() != 4 or table.dim() != 2 + len(spatial) or len(center) != len(spatial):
        problem = (f"q [b, n, h, k], values [b, n, v, u], table [k, u, *T] of {len(spatial)} table dims and a "
                   "center per spatial dim expected")  # fmt: skip
    elif q.shape[1] != n or values.shape[:2] != q.shape[:2]:
        problem = f"q and values need [b, n] with n = prod(spatial) = {n} and the same b"
    elif table.shape[0] != q.shape[3] or table.shape[1] != values.shape[3]:
        problem = "table needs [k, u, ...] with q's k and values' u"
    elif any(not 0 <= int(c) < t for c, t in zip(center, table.shape[2:])):
        problem = f"center {tuple(center)} must index the table's {tuple(table.shape[2:])} entries"
    elif q.shape[0] > GRID_Y:  # the kernels' grids hold the batch on their second axis
        problem = f"a batch b of at most {GRID_Y} (a CUDA grid's second axis; split the batch)"
    else:
        return
    raise ValueError(f"lambda_position_output: {problem}; got {got}")


def lambda_position_output_reference(
    q: Tensor, values: Tensor, table: Tensor, center: Sequence[int], spatial: Sequence[int]
) -> Tensor:
    """The same function computed plainly in PyTorch (materialises ``E[n, m]``; for tests)."""
    c0, c1, height, width = _geometry(center, spatial)
    t = table.unsqueeze(2) if len(spatial) == 1 else table  # k u T0 T1
    ii, jj = torch.meshgrid(torch.arange(height, device=q.device), torch.arange(width, device=q.device), indexing="ij")
    ii, jj = ii.reshape(-1), jj.reshape(-1)
    di = ii[None, :] - ii[:, None] + c0  # n m
    dj = jj[None, :] - jj[:, None] + c1
    valid = (di >= 0) & (di < t.shape[2]) & (dj >= 0) & (dj < t.shape[3])
    e = t[:, :, di.clamp(0, t.shape[2] - 1), dj.clamp(0, t.shape[3] - 1)] * valid  # k u n m
    return torch.einsum("bnhk,kunm,bmvu->bnhv", q, e.to(q.dtype), values)
