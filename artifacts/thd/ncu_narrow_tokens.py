"""Forward calls of narrow tokens for Nsight Compute, two of each case, in CASES' order: packed
batches of 2048 sequences of 64 tokens, one head of d 128 (angles from positions, then TE's
table) and MLA's key (one interleaved head of d 64, positions), and MLA's key as one sbhd
sequence of the same tokens (positions), all bf16. Run from the repository root on a GPU:

    ncu --clock-control none -k regex:rotary_kernel -c 8 --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section InstructionStats --section ComputeWorkloadAnalysis \
        python3 artifacts/thd/ncu_narrow_tokens.py
"""
import os
import sys

sys.path.insert(0, os.getcwd())

import torch

from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQS, SEQ_LEN = (2048, 64) if DEVICE == "cuda" else (4, 8)     # small under the interpreter
CASES = [  # name, head dim, interleaved, layout, angles from positions (else TE's table)
    ("thd one head d128, positions", 128, False, "thd", True),
    ("thd one head d128, table", 128, False, "thd", False),
    ("thd MLA key d64, positions", 64, True, "thd", True),
    ("sbhd MLA key d64, positions", 64, True, "sbhd", True),
]


def main():
    tokens = SEQS * SEQ_LEN
    cu_seqlens = torch.arange(0, tokens + 1, SEQ_LEN, dtype=torch.int32, device=DEVICE)
    for name, d, interleaved, layout, from_positions in CASES:
        module = RotaryPositionEmbedding(d, interleaved=interleaved, device=DEVICE)
        if layout == "thd":
            t = torch.randn(tokens, 1, d, dtype=torch.bfloat16, device=DEVICE)
            freqs, options = module if from_positions else module(SEQ_LEN), dict(cu_seqlens=cu_seqlens)
        else:
            t = torch.randn(tokens, 1, 1, d, dtype=torch.bfloat16, device=DEVICE)
            freqs, options = module if from_positions else module(tokens), {}
        for _ in range(2):
            out = apply_rotary_pos_emb(t, freqs, layout, interleaved=interleaved, **options)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(name, tuple(out.shape), flush=True)


if __name__ == "__main__":
    main()
