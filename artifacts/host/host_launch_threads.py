"""Is the round trip's extra cost of two launches ours, or any two launches' (one on the main
thread, one on autograd's device thread)? Autograd round trips ([128, 1, 8, 64] bf16) through
bare autograd.Functions that launch a torch copy or our kernel (set_rotary_kernel) in the
forward, the backward or both, through a C++ op's autograd (x * 2), and against one that only
allocates. Rows interleaved over 7 rounds of 1000 calls; min and median.

    python artifacts/host/host_launch_threads.py     # on a GPU, from the repository root
"""
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch

from triton_rotary_launch import set_rotary_kernel
from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

t = torch.randn(128, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
freqs = RotaryPositionEmbedding(64, device="cuda")(128)
x, grad = t.detach().requires_grad_(True), torch.randn_like(t)


def empty(a):
    return torch.empty_like(a)


def copy(a):
    out = torch.empty_like(a)
    out.copy_(a)
    return out


def rope_forward(a):
    return set_rotary_kernel(a, freqs)


def rope_backward(a):
    return set_rotary_kernel(a, freqs, backward=True)


def function(forward, backward):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return forward(a)

        @staticmethod
        def backward(ctx, g):
            return backward(g)
    return F


PAIRS = {"empty / empty": (empty, empty), "copy / empty": (copy, empty),
         "empty / copy": (empty, copy), "copy / copy": (copy, copy),
         "rope / empty": (rope_forward, empty), "empty / rope": (empty, rope_backward),
         "rope / rope": (rope_forward, rope_backward), "rope / copy": (rope_forward, copy),
         "copy / rope": (copy, rope_backward)}
rows = {f"rt {name}": (lambda F=function(*pair): torch.autograd.grad(F.apply(x), x, grad))
        for name, pair in PAIRS.items()}
rows["rt x * 2 (C++ autograd)"] = lambda: torch.autograd.grad(x * 2, x, grad)
rows["rt ours"] = lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad)
rows["copy, no autograd"] = lambda: copy(t)
rows["rope forward + backward, no autograd"] = lambda: (rope_forward(t), rope_backward(grad))


def once(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


print(torch.cuda.get_device_name(), torch.__version__, flush=True)
print("forward / backward: what each bare autograd.Function launches", flush=True)
times = {}
for fn in rows.values():
    once(fn, 200)
for _ in range(7):
    for name, fn in rows.items():
        times.setdefault(name, []).append(once(fn, 1000))
for name, values in times.items():
    values.sort()
    print(f"  {name:<38} min {values[0]:6.1f}  median {values[len(values) // 2]:6.1f} us", flush=True)
