"""What the host probes in this folder share: autograd functions of a given forward and
backward (AllocateOnly, the one the host target is measured against), and their timing loop:
CPU µs per call of each row, the rows interleaved over rounds so that the host's drift falls on
all of them alike, minimum and median."""
import time

import torch


def function_of(forward, backward):
    """A bare autograd.Function whose forward is forward(a) and backward backward(grad)."""
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return forward(a)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)
    return Function


class AllocateOnly(torch.autograd.Function):
    """rope_bench's allocate-only function (each direction one torch.empty_like), written
    out as there rather than through function_of, whose extra Python call each way would
    move the baseline."""

    @staticmethod
    def forward(ctx, a):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


def per_call_us(fn, calls):
    """CPU µs per call of fn over `calls` calls; the GPU's queue is drained afterwards (on a
    CPU-only torch, there is none)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def time_rows(rows, rounds=7, calls=1000, warm_up_calls=200, indent="  "):
    """Time every row (name -> fn) `rounds` times, `calls` calls each, the rows interleaved,
    after `warm_up_calls` calls each; print and return each row's sorted µs per call."""
    for fn in rows.values():
        per_call_us(fn, warm_up_calls)
    times = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            times[name].append(per_call_us(fn, calls))
    width = max(map(len, rows)) + 2
    for name, values in times.items():
        values.sort()
        print(f"{indent}{name:<{width}} min {values[0]:6.1f}  median "
              f"{values[len(values) // 2]:6.1f} us", flush=True)
    return times
