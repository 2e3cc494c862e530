"""The references of positions_tiles_ab.py and table_warps_ab.py, which time one call per
do_bench replay after an L2 flush, as the models sweep did before 2026-11-28
(docs/benchmarks.md): an eager device copy of x and the plain Triton copy of it, each a
function that makes one copy."""
import torch
import triton

import rope_bench as B


def flush_copies(x):
    """(torch's copy of x into a new tensor, the plain Triton copy of x into a new tensor)."""
    flat = x.reshape(-1)

    def triton_copy():
        out = torch.empty_like(flat)
        B._triton_copy_kernel[(triton.cdiv(flat.numel(), B.TRITON_COPY_BLOCK),)](
            out, flat, flat.numel(), BLOCK=B.TRITON_COPY_BLOCK, num_warps=B.TRITON_COPY_WARPS)
        return out
    return (lambda: torch.empty_like(x).copy_(x)), triton_copy
