"""The source trees of artifacts/thd/narrow_tokens_ab_h200.log: the top-level sources of REV
(38a0cc3 for that log; the edits below are made against its text) as OUT/m, and each variant as
OUT/<run>_<tree>, m's sources with that variant's edits. Then, on the GPU machine, per run:

    python artifacts/thd/narrow_tokens_trees.py 38a0cc3 .ab/narrow
    bash artifacts/batch_of_one/ab_rounds.sh OUT POINTS DTYPES BUDGET_S .ab/narrow/m \\
        .ab/narrow/run3_r .ab/narrow/run3_r2 .ab/narrow/run3_p

(the log's header names each run's points and dtypes).
"""
import os
import subprocess
import sys

LAUNCH, KERNEL = "triton_rotary_launch.py", "triton_rotary_kernel.py"

# Tiles of one head's tokens, of `nbytes`, for a head-major view ([b, h, s, d] passed as bshd).
def head_major_tiles(nbytes):
    return {LAUNCH: [
        ("                  tile_bytes: int, rule: LaunchRule, whole_tokens: bool = False):",
         "                  tile_bytes: int, rule: LaunchRule, whole_tokens: bool = False,\n"
         "                  token_major: bool = False):"),
        ("    if not whole_tokens:\n        block_h = min(block_h, rows)\n",
         "    if not whole_tokens:\n        block_h = min(block_h, rows)\n"
         "    if token_major:\n        block_h = 1\n"),
        ("    if searches:\n        tile_bytes = rule.search_tile_bytes\n    elif lone",
         "    token_major = (lone and not is_thd and shape.nheads > 1\n"
         "                   and abs(x_strides[2]) > abs(x_strides[0]))\n"
         "    if searches:\n        tile_bytes = rule.search_tile_bytes\n"
         f"    elif token_major:\n        tile_bytes = {nbytes}\n    elif lone"),
        ('        whole_tokens=norm is not None and norm.over == "token")',
         '        whole_tokens=norm is not None and norm.over == "token", token_major=token_major)'),
    ]}


# Search tiles of `nbytes` with angles from positions.
def positions_search_tiles(nbytes):
    return {LAUNCH: [("    if searches:\n        tile_bytes = rule.search_tile_bytes\n",
                      "    if searches:\n        tile_bytes = rule.search_tile_bytes\n"
                      f"        if source.from_positions:\n            tile_bytes = {nbytes}\n")]}


# The guessed window in every search tile without a norm, angles from positions too.
POSITIONS_GUESS = {LAUNCH: [
    ("                  SEARCH_GUESS=(rule.search_guess and lone_search\n"
     "                                and (wide_token or not source.from_positions)),",
     "                  SEARCH_GUESS=(rule.search_guess and lone_search),")]}

# The barrier of sbhd positions tiles also in interleaved one-head tiles of TE's table.
TABLE_BARRIER = {KERNEL: [
    ("    elif (cfg.ANGLES_FROM_POSITIONS and cfg.POSITIONS_FROM == IMPLICIT_POSITIONS",
     "    elif ((cfg.ANGLES_FROM_POSITIONS or (cfg.INTERLEAVED and cfg.BLOCK_H == 1))\n"
     "          and cfg.POSITIONS_FROM == IMPLICIT_POSITIONS")]}


# Tokens of 1 KiB or more take the plain tile (SEARCH_WIDE_TOKEN 1024), for angles from
# positions only or for both paths.
def wide_token_1k(both_paths):
    threshold = "1024" if both_paths else "(1024 if source.from_positions else rule.search_wide_token)"
    return {LAUNCH: [("    wide_token = (lone_search and 0 < rule.search_wide_token <= token_bytes",
                      f"    wide_token = (lone_search and 0 < {threshold} <= token_bytes")]}


# A positions pre-pass (sequence_positions_kernel) for searching calls of tokens under 1 KiB.
NARROW_PRE_PASS = {LAUNCH: [
    ("    if searches and (norm_backward or (qk_norm and rule.qk_norm_positions_pass)):",
     "    narrow = (norm is None and k is None\n"
     "              and shape.nheads * shape.head_dim * t.element_size() < 1024)\n"
     "    if searches and (norm_backward or (qk_norm and rule.qk_norm_positions_pass) or narrow):"),
    ("        norm_group = _norm_group(norm, norm_input, partial)\n"
     "        if plan.positions_pass is not None:\n",
     "        norm_group = _norm_group(norm, norm_input, partial)\n"
     "    if plan.launch is not None and plan.positions_pass is not None:\n")]}

VARIANTS = {
    "run1_a": [head_major_tiles(2048), POSITIONS_GUESS, TABLE_BARRIER],
    "run1_b": [head_major_tiles(4096), positions_search_tiles(4096), POSITIONS_GUESS],
    "run2_b": [positions_search_tiles(4096), POSITIONS_GUESS, TABLE_BARRIER],
    "run2_c": [positions_search_tiles(4096)],
    "run2_d": [positions_search_tiles(2048), POSITIONS_GUESS],
    "run3_r": [wide_token_1k(both_paths=False), TABLE_BARRIER],
    "run3_r2": [wide_token_1k(both_paths=True), TABLE_BARRIER],
    "run3_p": [wide_token_1k(both_paths=False), TABLE_BARRIER, NARROW_PRE_PASS],
}


def sources(rev):
    """{file name: text} of REV's top-level files (not its folders)."""
    listing = subprocess.run(["git", "ls-tree", rev], capture_output=True, text=True,
                             check=True).stdout
    files = {}
    for line in listing.splitlines():
        meta, name = line.split("\t", 1)           # "<mode> <type> <object>\t<name>"
        if meta.split()[1] == "blob":
            files[name] = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True,
                                         text=True, check=True).stdout
    return files


def write_tree(folder, files):
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def main(rev, out):
    base = sources(rev)
    write_tree(os.path.join(out, "m"), base)
    for name, edits in VARIANTS.items():
        files = dict(base)
        for edit in edits:
            for file, pairs in edit.items():
                for old, new in pairs:
                    if files[file].count(old) != 1:
                        raise SystemExit(f"{name}: {file} has {files[file].count(old)} copies of "
                                         f"{old.splitlines()[0]!r}; the edits are of 38a0cc3's text")
                    files[file] = files[file].replace(old, new)
        write_tree(os.path.join(out, name), files)


if __name__ == "__main__":
    main(*sys.argv[1:3])
