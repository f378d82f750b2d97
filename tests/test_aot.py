"""Reading compiled kernels without a GPU (:mod:`lambdanet.ops.aot`): occupancy from the published per-multiprocessor
limits, and the machine code read in full."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys

import pytest

from lambdanet.ops.aot import occupancy


@pytest.mark.parametrize(
    "regs, warps, shared, blocks, limit",
    [
        # 255 registers round up to 256 a thread: 65536 / (256 x 32) = 8 warps, two blocks of 4
        (255, 4, 0, 2, "registers"),
        (255, 8, 0, 1, "registers"),
        # 32 registers: 16 blocks of 4 warps by registers, and 64 / 4 = 16 by warps
        (32, 4, 0, 16, "registers"),
        # 64 registers, 8 warps (16,384 registers a block: 4 blocks), 100 KiB shared: 228 KiB / 101 KiB = 2 blocks
        (64, 8, 102400, 2, "shared"),
        # 16 registers, 1 warp: 128 blocks by registers, 64 by warps, 32 by the block limit
        (16, 1, 0, 32, "blocks"),
    ],
)
def test_occupancy_follows_the_hopper_limits(regs, warps, shared, blocks, limit):
    """An H100 multiprocessor (compute capability 9.0): 65,536 registers allocated per warp in units of 256, 64 warps,
    32 blocks, 228 KiB of shared memory with 1 KiB reserved per block (CUDA C++ Programming Guide)."""
    got = occupancy(regs, warps, shared, 90)
    assert got == {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limit": limit}


def test_occupancy_names_a_bad_arch():
    with pytest.raises(ValueError, match=r"arch must be one of \[80, 86, 89, 90\].*got 75"):
        occupancy(64, 4, 0, 75)


def _text_sizes(cubin: bytes) -> dict[str, int]:
    """The ELF64 cubin's ``.text.*`` sections and their sizes in bytes, read from the section headers."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    strings = struct.unpack_from("<Q", cubin, shoff + names * entsize + 0x18)[0]
    out = {}
    for i in range(count):
        name, _, _, _, _, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize)
        label = cubin[strings + name : cubin.index(b"\0", strings + name)].decode()
        if label.startswith(".text."):
            out[label] = size
    return out


def test_compile_counts_reads_the_whole_machine_code():
    """Hopper instructions are 16 bytes: the instructions counted in the disassembly equal the kernel's ``.text``
    section over 16, read from the cubin's ELF headers (Triton 3.6's own ``asm["sass"]`` stopped at 4,098 lines of
    ``_grad_local``'s 6,617 and missed two thirds of its spills). Registers are those the cubin declares, at most
    255 a thread, and the occupancy follows from them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("LAMBDANET_CAUSAL")}
    code = """
import base64, json
import triton.language as tl
from lambdanet.ops.aot import compile_counts
from lambdanet.ops.causal_lambda import triton_chunk as T
m = dict(K=16, V=208, U=1, C=16, H=8, HP=8, KP=16, RP=64, P=4, WP=64, HAS_EMB=True, BV=64, DT=tl.bfloat16,
         PREC="tf32", SAFE=60.0)
fn = T._chunk_output
f32 = {"cb", "zb", "Sb"}
sig = {a: "constexpr" if a in m else "i32" if a in ("n", "r", "N1") else "*fp32" if a in f32 else "*bf16"
       for a in fn.arg_names}
kernel, counts = compile_counts(fn, sig, {k: v for k, v in m.items() if k in fn.arg_names}, 90, num_warps=4)
print(json.dumps([counts, base64.b64encode(kernel.asm["cubin"]).decode()]))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and any(t in proc.stderr for t in ("ptxas", "nvdisasm")) and "not found" in proc.stderr:
        pytest.skip("Triton's ptxas / nvdisasm are not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts, cubin = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes = _text_sizes(base64.b64decode(cubin))
    assert counts["instructions"] == sizes[".text._chunk_output"] // 16 > 1000
    assert 0 < counts["registers"] <= 255
    assert counts["warps_per_sm"] == occupancy(counts["registers"], 4, counts["shared_bytes"])["warps_per_sm"]
