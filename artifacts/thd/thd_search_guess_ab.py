"""TE's table on packed thd (bf16, 32 heads of d 128, 32K tokens): the launch rule against the
rule without the guessed window of cu_seqlens (`search_guess`, SEARCH_GUESS), forward and
backward kernels alone, one CUDA graph of two calls each (256 MB a call), replayed against an
eager copy of the same bytes, interleaved, median of 9 rounds, in fractions of copy speed.

    python artifacts/thd/thd_search_guess_ab.py                    # thd_empty_sequences' shapes:
        # 16 sequences of 2048 tokens, then 0, 16 and 112 empty ones
    SEQS=16,64,256,1024 python artifacts/thd/thd_search_guess_ab.py  # that many equal sequences
"""
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
import torch

import triton_rotary_launch as L
import triton_rotary_main as M

HEADS, HEAD_DIM, TOKENS, ROUNDS, REPLAYS = 32, 128, 32768, 9, 10
RULES = {"rule": L.GPU_RULE, "no_guess": L.GPU_RULE._replace(search_guess=False)}


def cases():
    """(tokens a sequence, sequences, empty sequences after them)."""
    if os.environ.get("SEQS"):
        return [(TOKENS // n, n, 0) for n in map(int, os.environ["SEQS"].split(","))]
    return [(TOKENS // 16, 16, n) for n in (0, 16, 112)]


def captured(xs, freqs, cu, rule, backward):
    """A graph of the rule's launches on every tensor of xs, planned afresh under it."""
    def step():
        return [L.set_rotary_kernel(x, freqs, "thd", cu_seqlens=cu, backward=backward) for x in xs]
    L._PLANS.clear()
    with L.use_launch_rule(rule):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    return graph


def time_case(seq, full, empty):
    freqs = M.RotaryPositionEmbedding(HEAD_DIM, device="cuda")(seq)
    cu = torch.tensor([i * seq for i in range(full + 1)] + [full * seq] * empty, dtype=torch.int32,
                      device="cuda")
    xs = [torch.randn(full * seq, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
          for _ in range(2)]
    outs = [torch.empty_like(x) for x in xs]

    def copy():
        for out, x in zip(outs, xs):
            out.copy_(x)
    steps = {(name, backward): captured(xs, freqs, cu, rule, backward).replay
             for name, rule in RULES.items() for backward in (False, True)}
    steps["copy"] = copy
    times = {k: [] for k in steps}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for k, step in steps.items():
            start.record()
            for _ in range(REPLAYS):
                step()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) / (REPLAYS * len(xs)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{full} x {seq} tokens, empty {empty}: copy {med['copy'] * 1e3:.1f} us  " + "  ".join(
        f"{name} {'bwd' if backward else 'fwd'} {med['copy'] / med[(name, backward)]:.3f}"
        for name, backward in (k for k in steps if k != "copy")), flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for case in cases():
        time_case(*case)
