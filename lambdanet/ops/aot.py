"""Ahead-of-time compilation of a Triton kernel for a GPU without one (Triton's bundled ``ptxas`` and
``nvdisasm``), and what the kernels' ``compile_report`` functions count in it: one place for how matrix-unit
instructions and register spills are read."""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["compile_counts"]


def compile_counts(
    fn, signature: dict[str, str], constexprs: dict[str, Any], arch: int, **options
) -> tuple[Any, dict[str, int]]:
    """Compile the ``@triton.jit`` kernel ``fn`` for CUDA compute capability ``arch`` with ``signature`` (each
    argument's Triton type, ``"constexpr"`` for those of ``constexprs``) and compiler ``options`` (``num_warps``,
    ``num_stages``): ``(the compiled kernel, counts)``. The counts: ``mma``, the matrix-unit instructions in the
    PTX; ``async_loads``, its asynchronous copies to shared memory (``cp.async``: the loads a software-pipelined
    loop has in flight); ``spill_loads`` / ``spill_stores``, ``LDL`` / ``STL`` in the machine code (spills are
    ptxas's: the SASS shows them, the PTX cannot); ``shared_bytes``. A ``RuntimeError`` under ``TRITON_INTERPRET`` (the
    interpreter has no compiler)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_report needs the compiler: unset TRITON_INTERPRET")
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx, sass = kernel.asm["ptx"], kernel.asm["sass"]
    return kernel, {
        "mma": len(re.findall(r"\bw?gmma|\bmma\.", ptx)),
        "async_loads": len(re.findall(r"\bcp\.async\.(?:ca|cg)|\bcp\.async\.bulk\.tensor", ptx)),
        "spill_loads": len(re.findall(r"\bLDL\b", sass)),
        "spill_stores": len(re.findall(r"\bSTL\b", sass)),
        "shared_bytes": kernel.metadata.shared,
    }
