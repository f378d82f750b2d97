"""Causal (masked, App. B.2) lambdas over sequences, in fla's calling convention.

``causal_lambda(q, k, v, emb=None, *, mode="auto", chunk_size=None, initial_state=None, output_final_state=False)``
with ``q [b, n, h, k]``, ``k [b, n, k, u]`` (raw keys: softmax over the prefix per channel), ``v [b, n, v, u]``,
``emb [r, k, u]`` (``emb[j]``: offset ``n - m = j``), output ``[b, n, h, v]``; with ``output_final_state=True`` it
returns ``(o, state)``, and ``initial_state=state`` continues that sequence. Modes:

* ``"naive"``: the definition, position by position (:mod:`.naive`; tests, any dtype).
* ``"chunk"``: the chunked form in PyTorch ops (:mod:`.chunk`; CPU default; float32 compute for half inputs).
* ``"fused_chunk"``: the Triton kernels (:mod:`.fused_chunk`; CUDA default): six launches whatever ``n`` is, no
  host synchronisation, products on the tensor cores with the inputs' dtype as operands.
* ``"fused_recurrent"``: one position at a time with the constant-size state (generation; any length): one Triton
  launch for the whole call where the kernels run and no gradient is needed, else the PyTorch step per position.
* ``"auto"``: ``"fused_chunk"`` where the kernels run (CUDA with Triton) and serve the sizes
  (:data:`~lambdanet.ops.causal_lambda.fused_chunk.LIMITS`: causal scopes up to 64, key depths up to 32, up to 512
  rows of heads x chunk) in float32, bf16 or fp16, else ``"chunk"`` (float64 inputs: the kernels' products are
  float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lambdanet.functional import causal as _causal
from lambdanet.helpers import check_choice, leave_autocast
from lambdanet.ops.causal_lambda import fused_chunk as _fused

__all__ = ["causal_lambda", "MODES", "resolve_mode", "call_mode"]

MODES = ("auto", "naive", "chunk", "fused_chunk", "fused_recurrent")


def resolve_mode(mode: str, device: torch.device | str, *, fits: bool = True) -> str:
    """The mode ``"auto"`` stands for on ``device`` (``fits``: whether the kernels serve the call's sizes,
    :func:`~lambdanet.ops.causal_lambda.fused_chunk.fits`); any other mode is checked and returned."""
    check_choice(mode, "mode", MODES)
    if mode != "auto":
        return mode
    cuda = torch.device(device).type == "cuda"
    return "fused_chunk" if cuda and fits and _fused.available(device)[0] else "chunk"


def call_mode(mode: str, q: Tensor, r: int, chunk_size: int | None = None, dim_u: int = 1) -> str:
    """The mode a call on ``q [b, n, h, k]`` (keys of ``dim_u``) with the causal scope ``r`` runs: ``"auto"``
    resolved on its device and sizes (the kernels where they serve them:
    :func:`~lambdanet.ops.causal_lambda.fused_chunk.fits`), any other mode checked; ``"fused_chunk"`` outside the
    kernels' limits is a one-line error."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    heads, dim_k = int(q.shape[2]), int(q.shape[3])  # ints also where a tracer hands over 0-d tensors
    streams = int(q.shape[0]) * dim_u
    unfit = _fused.fits(heads, dim_k, r, chunk_size or _fused.default_chunk(heads), q.dtype, streams)
    # float64 inputs ask for float64 arithmetic, which the kernels' float32 products do not give: auto takes chunk
    mode = resolve_mode(mode, q.device, fits=unfit is None and q.dtype != torch.float64)
    if mode == "fused_chunk" and unfit:
        raise ValueError(f"mode='fused_chunk' does not serve {unfit}; use mode='chunk' (or 'auto', which does)")
    return mode


def _recurrent(q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, state: dict[str, Tensor]):
    """The recurrent form: the Triton kernel (one launch) where it runs and no gradient is needed, else the
    PyTorch step per position."""
    tensors = [t for t in (q, keys, values, emb) if t is not None]
    if _fused.available(q.device)[0] and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        from lambdanet.ops.causal_lambda.fused_recurrent import fused_recurrent_causal_lambda

        dtype = q.dtype
        return fused_recurrent_causal_lambda(q, keys, values.to(dtype), emb, state)
    # the state receives no gradient, as in every mode (a copy where it was made under inference_mode)
    state = {key: t.detach().clone() if t.is_inference() else t.detach() for key, t in state.items()}
    ys = []
    for t in range(q.shape[1]):
        y, state = _causal.causal_lambda_step(q[:, t], keys[:, t], values[:, t], emb, state)
        ys.append(y)
    dtype = _causal.compute_dtype(q.dtype, keys.dtype, values.dtype)
    out = torch.stack(ys, dim=1) if ys else q.new_zeros(q.shape[0], 0, q.shape[2], values.shape[2], dtype=dtype)
    return out, {key: t.detach() for key, t in state.items()}


def causal_lambda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    emb: Tensor | None = None,
    *,
    mode: str = "auto",
    chunk_size: int | None = None,
    initial_state: dict[str, Tensor] | None = None,
    output_final_state: bool = False,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Causal lambdas ``o [b, n, h, v]`` (see the module docstring); ``(o, final_state)`` if ``output_final_state``.

    Args:
        q: ``[b, n, h, k]`` queries (``h`` heads share one lambda: multi-query).
        k: ``[b, n, k, u]`` raw keys.
        v: ``[b, n, v, u]`` values.
        emb: ``[r, k, u]`` position embeddings of the causal scope ``r``, or ``None`` (content lambdas only).
        mode: ``"auto"``, ``"naive"``, ``"chunk"``, ``"fused_chunk"`` or ``"fused_recurrent"``.
        chunk_size: positions per chunk (``"chunk"``: any positive int, default 64; ``"fused_chunk"``: a power of
            two >= 16, default 32 up to 4 heads, else 16).
        initial_state: the state a previous call returned (the context before ``q[:, 0]``), or ``None``.
        output_final_state: also return the state after the last position.
    """
    _causal._check(q, k, v, emb)
    r = 0 if emb is None else emb.shape[0]
    mode = call_mode(mode, q, r, chunk_size, int(k.shape[3]))
    if mode == "naive" and initial_state is not None:  # checked without reading the state back from the device
        raise ValueError("initial_state must be None with mode='naive' (the definition starts from an empty context)")
    if initial_state is not None:
        _causal.check_state(initial_state, q, k, v, emb)
    else:
        (b, _, _, dk), u, dv = q.shape, k.shape[3], v.shape[2]
        initial_state = _causal.init_causal_lambda_state(b, dk, dv, u, r, device=q.device)
    if mode != "naive" and q.shape[0] * q.shape[1] == 0:
        mode = "chunk"  # an empty batch or sequence: the PyTorch form's empty result, in the graph
    with leave_autocast(q.device.type):  # each mode's own precision rule, also under autocast
        o, state = _run(mode, q, k, v, emb, initial_state, chunk_size, output_final_state)
    o = o.to(q.dtype)  # the inputs' dtype in every mode (fla's convention)
    return (o, state) if output_final_state else o


def _run(mode: str, q: Tensor, k: Tensor, v: Tensor, emb: Tensor | None, initial_state: dict[str, Tensor],
         chunk_size: int | None, output_final_state: bool) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The call in ``mode`` (resolved): ``(o, the state after it)`` (the initial state where none was asked for and
    the kernels made none)."""
    state: dict[str, Tensor] = initial_state
    if mode == "naive":
        o = _causal.causal_lambda_reference(q, k, v, emb)
        if output_final_state:
            _, state = _recurrent(q, k, v, emb, initial_state)
    elif mode == "chunk":
        o, state = _causal.causal_lambda(
            q, k, v, emb, chunk=chunk_size or _causal.DEFAULT_CHUNK, state=initial_state, return_state=True
        )
    elif mode == "fused_recurrent":
        o, state = _recurrent(q, k, v, emb, initial_state)
    else:
        chunk = chunk_size or _fused.default_chunk(q.shape[2])
        o, final = _fused_call(q, k, v, emb, initial_state, chunk, output_final_state)
        state = initial_state if final is None else final
    return o, state


def _fused_call(q, k, v, emb, state, chunk: int, final_state: bool):
    """The kernels (a chunk :func:`call_mode` let through, a non-empty call: :func:`causal_lambda` saw to both)."""
    ok, why = _fused.available(q.device)
    if not ok:
        raise RuntimeError(f"mode='fused_chunk': {why}")
    return _fused.fused_chunk_causal_lambda(q, k, v, emb, state, chunk, final_state)
