"""Autograd round trips ([128, 1, 8, 64] bf16) through bare autograd.Functions that launch our
kernel (set_rotary_kernel) in the forward, the backward or both, or a torch copy or a minimal
Triton copy kernel in the forward, against one that only allocates; our entry point; the two
launches without autograd. Rows interleaved over 7 rounds of 1000 calls, min and median; then
again with sys.setswitchinterval(1e-6).

    python artifacts/host/host_autograd_launches.py     # on a GPU, from the repository root
"""
import os
import sys
import threading

sys.path.insert(0, os.getcwd())
import torch
import triton
import triton.language as tl
from host_timing import function_of, time_rows

from triton_rotary_launch import set_rotary_kernel
from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

t = torch.randn(128, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
freqs = RotaryPositionEmbedding(64, device="cuda")(128)
x, grad = t.detach().requires_grad_(True), torch.randn_like(t)

@triton.jit
def _copy(x, y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)

def empty(a):
    return torch.empty_like(a)


def rope_f(a):
    return set_rotary_kernel(a, freqs)


def rope_b(a):
    return set_rotary_kernel(a, freqs, backward=True)


def torch_copy(a):
    o = torch.empty_like(a)
    o.copy_(a)
    return o
def jit_copy(a):
    o = torch.empty_like(a)
    _copy[(1,)](a, o, a.numel(), B=1024)
    return o
F = {n: function_of(f, b) for n, (f, b) in dict(
    Empty=(empty, empty), FwdRope=(rope_f, empty), BwdRope=(empty, rope_b), BothRope=(rope_f, rope_b),
    FwdTorchCopy=(torch_copy, empty), FwdJitCopy=(jit_copy, empty)).items()}
rows = {f"rt {n}": (lambda C=C: torch.autograd.grad(C.apply(x), x, grad)) for n, C in F.items()}
rows["rt ours"] = lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad)
rows["fwd+bwd launches, no autograd"] = lambda: (rope_f(t), rope_b(grad))
rows["FwdRope.apply only"] = lambda: F["FwdRope"].apply(x)
rows["torch_copy"] = lambda: torch_copy(t)
rows["jit_copy"] = lambda: jit_copy(t)

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
rows["rt ours"]()
print("threads:", [th.name for th in threading.enumerate()], flush=True)
for interval in (None, 1e-6):
    if interval:
        sys.setswitchinterval(interval)
    print("switch interval", sys.getswitchinterval(), flush=True)
    time_rows(rows)
