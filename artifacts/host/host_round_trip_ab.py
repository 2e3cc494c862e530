"""Host µs per call of two source trees of this repository in one process, their rows
interleaved, so that the host's drift (GPU hosts' CPUs are shared and their speed moves by
tens of percent from one process to the next) falls on both alike. One small RoPE ([128, 1,
8, 64] bf16): the launcher, the entry point with and without autograd recording it, and the
eager autograd round trip (of t alone, and of q = t and a k of 2 heads in one call) against an
allocate-only autograd.Function; 9 rounds of 1500 calls per row, minimum and median.

    python artifacts/host/host_round_trip_ab.py BASE_DIR NEW_DIR     # on a GPU
"""
import importlib
import os
import sys

import torch
from host_timing import AllocateOnly, time_rows

MODULES = ("triton_rotary_kernel", "triton_rotary_launch", "triton_rotary_main")


def load(folder):
    """The launch and main modules of the sources in `folder`, imported apart from any other
    tree's (their names are taken out of sys.modules again afterwards)."""
    for name in MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, os.path.abspath(folder))
    try:
        _, launch, main = (importlib.import_module(name) for name in MODULES)
    finally:
        sys.path.pop(0)
        for name in MODULES:
            sys.modules.pop(name, None)
    return launch, main


def rows_of(tag, launch, main, t, x, grad, k, grad_k):
    module = main.RotaryPositionEmbedding(64, device=t.device)
    freqs = module(128)
    apply, apply_qk = main.apply_rotary_pos_emb, main.apply_rotary_pos_emb_qk
    return {
        f"{tag} set_rotary_kernel": lambda: launch.set_rotary_kernel(t, freqs),
        f"{tag} apply no grad": lambda: apply(t, freqs),
        f"{tag} apply grad fwd only": lambda: apply(x, freqs),
        f"{tag} rt ours": lambda: torch.autograd.grad(apply(x, freqs), x, grad),
        f"{tag} rt ours positions": lambda: torch.autograd.grad(apply(x, module), x, grad),
        f"{tag} rt ours q and k": lambda: torch.autograd.grad(apply_qk(x, k, freqs), (x, k),
                                                              (grad, grad_k)),
    }


def main():
    base_dir, new_dir = sys.argv[1:3]
    t = torch.randn(128, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    x, grad = t.detach().requires_grad_(True), torch.randn_like(t)
    k = torch.randn(128, 1, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_k = torch.randn_like(k)
    rows = {"empty_like": lambda: torch.empty_like(t),
            "rt allocate-only": lambda: torch.autograd.grad(AllocateOnly.apply(x), x, grad)}
    for tag, folder in (("base", base_dir), ("new", new_dir)):
        rows.update(rows_of(tag, *load(folder), t, x, grad, k, grad_k))
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    times = time_rows(rows, rounds=9, calls=1500, warm_up_calls=300, indent="")
    for row in ("rt ours", "rt ours q and k"):
        for tag in ("base", "new"):
            excess = [ours - alloc for ours, alloc in zip(times[f"{tag} {row}"],
                                                          times["rt allocate-only"])]
            print(f"{tag} {row} over allocate-only: min-to-min {excess[0]:.1f}, "
                  f"median-to-median {excess[len(excess) // 2]:.1f} us")


if __name__ == "__main__":
    main()
