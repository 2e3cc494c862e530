"""Packed thd of many short sequences (2048 x 64 and 4096 x 32 tokens, 8 heads of d 128): the
rule's search tiles (SEARCH_TILE_BYTES, 8 KiB of several tokens) against 16 and 32 KiB, in
one process, the rules taking turns (use_launch_rule), ROUNDS rounds; timed as the models
sweep times (rope_bench._run_models: rotating sets, kernels alone). On a CUDA device.

    python artifacts/thd/thd_search_tile_ab.py
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import rope_bench as B  # noqa: E402
from rope_bench_report import MODEL_POINT_BY_NAME, device_header  # noqa: E402
from triton_rotary_launch import GPU_RULE, use_launch_rule  # noqa: E402

POINTS = ["thd-2048x64-h8", "thd-4096x32-h8"]
RULES = {f"search tile {n // 1024} KiB": GPU_RULE._replace(search_tile_bytes=n)
         for n in (GPU_RULE.search_tile_bytes, 16384, 32768)}
ROUNDS = 2


def main():
    print(device_header(), flush=True)
    for r in range(1, ROUNDS + 1):
        for label, rule in RULES.items():
            rows = []
            with use_launch_rule(rule):
                B._run_models(["bf16", "fp16"], ["forward_kernel", "backward_kernel"], rows, {},
                              points=[MODEL_POINT_BY_NAME[p] for p in POINTS], progress=f"[{label}]")
            for row in rows:
                if row["provider"] in ("triton_positions", "flash_attn", "triton"):
                    print(f"round {r} {label.replace(' ', '_')} {row['x']} {row['dtype']} "
                          f"{row['mode']} {row['provider']} {row['copy_ms'] / row['ms']:.4f}",
                          flush=True)


if __name__ == "__main__":
    main()
