"""Host µs per call of one small RoPE ([128, 1, 8, 64] bf16, TE's table), layer by layer: Triton's
C launcher with prebuilt arguments (CompiledKernel.run), our direct-launch closure, _Launch,
set_rotary_kernel, the entry point, the autograd round trip against an allocate-only
autograd.Function. Rows interleaved over 7 rounds of 1500 calls; min and median.

    python artifacts/host/host_launch_layers.py     # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
import triton
from host_timing import AllocateOnly, time_rows
from triton.runtime import driver

import triton_rotary_launch as L
from triton_rotary_launch import set_rotary_kernel
from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

dev = "cuda"
t = torch.randn(128, 1, 8, 64, device=dev, dtype=torch.bfloat16)
mod = RotaryPositionEmbedding(64, device=dev)
freqs = mod(128)
x, grad = t.detach().requires_grad_(True), torch.randn_like(t)
set_rotary_kernel(t, freqs)
set_rotary_kernel(t, freqs)
(plan,) = [p for p in L._PLANS.values()]
src = L.angle_source(freqs)
out = torch.empty_like(t)
args = ((t, plan.x_strides), (out, plan.out_strides), L._angles(src, plan.table),
        (None, plan.position_strides, None, None), plan.shape, None, *plan.tokens)
launch = plan.launch
(runner,) = launch.runners.values()
key = next(iter(launch.runners))
ck = launch.jit(*args)          # the CompiledKernel

dev_i = driver.active.get_current_device()
gs = driver.active.get_current_stream
stream = gs(dev_i)
g0, g1 = launch.grid
full = (*args, *launch.plain_cfg)
run, kfunc, packed = ck.run, ck.function, ck.packed_metadata
inner = getattr(run, "launch", None)
print("runner direct:", getattr(runner, "direct", None), "inner launch:", inner, flush=True)
print("args:", len(full), "plain_cfg:", launch.plain_cfg, flush=True)

rows = {
  "empty_like": lambda: torch.empty_like(t),
  "current_device": lambda: torch.cuda.current_device(),
  "get_stream": lambda: gs(dev_i),
  "C run (prebuilt args)": lambda: run(g0, g1, 1, stream, kfunc, packed, None, None, None, *full),
  "runner closure (prebuilt)": lambda: runner(*full),
  "_Launch.__call__ (prebuilt)": lambda: launch(*args),
  "set_rotary_kernel": lambda: set_rotary_kernel(t, freqs),
  "apply no grad": lambda: apply_rotary_pos_emb(t, freqs),
  "apply grad fwd only": lambda: apply_rotary_pos_emb(x, freqs),
  "Empty fwd only": lambda: AllocateOnly.apply(x),
  "rt Empty": lambda: torch.autograd.grad(AllocateOnly.apply(x), x, grad),
  "rt ours": lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad),
  "rt ours positions": lambda: torch.autograd.grad(apply_rotary_pos_emb(x, mod), x, grad),
}

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
time_rows(rows, calls=1500, warm_up_calls=300, indent="")
