"""Triton's C launcher (CompiledKernel.run, with our kernel's prebuilt arguments) given the
tensors, whose pointers it reads through data_ptr() and checks with cuPointerGetAttribute, or
the pointers as ints, which it takes as they are; alone, and in both directions of an autograd
round trip through a bare autograd.Function ([128, 1, 8, 64] bf16, TE's table), against one
that launches nothing. Rows interleaved over 7 rounds of 1000 calls; min and median.

    python artifacts/host/host_launcher_pointers.py     # on a GPU, from the repository root
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
from host_timing import time_rows
from triton.runtime import driver

import triton_rotary_launch as L
from triton_rotary_launch import set_rotary_kernel
from triton_rotary_main import RotaryPositionEmbedding

t = torch.randn(128, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
freqs = RotaryPositionEmbedding(64, device="cuda")(128)
x, grad = t.detach().requires_grad_(True), torch.randn_like(t)
set_rotary_kernel(t, freqs)
set_rotary_kernel(grad, freqs, backward=True)
forward_plan, backward_plan = L._PLANS.values()
source = L.angle_source(freqs)
device = driver.active.get_current_device()
get_stream = driver.active.get_current_stream


def launchers(plan, x):
    """(a launch of `plan`'s compiled kernel on x given tensors, the same given ints)."""
    out = torch.empty_like(x)
    angles = L._angles(source, plan.table)
    tail = ((None, plan.position_strides, None, None), plan.shape, None, *plan.tokens)
    with_tensors = ((x, plan.x_strides), (out, plan.out_strides), angles, *tail)
    with_ints = ((x.data_ptr(), plan.x_strides), (out.data_ptr(), plan.out_strides),
                 (angles[0].data_ptr(), *angles[1:]), *tail)
    kernel = plan.launch.jit(*with_tensors)
    run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    (g0, g1), cfg = plan.launch.grid, plan.launch.plain_cfg

    def launcher(args):
        def launch():
            run(g0, g1, 1, get_stream(device), function, packed, None, None, None, *args, *cfg)
        return launch
    return launcher(with_tensors), launcher(with_ints)


forward_tensors, forward_ints = launchers(forward_plan, t)
backward_tensors, backward_ints = launchers(backward_plan, grad)


def nothing():
    pass


def round_trip(forward, backward):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            forward()
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            backward()
            return torch.empty_like(g)
    return lambda: torch.autograd.grad(F.apply(x), x, grad)


rows = {"C launcher, tensors": forward_tensors, "C launcher, ints": forward_ints,
        "rt nothing": round_trip(nothing, nothing),
        "rt tensors, both": round_trip(forward_tensors, backward_tensors),
        "rt ints, both": round_trip(forward_ints, backward_ints),
        "rt tensors, forward": round_trip(forward_tensors, nothing),
        "rt tensors, backward": round_trip(nothing, backward_tensors),
        "rt ints, forward": round_trip(forward_ints, nothing),
        "rt ints, backward": round_trip(nothing, backward_ints)}


print(torch.cuda.get_device_name(), torch.__version__, flush=True)
time_rows(rows)
