"""Packed thd of many short sequences with angles from positions: the rule's tiles (8 KiB tiles
of several tokens that search cu_seqlens) against two variants, each in its own source tree
(on a CUDA device). V1: those tiles first read the guessed window of cu_seqlens
(SEARCH_GUESS) where the call has more than 32 sequences; V2: such calls take the plain 4 KiB
tile with the guessed window, as a token of 4 KiB or more does (SEARCH_WIDE_TOKEN).
Timed as the models sweep times (rope_bench._run_models: rotating sets, kernels alone).

    python artifacts/thd/thd_positions_guess_ab.py TREE LABEL     # one process per tree

thd_positions_guess_ab.sh beside this makes the two trees from this checkout and runs all three
in turn.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(sys.argv[1]))
import rope_bench as B  # noqa: E402
from rope_bench_report import MODEL_POINT_BY_NAME  # noqa: E402

POINTS = ["thd-2048x64-h8", "thd-4096x32-h8", "VLM-7B-k-thd-8x8K", "thd-lognormal-32K-h16"]


def main():
    label, rows = sys.argv[2], []
    B._run_models(["bf16", "fp16"], ["forward_kernel", "backward_kernel"], rows, {},
                  points=[MODEL_POINT_BY_NAME[p] for p in POINTS], progress=f"[{label}]")
    for r in rows:
        if r["provider"] in ("triton_positions", "flash_attn", "triton"):
            print(f"AB {label} {r['x']} {r['dtype']} {r['mode']} {r['provider']} "
                  f"{r['copy_ms'] / r['ms']:.4f}", flush=True)


if __name__ == "__main__":
    main()
