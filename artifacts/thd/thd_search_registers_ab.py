"""thd search tiles under a cap on registers per thread (Triton's `maxnreg`), against the rule
(no cap), at the packed points: kernels alone, both paths, in fractions of an eager device
copy of the same bytes (positions_tiles_ab.py's timing), flash-attn's rotary beside them.

ncu on the H200 (artifacts/thd/thd_against_sbhd_h200.log): the 8 KiB search tile of 8 heads
in 4 warps takes 64 registers a thread, which caps an SM at 8 programs (50% occupancy), where
the sbhd tile of the same tokens takes 32 (100%) and runs at 0.99 of copy speed against 0.95.
A cap lets more programs reside per SM, at the risk of spilling.

    python artifacts/thd/thd_search_registers_ab.py OUT [POINT ...]   # on a GPU, repo root
"""
import contextlib
import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "artifacts", "tiles"))

import positions_tiles_ab as P  # noqa: E402
import torch  # noqa: E402

import triton_rotary_launch as L  # noqa: E402
from rope_bench_report import ScriptLog, device_header  # noqa: E402

POINTS = ["thd-2048x64-h8", "thd-4096x32-h8", "thd-mixed-16K-h32", "VLM-7B-k-thd-8x8K"]
VARIANTS = {"rule": None, "r56": 56, "r48": 48, "r40": 40}
uncapped = L._max_registers
runner = L._compiled_runner


def reporting_runner(kernel, grid):
    """Triton's runner of a kernel just compiled, after printing its registers and spills
    (so that the log shows whether a cap engaged)."""
    print(f"    compiled {kernel.name}: {kernel.n_regs} registers, {kernel.n_spills} spilled",
          flush=True)
    return runner(kernel, grid)


@contextlib.contextmanager
def cap(registers):
    """Plans made inside cap the registers of every launch whose tiles search cu_seqlens."""
    L._PLANS.clear()
    if registers:
        L._max_registers = lambda rule, cfg: (registers if cfg.SEARCH_LEVELS and not cfg.NORM
                                              else uncapped(rule, cfg))
    try:
        yield
    finally:
        L._max_registers = uncapped
        L._PLANS.clear()


def main():
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        sys.exit("usage: python artifacts/thd/thd_search_registers_ab.py OUT [POINT ...] (CUDA device)")
    out_dir, points = sys.argv[1], sys.argv[2:] or POINTS
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    P.variant = cap
    L._compiled_runner = reporting_runner
    out = ScriptLog()
    out.say(f"{device_header()}; kernels alone, fraction of an eager copy's speed; median of "
            f"{P.ROUNDS} rounds of do_bench; thd search tiles with maxnreg "
            f"{'/'.join(map(str, VARIANTS.values()))} (None: the rule); triton = TE's table, "
            f"triton_positions = angles from positions")
    start = time.time()
    for point in points:
        P.run_point(point, out.say, out.rows, VARIANTS, ("triton_positions", "triton"), "bf16")
        out.say(f"  ({time.time() - start:.0f} s)")
        torch.cuda.empty_cache()
        out.write(out_dir, "thd_search_registers_ab")


if __name__ == "__main__":
    main()
