"""Is the round trip's extra cost of two launches ours, or any two launches' (one on the main
thread, one on autograd's device thread)? Autograd round trips ([128, 1, 8, 64] bf16) through
bare autograd.Functions that launch a torch copy or our kernel (set_rotary_kernel) in the
forward, the backward or both, through a C++ op's autograd (x * 2), and against one that only
allocates. Rows interleaved over 7 rounds of 1000 calls; min and median.

    python artifacts/host/host_launch_threads.py     # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
from host_timing import function_of, time_rows

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


PAIRS = {"empty / empty": (empty, empty), "copy / empty": (copy, empty),
         "empty / copy": (empty, copy), "copy / copy": (copy, copy),
         "rope / empty": (rope_forward, empty), "empty / rope": (empty, rope_backward),
         "rope / rope": (rope_forward, rope_backward), "rope / copy": (rope_forward, copy),
         "copy / rope": (copy, rope_backward)}
rows = {f"rt {name}": (lambda F=function_of(*pair): torch.autograd.grad(F.apply(x), x, grad))
        for name, pair in PAIRS.items()}
rows["rt x * 2 (C++ autograd)"] = lambda: torch.autograd.grad(x * 2, x, grad)
rows["rt ours"] = lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad)
rows["copy, no autograd"] = lambda: copy(t)
rows["rope forward + backward, no autograd"] = lambda: (rope_forward(t), rope_backward(grad))


print(torch.cuda.get_device_name(), torch.__version__, flush=True)
print("forward / backward: what each bare autograd.Function launches", flush=True)
time_rows(rows)
