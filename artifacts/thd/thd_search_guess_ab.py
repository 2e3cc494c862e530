"""TE's table on packed thd (bf16, 32 heads of d 128, 32K tokens): the launch rule against the
rule without the guessed window of cu_seqlens (`search_guess`, SEARCH_GUESS), forward and
backward kernels alone, one CUDA graph of two calls each (256 MB a call), replayed against an
eager copy of the same bytes, interleaved (rope_qknorm_rules' graphed_under_rules and
time_graphs, 10 replays a round), median of 9 rounds, in fractions of copy speed.

    python artifacts/thd/thd_search_guess_ab.py                    # thd_empty_sequences' shapes:
        # 16 sequences of 2048 tokens, then 0, 16 and 112 empty ones
    SEQS=16,64,256,1024 python artifacts/thd/thd_search_guess_ab.py  # that many equal sequences
"""
import functools
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())
import torch

import triton_rotary_launch as L
import triton_rotary_main as M
from rope_qknorm_rules import graphed_under_rules, time_graphs

HEADS, HEAD_DIM, TOKENS, ROUNDS = 32, 128, 32768, 9
RULES = {"rule": L.GPU_RULE, "no_guess": L.GPU_RULE._replace(search_guess=False)}


def cases():
    """(tokens a sequence, sequences, empty sequences after them)."""
    if os.environ.get("SEQS"):
        return [(TOKENS // n, n, 0) for n in map(int, os.environ["SEQS"].split(","))]
    return [(TOKENS // 16, 16, n) for n in (0, 16, 112)]


def graphs_by_rule(xs, freqs, cu):
    """{(rule name, backward): a graph of that rule's launches on every tensor of xs}, each
    rule's plans made afresh under it."""
    graphs = {}
    for backward in (False, True):
        launch = functools.partial(L.set_rotary_kernel, freqs=freqs, tensor_format="thd",
                                   cu_seqlens=cu, backward=backward)
        by_rule, _ = graphed_under_rules(launch, RULES, xs)
        graphs.update({(name, backward): graph for name, graph in by_rule.items()})
    return {(name, backward): graphs[(name, backward)] for name in RULES
            for backward in (False, True)}


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
    # The copy stays eager, as in the runs its log records.
    steps = graphs_by_rule(xs, freqs, cu)
    steps["copy"] = SimpleNamespace(replay=copy)
    med = time_graphs(steps, len(xs), rounds=ROUNDS)
    print(f"{full} x {seq} tokens, empty {empty}: copy {med['copy']:.1f} us  " + "  ".join(
        f"{name} {'bwd' if backward else 'fwd'} {med['copy'] / med[(name, backward)]:.3f}"
        for name, backward in (k for k in steps if k != "copy")), flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for case in cases():
        time_case(*case)
