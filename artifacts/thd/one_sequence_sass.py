"""Instructions of the code a thd tile runs, with and without SEARCH_ONE_SEQUENCE, where every
tile lies inside one sequence and the guessed window finds every tile's sequences (packed
sequences of one length longer than a tile): per planned launch, the SASS instruction count of
the kernel compiled with the branch such a tile skips taken out of the sources (the guessed
window's search fallback, or the per-token path behind `_tile_in_one_sequence`). No GPU
needed (Triton's ptxas and nvdisasm, sm_90); run from the repository root:

    python artifacts/thd/one_sequence_sass.py

The launches are the GPU rule's (132 SMs) for thd-2048x64-h1 (2048 sequences of 64 tokens, one
head of d 128) in bf16 and float32, and thd-2048x64-h8 in bf16: angles from positions and TE's
table, forward and backward; and, for comparison, the sbhd forward launches of 8B-TP8-k-64K
(the same kind of token as one sequence of 65536, which searches nothing). "per token": warp
instructions per token of the straight path (instructions x warps / tokens per tile).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.getcwd()
SOURCES = ["triton_rotary_kernel.py", "triton_rotary_launch.py", "triton_rotary_main.py",
           "rope_sass_probe.py", "te_comparator.py"]
WINDOW_FALLBACK = """        if found == 0:
            seq, seq_start, seq_end = _searched_sequences(cu_seqlens, first_tok, next_start,
                                                          num_seqs, num_tokens, cp_size,
                                                          SEARCH_LEVELS)
"""
INSIDE_FALLBACK = """        if _tile_in_one_sequence(hit, g_end, first_tok, num_tokens, cp_size,
                                 next_start.shape[0]) == 0:
            seq, seq_start, seq_end = _guessed_or_searched_sequences(
                cu_seqlens, first_tok, next_start, num_seqs, num_tokens, cp_size, SEARCH_LEVELS,
                SEARCH_GUESS)
"""
CASES = [(2048, 64, 1, "bfloat16"), (2048, 64, 1, "float32"), (2048, 64, 8, "bfloat16")]


def record(one_sequence):
    """The planned launches (rope_sass_probe.planned_launch_record), under Triton's
    interpreter, with Variant.SEARCH_ONE_SEQUENCE set to `one_sequence` in every thd launch
    that searches, whichever of them the launch rule plans it for."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    import torch

    import rope_sass_probe
    import triton_rotary_kernel as K
    import triton_rotary_launch as L
    from triton_rotary_main import RotaryPositionEmbedding
    records, names = [], []

    L._Launch.__call__ = lambda launch, *args: records.append(
        rope_sass_probe.planned_launch_record(launch, args))
    L._sm_count = lambda device: 132
    with L.use_launch_rule(L.GPU_RULE._replace(search_one_sequence=one_sequence)):
        module = RotaryPositionEmbedding(128)
        t = torch.randn(65536, 1, 1, 128, dtype=torch.bfloat16)
        for path, freqs in (("positions", module), ("table", module(65536))):
            L.set_rotary_kernel(t, freqs)
            names.append(f"sbhd 8B-TP8-k-64K bfloat16 {path} forward")
        for seqs, length, heads, dtype in CASES:
            t = torch.randn(seqs * length, heads, 128, dtype=getattr(torch, dtype))
            cu = torch.arange(seqs + 1, dtype=torch.int32) * length
            module = RotaryPositionEmbedding(128)
            for path, freqs in (("positions", module), ("table", module(length))):
                for backward in (False, True):
                    L.set_rotary_kernel(t, freqs, tensor_format="thd", cu_seqlens=cu,
                                        backward=backward)
                    names.append(f"thd-{seqs}x{length}-h{heads} {dtype} {path} "
                                 f"{'backward' if backward else 'forward'}")
    flag, is_thd, levels = (K.Variant._fields.index(f)
                            for f in ("SEARCH_ONE_SEQUENCE", "IS_THD", "SEARCH_LEVELS"))
    for r in records:
        fields = r["constexprs"][0]["fields"]
        if fields[is_thd] and fields[levels]:
            fields[flag] = one_sequence
    return names, records


def counts(tree, records):
    """Each launch's SASS instructions, compiled from the sources in `tree`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(records, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "rope_sass_probe.py", "--launch-stats", f.name],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    os.unlink(f.name)
    return [json.loads(line)["instructions"] for line in run.stdout.splitlines()]


def stripped_tree(folder, branch):
    os.makedirs(folder)
    for name in SOURCES:
        shutil.copy(os.path.join(ROOT, name), folder)
    path = os.path.join(folder, "triton_rotary_kernel.py")
    text = open(path).read()
    assert text.count(branch) == 1, "the kernel's branch is no longer as this script knows it"
    open(path, "w").write(text.replace(branch, ""))
    return folder


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        print(json.dumps(record(sys.argv[2] == "on")))
        sys.exit()
    runs = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, __file__, "--record", mode], capture_output=True,
                             text=True, check=True).stdout
        runs[mode] = json.loads(out)
    names = runs["off"][0]
    with tempfile.TemporaryDirectory() as tmp:
        window = counts(stripped_tree(os.path.join(tmp, "window"), WINDOW_FALLBACK), runs["off"][1])
        inside = counts(stripped_tree(os.path.join(tmp, "inside"), INSIDE_FALLBACK), runs["on"][1])
    whole_off, whole_on = counts(ROOT, runs["off"][1]), counts(ROOT, runs["on"][1])
    print(f"{'launch':44} {'tile':>4} {'warps':>5} {'window path':>11} {'inside path':>11} "
          f"{'per token':>11} {'kernel off':>10} {'kernel on':>9}")
    for i, name in enumerate(names):
        record = runs["off"][1][i]
        block_t, warps = record["constexprs"][0]["fields"][0], record["num_warps"]
        per_token = f"{window[i] * warps / block_t:.0f} -> {inside[i] * warps / block_t:.0f}"
        if name.startswith("sbhd"):      # no search: every path is the kernel
            per_token = f"{whole_off[i] * warps / block_t:.0f}"
        print(f"{name:44} {block_t:4} {warps:5} {window[i]:11} {inside[i]:11} {per_token:>11} "
              f"{whole_off[i]:10} {whole_on[i]:9}")
