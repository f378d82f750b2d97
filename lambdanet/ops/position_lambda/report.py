"""Ahead-of-time compilation of the position kernels for a GPU without one: per kernel and dtype the matrix-unit
instructions, the register spills read from the machine code and the shared memory (the tests hold them)."""

from __future__ import annotations

from lambdanet.ops.aot import compile_counts
from lambdanet.ops.position_lambda import triton_position as P
from lambdanet.ops.position_lambda.triton_table import _backward_table

__all__ = ["compile_report"]

# the kernels by label; their signatures come from the kernels themselves (pointers, ints, constexprs)
_KERNELS = {"forward": P._forward, "backward_q": P._backward_q, "backward_kv": P._backward_kv,
            "backward_table": _backward_table}  # fmt: skip
_FP32_OUT = ("dq_ptr", "dv_ptr", "part_ptr")  # the gradients' fp32 buffers


def compile_report(
    arch: int = 90,
    *,
    block_h: int = 4,
    block_v: int = 64,
    num_warps: int | None = None,
    table_vc: int = P.TABLE_VC,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    kernels: tuple[str, ...] | None = None,
) -> list[dict]:
    """Compile every kernel ahead of time for CUDA compute capability ``arch`` (no GPU needed: Triton's
    bundled ``ptxas`` and ``nvdisasm``), per dtype: the matrix-unit instructions in the PTX, the register
    spills in the machine code (``LDL`` / ``STL`` in the SASS: spills are ptxas's, the PTX cannot show them)
    and shared memory. ``num_warps``: each kernel's launch setting (4; the table gradient ``TABLE_WARPS``)
    unless given; ``kernels``: a subset of ``forward``, ``backward_q``, ``backward_kv``, ``backward_table``. Run it
    without ``TRITON_INTERPRET`` (the interpreter has no compiler)."""
    rows = []
    for label, fn in _KERNELS.items():
        if kernels is not None and label not in kernels:
            continue
        table = label == "backward_table"
        for dtype in dtypes:
            consts = dict(
                BLOCK_N=P.BLOCK_N,
                BLOCK_M=P.BLOCK_M,
                BLOCK_H=block_h,
                BLOCK_V=block_v,
                HALF_DOT=dtype != "fp32",
                F32_DOT="ieee",
            )
            if table:
                consts |= dict(BLOCK_K=16, BLOCK_T=P.BLOCK_T, BLOCK_VC=table_vc)
            sig = {a: "constexpr" if a in consts else "*fp32" if a in _FP32_OUT else f"*{dtype}" if a.endswith("_ptr")
                   else "i32" for a in fn.arg_names}  # fmt: skip
            warps = num_warps or (P.TABLE_WARPS if table else 4)
            options = P.registers(dtype != "fp32") if label == "backward_q" else {}  # as launched
            kernel, counts = compile_counts(fn, sig, consts, arch, num_warps=warps, **options)
            rows.append(
                {"kernel": label, "dtype": dtype, "num_warps": warps, **counts, "cubin_bytes": len(kernel.asm["cubin"])}
            )
    return rows
