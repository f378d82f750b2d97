"""Ahead-of-time compilation of a Triton kernel for a GPU without one (Triton's bundled ``ptxas``, ``nvdisasm`` and
``cuobjdump``), and what the kernels' ``compile_report`` functions count in it: one place for how matrix-unit
instructions, register spills, registers and the occupancy they allow are read."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

__all__ = ["compile_counts", "occupancy"]

# Per compute capability: registers per multiprocessor, most resident warps, most resident blocks, shared memory
# per multiprocessor (bytes; each block also takes 1 KiB the system reserves). NVIDIA's CUDA C++ Programming Guide,
# "Features and Technical Specifications" (8.0 A100, 8.9 Ada, 9.0 H100 / H200).
_SM = {
    80: (65536, 64, 32, 167936),
    86: (65536, 48, 16, 102400),
    89: (65536, 48, 24, 102400),
    90: (65536, 64, 32, 233472),
}


def occupancy(registers: int, num_warps: int, shared_bytes: int, arch: int = 90) -> dict[str, Any]:
    """The blocks and warps one multiprocessor of compute capability ``arch`` holds at once, for a kernel of
    ``registers`` per thread, ``num_warps`` warps per block and ``shared_bytes`` of dynamic shared memory per
    block: ``{"blocks_per_sm", "warps_per_sm", "limit"}`` (``limit``: what binds, ``"registers"``, ``"shared"``,
    ``"warps"`` or ``"blocks"``). Registers are allocated per warp in units of 256 (8 per thread), as the CUDA
    occupancy calculator does. A kernel that holds few warps per multiprocessor hides little latency: every warp
    waits on its own loads and barriers."""
    if arch not in _SM:
        raise ValueError(f"arch must be one of {sorted(_SM)} (compute capability x 10), got {arch}")
    regs_sm, warps_sm, blocks_sm, shared_sm = _SM[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = {
        "registers": regs_sm // (per_warp * num_warps),
        "shared": shared_sm // (shared_bytes + 1024),
        "warps": warps_sm // num_warps,
        "blocks": blocks_sm,
    }
    limit = min(limits, key=lambda k: limits[k])
    return {"blocks_per_sm": limits[limit], "warps_per_sm": limits[limit] * num_warps, "limit": limit}


def _tool(name: str, *args: str) -> str | None:
    """The output of Triton's bundled CUDA tool ``name`` (``nvdisasm``, ``cuobjdump``) on ``args``; ``None`` where
    it is missing or fails."""
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    try:
        return subprocess.run([path, *args], capture_output=True, text=True, check=True, timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _machine_code(cubin: bytes, fallback: str) -> tuple[str, int | None]:
    """``(the whole SASS, registers per thread)`` of one kernel's ``cubin``. The SASS from ``nvdisasm`` on the cubin:
    Triton's own ``asm["sass"]`` (parsed from ``cuobjdump``) stops early on large kernels (4,098 of 6,617 lines
    of ``_grad_local`` with Triton 3.6, so it showed 13 of its 65 spill loads). Registers from ``cuobjdump
    -res-usage``."""
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        sass = _tool("nvdisasm", "-c", path)
        usage = _tool("cuobjdump", "-res-usage", path) or ""
    finally:
        os.remove(path)
    regs = re.search(r"\bREG:(\d+)", usage)
    return sass if sass else fallback, int(regs.group(1)) if regs else None


def compile_counts(
    fn, signature: dict[str, str], constexprs: dict[str, Any], arch: int, **options
) -> tuple[Any, dict[str, Any]]:
    """Compile the ``@triton.jit`` kernel ``fn`` for CUDA compute capability ``arch`` with ``signature`` (each
    argument's Triton type, ``"constexpr"`` for those of ``constexprs``) and compiler ``options`` (``num_warps``,
    ``num_stages``): ``(the compiled kernel, counts)``. The counts: ``mma``, the matrix-unit instructions in the
    PTX; ``async_loads``, its asynchronous copies to shared memory (``cp.async``: the loads a software-pipelined
    loop has in flight); ``spill_loads`` / ``spill_stores``, ``LDL`` / ``STL`` in the whole machine code (spills
    are ptxas's: the SASS shows them, the PTX cannot); ``instructions`` in the machine code; ``shared_bytes``;
    ``registers`` per thread and the resulting ``warps_per_sm`` (:func:`occupancy`; ``None`` where ``cuobjdump``
    is missing). A ``RuntimeError`` under ``TRITON_INTERPRET`` (the interpreter has no compiler)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_report needs the compiler: unset TRITON_INTERPRET")
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = kernel.asm["ptx"]
    sass, regs = _machine_code(kernel.asm["cubin"], kernel.asm["sass"])
    shared = kernel.metadata.shared
    warps = options.get("num_warps", 4)
    fits = None if regs is None or arch not in _SM else occupancy(regs, warps, shared, arch)["warps_per_sm"]
    return kernel, {
        "mma": len(re.findall(r"\bw?gmma|\bmma\.", ptx)),
        "async_loads": len(re.findall(r"\bcp\.async\.(?:ca|cg)|\bcp\.async\.bulk\.tensor", ptx)),
        "spill_loads": len(re.findall(r"\bLDL\b", sass)),
        "spill_stores": len(re.findall(r"\bSTL\b", sass)),
        "instructions": len(re.findall(r"^\s*/\*[0-9a-f]+\*/", sass, flags=re.M)),
        "shared_bytes": shared,
        "registers": regs,
        "warps_per_sm": fits,
    }
