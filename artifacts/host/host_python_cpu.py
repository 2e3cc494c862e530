"""CPU µs of our Python per call, on any CPU and no GPU: the calls of host_launch_layers.py
under Triton's interpreter with every compiled-kernel launch replaced by a no-op, so what is
timed is the entry point, the autograd wiring and the launcher up to Triton's C launcher
([128, 1, 8, 64] bf16, TE's table and the module; q and k: that and a k of 2 heads; fused QKV:
[128, 1, 2, 256] packed as 4 query, 2 key and 2 value heads of d 64). Minimum
of 25 rounds of 4000 calls. Give it the folder of the sources to time (two folders: an A/B,
one process each).

    python artifacts/host/host_python_cpu.py .
"""
import os
import sys
import timeit

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "."))
import torch
from host_timing import AllocateOnly

import triton_rotary_launch as L
import triton_rotary_main as M

t = torch.randn(128, 1, 8, 64, dtype=torch.bfloat16)
module = M.RotaryPositionEmbedding(64)
freqs = module(128)
x, grad = t.detach().requires_grad_(True), torch.randn_like(t)
torch.autograd.grad(M.apply_rotary_pos_emb(x, freqs), x, grad)      # plans every call below
torch.autograd.grad(M.apply_rotary_pos_emb(x, module), x, grad)
k = torch.randn(128, 1, 2, 64, dtype=torch.bfloat16, requires_grad=True)
grad_k = torch.randn_like(k)
torch.autograd.grad(M.apply_rotary_pos_emb_qk(x, k, freqs), (x, k), (grad, grad_k))
split = [128, 64, 64]                    # fused QKV: 4 query, 2 key and value heads of d 64
qkv = torch.randn(128, 1, 2, 256, dtype=torch.bfloat16, requires_grad=True)
grads_qkv = [torch.randn_like(o) for o in M.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split)]
torch.autograd.grad(M.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split), qkv, grads_qkv)
M.apply_fused_qkv_rotary_pos_emb(qkv.detach(), freqs, freqs, split)


def no_launch(*args):
    pass


class EveryKeyLaunchesNothing(dict):
    def get(self, key, default=None):
        return no_launch


for plan in L._PLANS.values():
    if plan.launch is not None:
        plan.launch.runners = EveryKeyLaunchesNothing()
# The launches take the direct path (as on a GPU) while the plans stay the interpreter's.
torch.cuda.current_device = lambda: 0
L._interpreting = lambda: True
L._INTERPRETING = False


rows = {
    "empty_like": lambda: torch.empty_like(t),
    "set_rotary_kernel": lambda: L.set_rotary_kernel(t, freqs),
    "apply no grad": lambda: M.apply_rotary_pos_emb(t, freqs),
    "apply no grad positions": lambda: M.apply_rotary_pos_emb(t, module),
    "apply grad fwd": lambda: M.apply_rotary_pos_emb(x, freqs),
    "allocate-only fwd": lambda: AllocateOnly.apply(x),
    "rt allocate-only": lambda: torch.autograd.grad(AllocateOnly.apply(x), x, grad),
    "rt ours": lambda: torch.autograd.grad(M.apply_rotary_pos_emb(x, freqs), x, grad),
    "rt ours positions": lambda: torch.autograd.grad(M.apply_rotary_pos_emb(x, module), x, grad),
    "rt ours q and k": lambda: torch.autograd.grad(M.apply_rotary_pos_emb_qk(x, k, freqs), (x, k),
                                                   (grad, grad_k)),
    "qkv no grad": lambda: M.apply_fused_qkv_rotary_pos_emb(qkv.detach(), freqs, freqs, split),
    "rt qkv": lambda: torch.autograd.grad(M.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split),
                                          qkv, grads_qkv),
}
plans = len(L._PLANS)
times = {name: min(timeit.repeat(fn, number=4000, repeat=25)) / 4000 * 1e6 for name, fn in rows.items()}
assert len(L._PLANS) == plans, "a timed call planned again"
print("  ".join(f"{name}={us:.2f}" for name, us in times.items()))
