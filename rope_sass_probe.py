"""Compiles rotary_kernel for sm_90 and reports, per tile, what the tests read in the generated
code: `python rope_sass_probe.py TILE [TILE ...]`, each TILE a JSON object of constexprs over
DEFAULT_TILE. No GPU is needed (Triton's own ptxas and nvdisasm). Run it in a process without
TRITON_INTERPRET, so that the kernel is a JIT function.

Per tile it prints one JSON line: the number of sin.approx in the PTX (PTX is one thread's code,
so that is the sin/cos each thread computes) and the global loads in the order of the SASS.
Sizes and strides are those of contiguous tensors, as Triton specializes a contiguous call.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import triton_rotary_kernel as K

DEFAULT_TILE = dict(BLOCK_T=1, BLOCK_H=1, BLOCK_HALF=64, BLOCK_PASS=0, INTERLEAVED=False,
                    BACKWARD=False, IS_THD=False, SEQ_MAJOR=True, HAS_START=False,
                    WIDE_INNER=False, ANGLES_FROM_POSITIONS=True, POSITIONS_FROM=0,
                    SEARCH_LEVELS=0, FLAT_GRID=False)
POINTERS = {"OUT": "*bf16", "X": "*bf16", "FREQS": "*fp32", "PAIR_AXIS": "*i32",
            "POSITIONS": "*i64", "START_POSITIONS": "*i32", "CU_SEQLENS": "*i32"}


def compile_tile(tile):
    """{"sin": sin.approx count in the PTX, "loads": the SASS's global loads in order}."""
    names = K.rotary_kernel.arg_names
    # As Triton specializes a contiguous call: aligned pointers, unit channel strides, the other
    # strides and the head and rotary dims multiples of 16.
    unit_strides = {n: 1 for n in names if n.startswith("stride") and n.endswith("_dim")}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in POINTERS or n in ("rotary_dim", "head_dim")
               or (n.startswith("stride") and n not in unit_strides)}
    constexprs = {**DEFAULT_TILE, **unit_strides, **tile}
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "fp32" if n == "angle_scale" else "i32")
                 for n in names}
    kernel = triton.compile(ASTSource(fn=K.rotary_kernel, signature=signature, constexprs=constexprs,
                                      attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    return {"sin": len(re.findall(r"sin\.approx\.f32", kernel.asm["ptx"])),
            "loads": re.findall(r"\bLDG\.[\w.]+", sass)}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(compile_tile(json.loads(arg))), flush=True)
