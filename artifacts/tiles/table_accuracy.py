"""Accuracy of TE's table path in each source tree given: python table_accuracy.py TREE...

For bf16, fp16 and float32 data (65536 positions of a d 128 table from RotaryPositionEmbedding,
two heads, random normal data; forward and the backward's transposed rotation), against float64
of TE's formula on the same float32 angles: the share of output elements that differ from that
result rounded to the dtype, the largest error of a rotated pair relative to the pair's norm, and
the Frobenius relative error. On a GPU; without one, under TRITON_INTERPRET=1, at 512 positions.
"""
import importlib
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POSITIONS, HEADS, DIM = (65536 if DEVICE == "cuda" else 512), 2, 128


def tree_module(tree):
    """triton_rotary_main imported from `tree` (the modules of any tree before it dropped)."""
    for name in [m for m in sys.modules if m.startswith(("triton_rotary", "rope_"))]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        module = importlib.import_module("triton_rotary_main")
    finally:
        sys.path.pop(0)
    assert module.__file__.startswith(tree), module.__file__
    return module


def errors(out, x, freqs, backward):
    """(share of elements off the rounded float64 result, worst pair error, Frobenius error)."""
    x64, f64, half = x.double(), freqs.double(), DIM // 2
    rotated = torch.cat([-x64[..., half:], x64[..., :half]], -1)
    ref = x64 * f64.cos() + (-1.0 if backward else 1.0) * rotated * f64.sin()
    differ = (out != ref.to(out.dtype)).double().mean().item()
    err = out.double() - ref
    pair_err = (err[..., :half] ** 2 + err[..., half:] ** 2).sqrt()
    pair_norm = (x64[..., :half] ** 2 + x64[..., half:] ** 2).sqrt().clamp_min(1e-30)
    return differ, (pair_err / pair_norm).max().item(), (err.norm() / ref.norm()).item()


def main():
    for tree in sys.argv[1:]:
        M = tree_module(tree)
        freqs = M.RotaryPositionEmbedding(DIM).to(DEVICE)(POSITIONS)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        base = torch.randn(POSITIONS, 1, HEADS, DIM, device=DEVICE, generator=gen)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = base.to(dtype)
            for backward in (False, True):
                out = M.set_rotary_kernel(x, freqs, backward=backward)
                differ, worst, rel = errors(out, x, freqs, backward)
                print(f"{tree.rstrip('/').split('/')[-1]:12s} {str(dtype)[6:]:9s} "
                      f"{'backward' if backward else 'forward '} differ {differ:.2e}  "
                      f"worst pair {worst:.3e}  frobenius {rel:.3e}", flush=True)


if __name__ == "__main__":
    main()
