"""The chunked causal lambda as six Triton launches (three forward, three backward) whatever ``n`` is, with no host
synchronisation: ``torch.library`` custom ops with autograd and fake kernels, so eager mode, ``torch.compile``
(``fullgraph=True``) and ``torch.export`` all go through them. The kernels are in
:mod:`lambdanet.ops.causal_lambda.triton_chunk`; they run on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (the tests).

Precision: operands of every product in the inputs' dtype (bf16/fp16 on the tensor cores; float32 inputs keep
float32 products; float64 inputs run float32 products: ``"auto"`` takes the PyTorch ``chunk`` form for them),
float32 accumulation; states, maxima, normalisers and exponents in float32. The output and the gradients come
back in the inputs' dtype.
"""

from __future__ import annotations

import math
import os
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lambdanet.ops.position_lambda.fused import kernels_available as available  # CUDA, or the interpreter
from lambdanet.ops.position_lambda.fused import GRID_Y, on_device

__all__ = ["fused_chunk_causal_lambda", "available", "default_chunk", "fits", "LIMITS"]

DEFAULT_CHUNK = None  # positions per chunk: 32 up to 4 heads, else 16 (a tile of heads x chunk rows <= 128)


def default_chunk(heads: int) -> int:
    """The kernels' chunk for ``heads`` query heads: tiles of at most 128 rows (``heads x chunk``, heads rounded up to
    a power of two) fit a Hopper multiprocessor's shared memory."""
    return 32 if _pow2(heads) <= 4 else 16


# The sizes the kernels serve: tiles of ``heads x chunk`` rows (heads rounded up to a power of two) up to 512, key
# depths up to 32 (float32 operands take twice the bytes: rows x k up to 8192), causal scopes up to 64 (the window
# before a chunk and the position table are [rows, 64] tiles). Their corners compile ahead of time for sm_90 within
# an H100's 227 KB of shared memory (tests/test_ops_causal.py); beyond them a kernel asks more (grad_local: 296 KB at
# 16 heads and r 129; chunk_output 256 KB in float32 at 32 heads and k 32) or ptxas cannot fit an instruction in
# the registers (r 200). Outside them "auto" takes the PyTorch chunk form.
LIMITS = {"rows": 512, "dim_k": 32, "r": 64, "rows_x_k_float32": 8192}


def fits(heads: int, dim_k: int, r: int, chunk: int, dtype: torch.dtype, streams: int = 1) -> str | None:
    """``None`` where the kernels serve these sizes (:data:`LIMITS`; chunks of a power of two >= 16; ``streams``:
    batch x ``dim_u``, the second axis of the chunk kernels' grids), else what exceeds them (one line)."""
    if streams > GRID_Y:
        return f"batch x dim_u = {streams} streams (at most {GRID_Y}: a CUDA grid's second axis)"
    if chunk < 16 or chunk & (chunk - 1):
        return f"chunk_size={chunk} (chunk_size must be a power of two >= 16)"
    rows = _pow2(heads) * chunk
    if r > LIMITS["r"]:
        return f"r={r} (at most {LIMITS['r']})"
    if dim_k > LIMITS["dim_k"]:
        return f"dim_k={dim_k} (at most {LIMITS['dim_k']})"
    if rows > LIMITS["rows"]:
        return f"heads={heads} with chunk_size={chunk} ({rows} rows of heads x chunk, at most {LIMITS['rows']})"
    if dtype not in (torch.bfloat16, torch.float16) and rows * _pow2(dim_k, 16) > LIMITS["rows_x_k_float32"]:
        name, most = str(dtype).removeprefix("torch."), LIMITS["rows_x_k_float32"]
        return (f"{name} inputs at heads={heads}, chunk_size={chunk}, dim_k={dim_k} (float32 operands: {rows} rows x "
                f"{_pow2(dim_k, 16)} key channels, at most {most}; bf16 / fp16 inputs fit)")  # fmt: skip
    return None


def _pow2(x: int, least: int = 1) -> int:
    return max(least, 1 << max(x - 1, 0).bit_length())


def _meta(q: Tensor, keys: Tensor, values: Tensor, r: int, chunk: int) -> dict:
    import triton.language as tl

    (B, n, H, K), U, V = q.shape, keys.shape[3], values.shape[2]
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
    if dt == tl.bfloat16 and q.device.type == "cpu":  # Triton's interpreter multiplies bf16 operands wrongly
        dt = tl.float32
    return dict(B=B, n=n, N=-(-n // chunk), r=r, **_tiles(H, K, V, U, r, chunk), DT=dt,
                PREC="ieee" if dt == tl.float32 else "tf32")  # fmt: skip


def _tiles(H: int, K: int, V: int, U: int, r: int, C: int) -> dict:
    """The kernels' sizes that do not depend on the sequence: the layer's, padded to tiles (heads ``HP``, key
    channels ``KP``, position table ``RP``), the earlier chunks a scope reaches (``P``) and ``WP``, the positions
    before a chunk that it reaches (``r - 1``) as a power of two >= 16. (``r`` itself is a runtime argument.)"""
    return dict(H=H, K=K, V=V, U=U, C=C, HP=_pow2(H), KP=_pow2(K, 16), RP=_pow2(r, 16),
                P=-(-(r - 1) // C) if r > 1 else 0, WP=_pow2(r - 1, 16))  # fmt: skip


def _consts(m: dict, *names: str) -> dict:
    return {name: m[name] for name in names}


KERNELS = ("chunk_sums", "state_scan", "chunk_output", "grad_local", "grad_scan", "grad_keys_values")
SCANS = ("state_scan", "grad_scan")


# Each kernel's launch settings (warps, block_v, stages) at 128 rows of heads x chunk, chosen on an H100 at
# lambda_lm_base's layer in bf16 (8 heads, k 16, v 208, r 64; n 2048 x 32 and 32768 x 2) from a sweep of 16 settings
# per kernel (lambdanet bench causal_tune; docs/bench/lm_gpu/NOTES.md): with the old uniform (4, 64, 1) and scans
# (4, 64, 4), forward + backward took 4.70 / 5.73 ms; with these 4.12 / 4.20 ms.
SETTINGS = {
    "chunk_sums": (4, 256, 1),
    "state_scan": (4, 16, 16),  # 13 programs per stream instead of 4: 0.50 -> 0.25 ms at 32768 x 2
    "chunk_output": (4, 128, 1),
    "grad_local": (8, 256, 1),
    "grad_scan": (1, 8, 8),  # 26 programs per stream: 0.51 -> 0.24 ms at 32768 x 2
    "grad_keys_values": (4, 256, 1),  # 1.80 -> 1.02 ms
}


def _settings() -> dict[str, tuple[int, int, int]]:
    """Each kernel's launch settings ``(warps, block_v, stages)`` (:data:`SETTINGS`): ``warps`` for a tile of 128
    rows of heads x chunk (the product kernels scale them with the rows, 1 to 16; 0: 4, scaled alike);
    ``block_v`` the value columns a product kernel takes per step, or a scan program owns (the scans run
    ``b x u x v / block_v`` programs, each walking the chunks one after another: a small block gives them more of
    the GPU at long n and small b); ``stages`` the software-pipelining depth. Knobs for measuring variants, read
    at the first launch (:func:`tune`): ``LAMBDANET_CAUSAL_{WARPS,BLOCK_V,STAGES}`` (all product kernels),
    ``LAMBDANET_CAUSAL_SCAN_{WARPS,BLOCK_V,STAGES}`` (both scans), then
    ``LAMBDANET_CAUSAL_TUNE="grad_local=8,128,1;..."`` per kernel."""
    env = os.environ.get
    out = dict(SETTINGS)
    products = tuple(k for k in KERNELS if k not in SCANS)
    for prefix, names in (("LAMBDANET_CAUSAL_", products), ("LAMBDANET_CAUSAL_SCAN_", SCANS)):
        for i, knob in enumerate(("WARPS", "BLOCK_V", "STAGES")):
            if env(prefix + knob):
                value = _knob(prefix + knob, cast(str, env(prefix + knob)), i)
                for name in names:
                    setting = list(out[name])
                    setting[i] = value
                    out[name] = (setting[0], setting[1], setting[2])
    for item in filter(None, env("LAMBDANET_CAUSAL_TUNE", "").replace(" ", "").split(";")):
        name, _, vals = item.partition("=")
        parts = vals.split(",")
        if name not in KERNELS or len(parts) != 3:
            raise ValueError(f"LAMBDANET_CAUSAL_TUNE must be 'kernel=warps,block_v,stages;...' with a kernel of "
                             f"{', '.join(KERNELS)}, got {item!r}")  # fmt: skip
        w, bv, st = (_knob(f"LAMBDANET_CAUSAL_TUNE ({name})", x, i) for i, x in enumerate(parts))
        out[name] = (w, bv, st)
    return out


def _knob(var: str, text: str, which: int) -> int:
    """One launch setting read from the environment variable ``var``: ``which`` 0 warps (0: by the tile, else a
    power of two up to 32), 1 block_v (a power of two), 2 stages (>= 1); a one-line error naming ``var``."""
    expected = ("0 or a power of two up to 32 (warps)", "a power of two (block_v)", "a positive int (stages)")[which]
    try:
        value = int(text)
    except ValueError:
        value = -1
    ok = (value == 0 or (0 < value <= 32 and not value & (value - 1)), value > 0 and not value & (value - 1), value > 0)
    if not ok[which]:
        raise ValueError(f"{var} must be {expected}, got {text!r}")
    return value


TUNE: dict[str, tuple[int, int, int]] = {}  # the settings in use: filled at the first launch by tune()


def tune() -> dict[str, tuple[int, int, int]]:
    """The launch settings in use (:data:`TUNE`), read from :data:`SETTINGS` and the environment at the first
    launch, not at import (a bad knob fails the op with its one-line error, not ``import lambdanet``)."""
    if not TUNE:
        TUNE.update(_settings())
    return TUNE


def _launch(m: dict, name: str) -> tuple[dict, dict]:
    """``(constexprs BV / SCAN_STAGES, launch options)`` of kernel ``name`` at the sizes ``m``."""
    import triton.language as tl

    warps, bv, stages = tune()[name]
    bv = min(bv, _pow2(m["V"], 16 if name not in SCANS else 1))
    if name not in SCANS and name != "chunk_sums":  # a product kernel's [rows, block_v] tiles stay within what was
        # measured at 128 rows (the chunk sums' tiles are [k, block_v] whatever the heads):
        # 128 x 256 for half operands, 128 x 64 for float32 (twice the bytes and IEEE products: at 256 columns
        # grad_keys_values would ask 295 KB of shared memory at 16 heads, an H100 has 227 KB)
        rows = m["HP"] * m["C"]
        bv = min(bv, max(16, (8192 if m["DT"] == tl.float32 else 32768) // rows))
        warps = min(16, max(1, (warps or 4) * rows // 128))  # the same rows per warp as measured
    if name in SCANS:
        return {"BV": bv, "SCAN_STAGES": stages}, {"num_warps": warps or 4}
    options = {"num_warps": warps or 4, "num_stages": stages}
    if name != "chunk_sums" and m["DT"] == tl.float32 and torch.version.hip is None:  # float32 operands, NVIDIA:
        # all the registers a thread may have at these warps (65,536 a multiprocessor). Left to itself, ptxas gave
        # chunk_output and grad_local 32 and a 10 KB stack (sm_90: 10,212 and 4,976 local loads; with the cap 1,587
        # and 705, and half the instructions). Half precision takes 255 by itself; the cap there reshuffles its
        # spills, so it stays as measured.
        options["maxnreg"] = min(255, 65536 // (32 * options["num_warps"]))
    return {"BV": bv}, options


def _safe(text: str | None) -> float:
    """The kernels' ``SAFE`` (:mod:`.triton_weights`): how far a query's running maximum may lie below its chunk's
    largest key for the chunk's content weights to factor against that key (products) instead of a loop over
    channels: ``MAX_SPREAD``, the PyTorch chunk form's limit for the same factoring. ``LAMBDANET_CAUSAL_SAFE``
    lowers it, for measuring the loop (``-inf``: every chunk loops); a higher one is refused."""
    from lambdanet.functional.causal import MAX_SPREAD as SAFE

    if text is None:
        return SAFE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value <= SAFE:
        raise ValueError(f"LAMBDANET_CAUSAL_SAFE must be a number <= {SAFE:g} (-inf: the channel loop in every "
                         f"chunk), got {text!r}")  # fmt: skip
    return value


# the constexprs each kernel takes from a call's sizes (:func:`_meta`), besides its launch settings
_PRODUCT = ("H", "HP", "K", "V", "U", "C", "KP", "RP", "P", "WP", "DT", "PREC", "HAS_EMB", "SAFE")
_CONSTS = {"chunk_sums": ("K", "V", "U", "C", "KP", "DT", "PREC"), "state_scan": ("K", "V", "KP"),
           "chunk_output": _PRODUCT, "grad_local": _PRODUCT, "grad_scan": ("K", "V", "KP"),
           "grad_keys_values": _PRODUCT}  # fmt: skip
_PLANS: dict[tuple, tuple[dict, dict[str, dict]]] = {}


def _plan(q: Tensor, keys: Tensor, values: Tensor, r: int, has_emb: bool, chunk: int) -> tuple[dict, dict[str, dict]]:
    """``(m, kw)``: a call's sizes (:func:`_meta`) and each kernel's keyword arguments (constexprs and launch
    options), made once per shapes, dtype, device type and launch settings: a call then spends its host time on
    its launches, not on recomputing them (the GPU waits on the host between short kernels)."""
    safe = os.environ.get("LAMBDANET_CAUSAL_SAFE") or None  # empty: unset, as the other knobs
    key = (q.shape, keys.shape, values.shape, q.dtype, q.device.type, r, has_emb, chunk, tuple(tune().values()), safe)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:  # many shapes (generation's growing prompts): start over rather than grow
            _PLANS.clear()
        m = {**_meta(q, keys, values, r, chunk), "HAS_EMB": has_emb, "SAFE": _safe(safe)}
        kw = {}
        for name in KERNELS:
            consts, options = _launch(m, name)
            kw[name] = {**_consts(m, *_CONSTS[name]), **consts, **options}
        plan = _PLANS[key] = (m, kw)
    return plan


def _forward_impl(
    q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, S0: Tensor, z0: Tensor, c0: Tensor, win: Tensor,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The forward's three launches: ``(y, Sb, cb, zb)`` (the states before each chunk and after the last)."""
    from lambdanet.ops.causal_lambda import triton_chunk as T

    r = 0 if emb is None else emb.shape[0]
    m, kw = _plan(q, keys, values, r, emb is not None, chunk)
    BU, N1, dev = m["B"] * m["U"], m["N"] + 1, q.device
    f32: dict[str, Any] = dict(device=dev, dtype=torch.float32)
    amax, lsum = torch.empty(BU, N1, m["K"], **f32), torch.empty(BU, N1, m["K"], **f32)
    cb, zb = torch.empty(BU, N1, m["K"], **f32), torch.empty(BU, N1, m["K"], **f32)
    Sb = torch.empty(BU, N1, m["K"], m["V"], **f32)  # chunk sums, then the state before each chunk
    grid, scan = (m["N"], BU), kw["state_scan"]
    y = torch.empty(m["B"], m["U"], m["n"], m["H"], m["V"], device=dev, dtype=q.dtype if m["U"] == 1 else torch.float32)
    e = q if emb is None else emb
    with on_device(dev):  # the tensors' GPU and stream, whichever is current
        T._chunk_sums[grid](keys, values, amax, lsum, Sb, m["n"], N1, **kw["chunk_sums"])
        T._state_scan[(BU, -(-m["V"] // scan["BV"]))](amax, lsum, cb, zb, Sb, S0, z0, c0, m["N"], N1, **scan)
        T._chunk_output[grid](q, keys, values, e, win, cb, zb, Sb, y, m["n"], r, N1, **kw["chunk_output"])
    return y.sum(1).to(q.dtype) if m["U"] > 1 else y[:, 0], Sb, cb, zb


@torch.library.custom_op("lambdanet::causal_lambda_chunk_fwd", mutates_args=())
def _forward(
    q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, S0: Tensor, z0: Tensor, c0: Tensor, win: Tensor,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return _forward_impl(q, keys, values, emb, S0, z0, c0, win, chunk)


@_forward.register_fake
def _(q, keys, values, emb, S0, z0, c0, win, chunk):
    (B, n, H, K), U, V = q.shape, keys.shape[3], values.shape[2]
    N1 = -(-n // chunk) + 1
    f32: dict[str, Any] = dict(device=q.device, dtype=torch.float32)
    y = q.new_empty(B, n, H, V)
    return y, torch.empty(B * U, N1, K, V, **f32), torch.empty(B * U, N1, K, **f32), torch.empty(B * U, N1, K, **f32)


def _backward_impl(
    dy: Tensor, q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, win: Tensor, Sb: Tensor, cb: Tensor,
    zb: Tensor, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward's three launches: ``(dq, dkeys, dvalues, demb)`` (``demb`` empty without ``emb``)."""
    from lambdanet.ops.causal_lambda import triton_chunk as T

    r = 0 if emb is None else emb.shape[0]
    m, kw = _plan(q, keys, values, r, emb is not None, chunk)
    B, U, N, K = m["B"], m["U"], m["N"], m["K"]
    BU, N1, dev, dy = B * U, N + 1, q.device, dy.contiguous()
    f32: dict[str, Any] = dict(device=dev, dtype=torch.float32)
    dq = torch.empty(B, U, m["n"], m["H"], K, device=dev, dtype=q.dtype if U == 1 else torch.float32)
    rho = torch.empty(BU, m["n"], K, **f32)
    G, g, dzb = torch.empty(BU, N1, K, m["V"], **f32), torch.empty(BU, N1, K, **f32), torch.empty(BU, N1, K, **f32)
    # every (stream, chunk) program writes its k x RP block: no zero fill (~17 MB a layer at 2048 x 32)
    demb = torch.empty(BU, N, K, m["RP"], **f32) if emb is not None else q.new_zeros(0)
    e, grid, scan = q if emb is None else emb, (N, BU), kw["grad_scan"]
    dkeys, dvalues = torch.empty_like(keys), torch.empty_like(values)
    with on_device(dev):  # as in _forward_impl
        T._grad_local[grid](q, keys, values, e, win, cb, zb, Sb, dy, dq, rho, G, g, demb, m["n"], r, N, N1,
                            **kw["grad_local"])  # fmt: skip
        T._grad_scan[(BU, -(-m["V"] // scan["BV"]))](cb, G, g, dzb, N, N1, **scan)
        T._grad_keys_values[grid](q, keys, values, e, win, cb, zb, dy, rho, G, dzb, dkeys, dvalues, m["n"], r, N1,
                                  **kw["grad_keys_values"])  # fmt: skip
    dq = dq.sum(1).to(q.dtype) if U > 1 else dq[:, 0]
    if emb is not None:
        # r k u, contiguous as the fake kernel says (compiled graphs check the strides a custom op returns)
        demb = demb.view(B, U, N, K, m["RP"])[..., :r].sum(dim=(0, 2)).permute(2, 1, 0).to(emb.dtype).contiguous()
    return dq, dkeys, dvalues, demb


@torch.library.custom_op("lambdanet::causal_lambda_chunk_bwd", mutates_args=())
def _backward(
    dy: Tensor, q: Tensor, keys: Tensor, values: Tensor, emb: Tensor | None, win: Tensor, Sb: Tensor, cb: Tensor,
    zb: Tensor, chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return _backward_impl(dy, q, keys, values, emb, win, Sb, cb, zb, chunk)


@_backward.register_fake
def _(dy, q, keys, values, emb, win, Sb, cb, zb, chunk):
    demb = q.new_zeros(0) if emb is None else torch.empty_like(emb)
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values), demb


def _setup_context(ctx, inputs, output):
    q, keys, values, emb, _, _, _, win, chunk = inputs
    _, Sb, cb, zb = output
    ctx.save_for_backward(q, keys, values, emb, win, Sb, cb, zb)
    ctx.chunk, ctx.has_emb = chunk, emb is not None


def _gradients(ctx, dy, backward):
    """The inputs' gradients from what :func:`_setup_context` saved, by ``backward`` (the custom op, or its body)."""
    q, keys, values, emb, win, Sb, cb, zb = ctx.saved_tensors
    dq, dkeys, dvalues, demb = backward(dy, q, keys, values, emb if ctx.has_emb else None, win, Sb, cb, zb, ctx.chunk)
    return dq, dkeys, dvalues, (demb if ctx.has_emb else None), None, None, None, None, None


def _grad(ctx, dy, *_):
    return _gradients(ctx, dy, _backward)


_forward.register_autograd(_grad, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same launches as the custom ops, for plain eager calls (:func:`_eager`): ``torch.library``'s dispatch of
    a custom op with autograd costs host time on every call (its schema's defaults, a redispatch below autograd,
    dynamo's guard around the kernel), during which a GPU that finished the last kernel waits. Compilers,
    exporters, tracers and dispatch modes get the custom ops, which they can see into."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _forward_impl(*inputs)
        _setup_context(ctx, inputs, out)
        ctx.mark_non_differentiable(*out[1:])  # the state receives no gradient
        ctx.set_materialize_grads(False)  # and no zeros are made for it ([b u, N + 1, k, v] in float32)
        return out

    @staticmethod
    @once_differentiable  # the kernels have no backward of their own (as the custom op, which has none registered)
    def backward(ctx, dy, *_):
        return _gradients(ctx, dy, _backward_impl)


def _eager(*tensors: Tensor) -> bool:
    """Whether a call on ``tensors`` is plain eager (then :class:`_Eager` runs it): a parameter (the position
    table) counts as a plain tensor."""
    from lambdanet.ops.position_lambda.guard import plain_eager

    return plain_eager(*tensors, types=(torch.Tensor, torch.nn.Parameter))


def fused_chunk_causal_lambda(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    emb: Tensor | None,
    state: dict[str, Tensor],
    chunk: int | None = None,
    final_state: bool = True,
) -> tuple[Tensor, dict[str, Tensor] | None]:
    """``q [b, n, h, k]``, ``keys [b, n, k, u]``, ``values [b, n, v, u]``, ``emb [r, k, u]`` or ``None``, the state
    before the sequence (``S [b, u, k, v]``, ``z``, ``c [b, u, k]``, ``window [b, u, r - 1, v]``, float32) ->
    ``(y [b, n, h, v], state after)``; ``y`` in the inputs' dtype. The state receives no gradient. With
    ``final_state=False`` the state after is ``None`` (its window and casts are not made: a training step's)."""
    dtype, chunk = q.dtype, chunk or default_chunk(q.shape[2])
    # keys keep their dtype (float32 keys, e.g. with decay offsets, enter the exponent unrounded)
    q, keys, values = q.contiguous(), keys.contiguous(), values.to(dtype).contiguous()
    emb = None if emb is None else emb.to(dtype).contiguous()
    S0, z0, c0 = (state[key].detach().float().contiguous() for key in ("S", "z", "c"))
    win = state["window"].detach().to(dtype).contiguous()
    run = _Eager.apply if _eager(q, keys, values, *([] if emb is None else [emb])) else _forward
    y, Sb, cb, zb = run(q, keys, values, emb, S0, z0, c0, win if win.numel() else q.new_zeros(1), chunk)
    if not final_state:
        return y, None
    (b, _, _, k), u, v = q.shape, keys.shape[3], values.shape[2]
    keep = win.shape[2]  # the window: the last r - 1 values (only those are copied, not the whole sequence)
    last = values.detach()[:, values.shape[1] - min(keep, values.shape[1]) :].permute(0, 3, 1, 2)  # b u t v
    full = torch.cat([win, last], dim=2)
    final = {  # the carried state receives no gradient, whichever path ran (the eager one marks it so)
        "S": Sb[:, -1].detach().reshape(b, u, k, v),
        "z": zb[:, -1].detach().reshape(b, u, k),
        "c": cb[:, -1].detach().reshape(b, u, k),
        "window": full[:, :, full.shape[2] - win.shape[2] :].float(),
    }
    return y, final


def compile_report(
    arch: int = 90,
    *,
    heads: int = 8,
    dim_k: int = 16,
    dim_v: int = 208,
    r: int = 64,
    chunk: int | None = None,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> list[dict]:
    """Compile the six kernels ahead of time for CUDA compute capability ``arch`` (no GPU needed: Triton's bundled
    ``ptxas`` and ``nvdisasm``) at one layer's sizes (default: ``lambda_lm_base``), in float32 and bf16: per kernel
    the matrix-unit instructions in the PTX, the register spills in the machine code (``LDL`` / ``STL``), shared
    memory and compile seconds. Run it without
    ``TRITON_INTERPRET`` (the interpreter has no compiler)."""
    import time

    import triton.language as tl

    from lambdanet.ops.aot import compile_counts
    from lambdanet.ops.causal_lambda import triton_chunk as T

    C = chunk or default_chunk(heads)
    m = dict(**_tiles(heads, dim_k, dim_v, 1, r, C), HAS_EMB=r > 0, SAFE=_safe(None))
    f32 = {"amax", "lsum", "cb", "zb", "Sb", "S0", "z0", "c0", "G", "g", "dzb", "rho", "demb"}
    rows = []
    for name in KERNELS:
        fn = getattr(T, "_" + name)
        for label, dt in ((d, {"fp32": tl.float32, "bf16": tl.bfloat16}[d]) for d in dtypes):
            launch, opts = _launch({**m, "DT": dt}, name)
            consts = {k: v for k, v in {**m, **launch, "DT": dt, "PREC": "ieee" if label == "fp32" else "tf32"}.items()
                      if k in fn.arg_names}  # fmt: skip
            sig = {a: "constexpr" if a in consts else "i32" if a in ("n", "r", "N", "N1") else
                   "*fp32" if a in f32 else f"*{label}" for a in fn.arg_names}  # fmt: skip
            t0 = time.perf_counter()
            counts = compile_counts(fn, sig, consts, arch, **opts)[1]
            rows.append({"kernel": name, "dtype": label, "num_warps": opts["num_warps"], "block_v": consts["BV"],
                         **counts, "compile_s": round(time.perf_counter() - t0, 2)})  # fmt: skip
    return rows
