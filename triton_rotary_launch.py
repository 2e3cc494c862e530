"""The launcher of the RoPE kernels in triton_rotary_kernel.py: argument checks (the one place
they live), the launch rule and grid, the cached launch plan, and the launch itself.

`set_rotary_kernel` and `set_rotary_qkv_kernel` are what triton_rotary_main's autograd
functions and custom ops call: one plan lookup (or, on a miss, the checks and a new plan) and
one kernel launch.
"""

import contextlib
import functools
import math
import numbers
import os
import warnings
import weakref
from typing import NamedTuple, Optional

import torch
import triton

from triton_rotary_kernel import (
    _INTERPRETING,
    AXIS_POSITIONS_TENSOR,
    IMPLICIT_POSITIONS,
    NO_NORM,
    NORM_OVER_HEAD,
    NORM_OVER_TOKEN,
    POSITIONS_TENSOR,
    SEARCH_FAN,
    SEQUENCE_POSITIONS,
    Angles,
    HeadShape,
    InOut,
    Norm,
    Positions,
    PositionsTile,
    QKShape,
    QKVShape,
    Tokens,
    Variant,
    View,
    WeightGradientTile,
    rotary_kernel,
    rotary_qk_kernel,
    rotary_qkv_kernel,
    sequence_positions_kernel,
    weight_gradient_kernel,
)

TENSOR_FORMATS = ("sbhd", "bshd", "thd")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1
# thd: the search for a token's sequence looks up to TILE_FAN times past an index of
# cu_seqlens, in int32.
MAX_SEQUENCES = 2**26
# Launch rule (docs/design.md). A program rotates a tile of whole (token, head)
# rows, about TILE_BYTES of them: the fewest heads of one token that hold TILE_BYTES, or all
# its heads and then as many tokens as it takes, with NUM_WARPS warps. At 4 warps a tile of
# 4 KiB has each thread load one 16-byte vector of each half of the rotated channels. Tiles
# shrink (tokens first, then heads) while fewer than MIN_PROGRAMS_PER_SM programs per SM
# would remain.
TILE_BYTES = 4096
NUM_WARPS = 4
MIN_PROGRAMS_PER_SM = 4
# A tensor of one head per token (a key at TP 8, MLA's shared key) rotated in a call of its
# own, without a norm, takes tiles of ONE_HEAD_TILE_BYTES (not where q and k share a launch,
# whose tiles follow q's, nor where thd tiles search cu_seqlens: SEARCH_TILE_BYTES). At 4 KiB,
# Llama's key of d 128 in 16 bits gives each thread 8 pairs of one token, whose frequencies
# take two 16-byte loads, and ptxas issues the second after the first sin/cos (Triton 3.6,
# sm_90: loads at SASS instructions 42, 43, 45 and 140, first sin/cos at 69); at 2 KiB a
# thread has 4 pairs and one such load (loads at 39, 40, 42, first sin/cos at 97). Kernels
# alone, fraction of copy speed, 4 KiB -> 2 KiB, H200 (artifacts/tiles/one_head_tile_ab_h200.log,
# run 3): TP 8 keys of Llama 3 8B and 70B, 16-bit, positions path 0.964-0.974 -> 0.98-0.99,
# TE's table +0.017 to +0.046; MLA's key (d 64) positions +0.001 to +0.015, table within 0.005;
# float32 positions path +0.003 to +0.009, table within 0.003 (run 2). Measured at d 64 and
# 128 only. Two heads of d 64 lost at 2 KiB (positions -0.015 to -0.028, run 2), so the rule
# is for one head. Not run on the H100.
ONE_HEAD_TILE_BYTES = 2048
# thd calls whose tiles search cu_seqlens for their tokens' sequences. A token (all its heads)
# narrower than SEARCH_WIDE_TOKEN takes tiles of SEARCH_TILE_BYTES: more tokens per program,
# more of their latency-bound searches in flight at once. Smaller tiles lost at one head of d 128
# and two of d 64 (kernels alone, H200, artifacts/thd/narrow_tokens_ab_h200.log, run 2): 4 KiB
# -0.05 to -0.07 of copy speed in bf16 and -0.11 at one head in float32 (two heads of d 64 in
# float32 +0.02); 2 KiB -0.24 to -0.75.
# A token of SEARCH_WIDE_TOKEN or more takes the plain TILE_BYTES tile (up to four tokens) with
# the guessed window (SEARCH_GUESS), and with TE's table TABLE_WARPS warps. Kernels alone,
# fraction of copy speed:
# - 16 heads of d 128 (4 KiB tokens), angles from positions: bf16 0.94 -> 0.98 on the H200,
#   0.97 -> 0.975 on the H100; float32 packed points 0.96-0.97 -> 0.995-1.004 / 0.990-1.003
#   (artifacts/tiles/positions_rule_ab_h200_5.log, _h100_4.log). TE's table, 4 KiB in 2 warps
#   against 8 KiB in 4, H200 (artifacts/thd/thd_table_wide_token_ab_h200.log): lognormal lengths
#   bf16 0.913-0.919 -> 0.953-0.956, float32 about +0.02 at lognormal and mixed lengths and at
#   8 heads; 4 KiB in 4 warps, 16 KiB in 4 and 8 KiB in 2 lost; 16-bit tokens of 8 KiB keep the
#   search tile (TABLE_SEARCH_TOKEN_16BIT).
# - 8 and 4 heads of d 128 (2 and 1 KiB tokens in bf16; 4 heads in float32), H200
#   (narrow_tokens_ab_h200.log, run 3): positions path at 8 heads in bf16, uniform and lognormal
#   lengths, 0.956-0.964 -> 0.982-0.990; 4 heads of mixed lengths bf16 +0.006 / +0.008, float32
#   0.972 -> 0.994; TE's table (2 warps) +0.019 to +0.051. Without the guess (run 2) uniform
#   lengths gained more, and in bf16 lognormal and mixed ones lost up to 0.033.
# Tokens of 256 and 512 bytes keep the search tile: in the plain 4 KiB tile with the guess
# (positions path, run 2) one head of d 128 gained in bf16 (+0.011 / +0.022) and lost in float32
# (-0.54), two heads of d 64 lost in bf16 (-0.11 / -0.12) and gained in float32 (+0.02); no
# threshold of bytes separates them. Not measured: tokens between 2 and 4 KiB (12 heads of
# d 128 in bf16), fp16 at 1-2 KiB, and any of it on the H100.
SEARCH_TILE_BYTES = 8192
SEARCH_WIDE_TOKEN = 1024
# Tiles of calls that search, with angles from positions, take SEARCH_WARPS warps. 8 instead of 4,
# bf16: on four H100 machines (positions_tiles_ab_h100*.log, positions_rule_ab_h100*.log) 2048 and
# 4096 packed sequences of 64 and 32 tokens and lognormal lengths gained 0.003-0.013 (0.971-0.982 ->
# 0.974-0.991); on the H200 (positions_rule_ab_h200.log) the same uniform sequences lost 0.07-0.11
# (0.947-0.955 -> 0.839-0.886).
SEARCH_WARPS = 4
# With TE's table, a token in a 16-bit dtype of TABLE_SEARCH_TOKEN_16BIT bytes or more (32
# heads of d 128) keeps the search tile, which then holds the whole token: each sin/cos serves
# all its heads, twice as many as in the plain tile. That won only in 16-bit dtypes (twice the
# pairs per byte of float32). Kernels alone, H200, two A B A B runs in one lease
# (artifacts/thd/thd_table_token_ab_h200.log), plain tile in 2 warps -> search tile: 16
# sequences of 2048 tokens bf16 0.917-0.931 -> 0.945-0.948, fp16 0.920-0.928 -> 0.937-0.947;
# mixed lengths fp16 0.930-0.943 -> 0.953-0.962, bf16 within 0.01 (0.951-0.961 -> 0.953-0.961);
# float32 tokens of 8 and 16 KiB lost (0.98-0.99 -> 0.96-0.97) and keep the plain tile. The
# parameter sweeps' thd_empty_sequences (this shape, bf16) had read 0.015-0.035 lower with the
# plain tile. Not run on the H100.
TABLE_SEARCH_TOKEN_16BIT = SEARCH_TILE_BYTES
# thd search tiles first read the window of cu_seqlens where the tile would lie were all
# sequences of one length, and search only where it does not hold all their tokens' sequences
# (`_guessed_sequences`): a chain of one dependent load instead of two to five (below 65 536
# sequences). Kernels alone, with it
# against without (positions_rule_ab_h200_5.log, _h100_4.log): TE's table on the H200
# +0.003-0.019 of copy speed at lognormal and mixed lengths and at float32 uniform ones,
# -0.006 to +0.001 at bf16 uniform ones; on the H100 +0.001-0.005 at bf16 and float32 uniform
# lengths; angles from positions in tiles of wide tokens up to +0.01 (float32). Search tiles
# with angles from positions go without, but for one head (below): it cost the VLM key, when
# its tiles of 8 tokens searched, up to 0.037 on the H200 (positions_rule_ab_h200_2.log,
# _4.log), and 8 heads of d 128 in bf16, when they took 8 KiB search tiles, 0.000-0.007
# (artifacts/thd/narrow_tokens_ab_h200.log, run 1).
SEARCH_GUESS = True
# Search tiles with angles from positions whose tokens are one head of SEARCH_GUESS_ONE_HEAD_TOKEN
# bytes or more read the guessed window too. Kernels alone, fraction of copy speed, with it against
# without, H200 (artifacts/thd/narrow_tokens_guess_ab_h200.log, run 2): one head of d 128 in
# 16 bits 0.714-0.760 -> 0.815-0.830 at uniform lengths of 32 and 64 and at lognormal ones,
# float32 +0.003 to +0.019; one head of d 64 (MLA's key) in float32 +0.053 / +0.054 but in
# 16 bits -0.007 to -0.010; two heads of d 64 in 16 bits -0.016 to -0.022, in float32 +0.000 to
# +0.008. Those runs, without SEARCH_WINDOW_FIRST, put the bound at 256 bytes. With it (16-bit
# one-head tiles find the first token's sequence in the window), MLA's key in 16 bits (128
# bytes) wins too, against no window (artifacts/thd/guess_one_head_token_ab_h200.log): at
# lognormal lengths 0.584-0.587 -> 0.772-0.777, at 2048 x 64 tokens bf16 backward 0.762 ->
# 0.827, fp16 +0.012 / +0.016, bf16 forward +0.002. So from 128 bytes on. Not measured: one
# head of d 256 (512 bytes in 16 bits), one-head tokens of 128 bytes in float32 (d 32, which
# take the window without SEARCH_WINDOW_FIRST), anything on the H100.
SEARCH_GUESS_ONE_HEAD_TOKEN = 128
# thd tiles that lie inside their first token's sequence can take it without a search
# (`_tile_in_one_sequence`): the checked guess's two loads decide it for the whole tile, and
# its tokens skip the per-token compares of the guessed window or the search. Kept where it
# won on the H200 at packed batches of one length and lost nothing beyond 0.007 of copy speed
# at lognormal ones (whose tiles the guess misses): lone search tiles of narrow tokens
# (under SEARCH_WIDE_TOKEN), with angles from positions where they go without the guessed
# window, and with TE's table at one head per token. Kernels alone, fraction of copy speed
# (artifacts/thd/one_sequence_ab_h200.log, run 3): MLA's key (one head of d 64, interleaved)
# at 2048 sequences of 64 tokens, bf16, positions 0.634 -> 0.823 forward, 0.637 -> 0.764
# backward, table 0.39 -> 0.48; two heads of d 64, positions, bf16 0.90 -> 0.96, float32
# +0.006; one head of d 128, table, bf16 0.53 -> 0.58, float32 0.90 -> 0.92; at lognormal
# lengths -0.007 to +0.044. Left out, for what they lost (runs 1 and 2): tiles that read the
# guessed window with angles from positions (one head of d 128 at lognormal lengths, bf16,
# 0.875 -> 0.825), TE's table at two heads of d 64 (bf16 forward -0.03, -0.05 at lognormal
# lengths) and wide tokens (8 heads of d 128 in bf16, positions -0.015). Loading the window
# beside the checked guess instead of after it lost on the hits and won nothing at lognormal
# lengths (run 2). Not run on the H100.
SEARCH_ONE_SEQUENCE = True
# 16-bit search tiles that read the guessed window (narrow tokens: one head of
# SEARCH_GUESS_ONE_HEAD_TOKEN bytes or more with angles from positions, TE's table at one
# head) check it for one sequence first, from the window itself (SEARCH_WINDOW_FIRST: one
# vector load and two scalar sums, which find the first token's sequence wherever the guess is
# off by fewer sequences than the window holds, and the window serves the tile's tokens on a
# miss) rather than from the checked guess (which finds it only where lengths are uniform).
# Kernels alone, fraction of copy speed, one H200, forward / backward
# (artifacts/thd/window_first_ab_h200.log, run 2): one head of d 128 with angles from
# positions, which took no shortcut without it, bf16 at 2048 x 64 tokens 0.877 / 0.869 ->
# 0.946 / 0.962, 4096 x 32 0.876 / 0.868 -> 0.954 / 0.956, lognormal lengths 0.877 / 0.873 ->
# 0.945 / 0.950, fp16 +0.059 to +0.078; TE's table at one head, against the checked guess, at
# lognormal lengths d 128 0.56 -> 0.60, MLA's key 0.40 -> 0.47 (bf16 and fp16), at uniform
# lengths -0.002 to -0.010. In float32 (run 1) it lost at every one-head table point (-0.007
# to -0.024) and at one head of d 128 with positions (0.972 -> 0.967), though it won at MLA's
# key with positions (0.908 / 0.909 -> 0.940 / 0.944): float32 keeps the checked guess with
# the table, and with positions takes the window first only for tokens of at most
# SEARCH_WINDOW_FIRST_FLOAT32_TOKEN bytes (MLA's key is 256, one head of d 128 is 512; d 32,
# 128 bytes, was not measured). Against no float32 tile taking it
# (artifacts/thd/window_first_float32_ab_h200.log), MLA's key at 2048 x 64 tokens 0.909 /
# 0.912 -> 0.976 / 0.986, at lognormal lengths 0.946 / 0.943 -> 0.973 / 0.964; one head of
# d 128 is better off with the guessed window and no shortcut than without the window and with
# the checked guess (lognormal lengths 0.974 -> 0.920). Not run on the H100.
SEARCH_WINDOW_FIRST = True
SEARCH_WINDOW_FIRST_FLOAT32_TOKEN = 256
# Fused-QKV query tiles hold this much: its programs also copy the value heads and pick q, k
# or v by program id, work that smaller tiles repeat more often.
QKV_TILE_BYTES = 8192
# A tile of TE's table (angles read, not made from positions) whose angles serve at least
# TABLE_WARPS_MIN_HEADS heads takes TABLE_WARPS warps. Its table row is a load the rotation
# waits for, then sin/cos, which were float32 polynomials in every dtype when this was timed:
# 48-56 registers a thread at 4 warps (sm_90, Triton 3.6), so that registers, not warps, cap
# an SM at 9-10 programs, 56-63% occupancy, where the positions path's 32 registers fill it
# (ncu, H200, artifacts/tiles/). Half the threads, each with two vectors of each half, put more
# of the tile's bytes in flight per SM.
# Kernels alone, bf16 forward, fraction of copy speed, 4 -> 2 warps, in one process per GPU
# (artifacts/tiles/tile_variants_ab_h200.log, table_warps_ab_h100.log): H200 40 heads 0.884 ->
# 0.951, Qwen2-VL's 28 query heads 0.889 -> 0.934 (packed: 0.819 -> 0.935), Llama 8B's and
# 70B's query heads 0.930 -> 0.950 and 0.936 -> 0.960; H100 -1.4% to +0.9% at those points but
# the packed one, 0.889 -> 0.960. At two heads (d 64) 2 warps lost on the H200 (0.668 ->
# 0.550): each thread then works out more angles per byte it moves. Search tiles of
# cu_seqlens (tokens under SEARCH_WIDE_TOKEN) keep 4: in 2 warps their 8 KiB tiles of several
# tokens did not gain (0.965 -> 0.948, timed when 8 heads of d 128 in bf16 took them).
# Register caps (maxnreg 32) spilled. The hardware's sin/cos that 16-bit tiles take
# (`_rotation_from_table`) were timed in 2 warps only, against the polynomials: Llama 8B's
# query heads and fused QKV within 0.003 (bf16, one H200); 4 warps were not timed with them.
TABLE_WARPS = 2
TABLE_WARPS_MIN_HEADS = 4
# With a norm, a program holds a tile's loads until each row's sums are complete, and the
# backward holds two tiles (the gradient and the norm's input) and its sums of dL/dweight. The
# forward takes the plain tile in NORM_WARPS warps (each thread two 16-byte vectors of each half
# at 4 KiB, bf16, d 128): 1.06-1.09 copies at the Qwen3, Gemma 3 and OLMo 2 shapes on the H100,
# where 4 warps gave 1.12-1.22 (docs/results.md). A tile of one head takes NORM_ONE_HEAD_WARPS:
# its threads cannot share a token's angles across heads, so each works out one per pair it
# holds. Kernels alone, one key head of d 128 (Qwen3-8B at tensor parallelism 8), bf16, 16K-64K
# tokens, exact angles: 1.30-1.31 -> 1.09-1.11 copies (H100), 1.50-1.63 -> 1.24-1.33 (H200).
NORM_WARPS = 2
NORM_ONE_HEAD_WARPS = 4
# With angles from positions, a forward tile of 2 to NORM_POSITIONS_MAX_HEADS heads holds
# NORM_POSITIONS_TILE_BYTES in NORM_POSITIONS_WARPS warps (as many elements per thread as
# NORM_WARPS at 4 KiB), and the fused QKV's tile takes NORM_POSITIONS_WARPS too. Kernels alone,
# bf16, each tensor apart, in copies of it, against 4 KiB in NORM_WARPS (the fused QKV: its
# 8 KiB in NORM_WARPS), H100 / H200 (artifacts/qknorm/launch_rule_ab_*): Qwen3-8B's 8 key
# heads at 8K tokens 1.06 -> 1.02 / 1.14 -> 1.06, tensor parallelism 8's 4 query heads at 16K
# 1.07 -> 1.03 / 1.17 -> 1.12, packed thd key heads 1.10 -> 1.06 / 1.25 -> 1.15, Gemma 3's 16
# query heads 1.01 -> 1.01 / 1.05 -> 1.03; fused QKV at TP 8 1.10 -> 1.04 / 1.21 -> 1.16 and
# Gemma 3 1.02 -> 1.01 / 1.13 -> 1.03, the same elsewhere but TP 8 at 64K tokens on the H200
# (1.12 -> 1.13). The same A/B run earlier with every norm forward in 8 KiB tiles of 4 warps
# (its logs not kept) is why the rest keep the plain tile: Qwen3-8B's 32 and Qwen3-32B's 64
# query heads (a token's heads fill 8 KiB or more) were 1.3-2.1% slower on the H200 (0.1-0.9%
# on the H100); a table's angles at 32-64 heads on the H100 too (Qwen3-8B 1.06 -> 1.11,
# Qwen3-32B 1.03 -> 1.08); a tile of one head (tensor parallelism 8's key head, exact angles,
# 16K tokens) 1.09 -> 1.31 on the H100.
# With q and k together (set_rotary_qk_kernel), a key tile that would take this tile goes beside
# a query tile of more than NORM_POSITIONS_MAX_HEADS heads (the plain tile in NORM_WARPS) in
# the plain tile and NORM_WARPS too, so that both go in one launch (`_joins`). Forward through
# the public call, in copies of q and k, H100 / H200 (artifacts/qknorm/key_tile_ab_h100.log,
# key_tile_ab_h200.log): Qwen3-8B at 8K-32K tokens 1.019-1.027 -> 0.986-1.001 / 1.023-1.059 ->
# 0.996-1.002, Qwen3-32B 1.017 -> 1.001 / 1.022 -> 1.004, packed thd 1.051 -> 1.016 / 1.081 ->
# 1.083; in the key tile of the query's bytes instead, packed thd was 1.13 on the H200.
NORM_POSITIONS_TILE_BYTES = 8192
NORM_POSITIONS_WARPS = 4
NORM_POSITIONS_MAX_HEADS = 16
# The forward of q and k with per-head norms takes pair tiles (`_norm_pair_tiles`: q's own
# forward tile with the key heads of its tokens joined, their angles worked out once for both)
# where a query of several heads meets at most NORM_PAIR_KEY_HEADS key heads. Alone, a
# one-head key tile works out an angle for every pair it rotates, and with TE's table reads a
# table row per token a second time. Kernels alone, bf16, in copies of q and k, H100, three runs
# (artifacts/qknorm/one_head_key_pair_tiles_ab_h100.log, `python rope_qknorm_pair_tiles.py`),
# against q's and k's own tiles: Qwen3-8B under TP 8 (4 query heads) at 16K tokens exact angles
# 0.867-0.870 -> 0.836-0.841, TE's table 1.264-1.277 -> 1.028-1.031, at 64K 0.990-0.995 ->
# 0.979-0.989 and 1.401-1.411 -> 1.166-1.172; Qwen3-32B under TP 8 (8 query heads) 0.981-0.990
# -> 0.972-0.982 and 1.242-1.249 -> 1.090-1.094; forward + backward lower by about as much. On
# the H200 (two runs, artifacts/qknorm/one_head_key_pair_tiles_ab_h200.log) the same points
# gained (run 1: exact 0.980 -> 0.950, 1.125 -> 1.102; table 1.449 -> 1.168, 1.539 -> 1.304;
# 32B's table 1.323 -> 1.171), but 32B's 8 query heads with exact angles lost, 1.068-1.075 ->
# 1.125-1.133: with angles from positions, a query of more than NORM_PAIR_EXACT_MAX_HEADS heads
# keeps separate tiles. A one-head query keeps separate tiles (its own tile,
# NORM_ONE_HEAD_WARPS); not measured. With Qwen3-8B's 8 key heads, pair tiles (an earlier
# kernel) were slower on the H200: 1.17-1.20 against 1.02-1.06
# (artifacts/qknorm/pair_tiles_ab_h200.log).
# A query of 2 to NORM_PAIR_FEW_HEADS heads shares each angle among few heads, so its pair tile
# works out more angles per byte it moves: with exact angles it normalizes after them
# (Variant.NORM_AFTER_ANGLES: their arithmetic fills the wait for the loads), with a table it
# holds half the plain tile's bytes. Same runs, q's own tile against this: Gemma 3 under TP 8
# (2 query heads of d 256, 32K tokens) exact 1.060-1.081 -> 0.975-0.980, table 1.595-1.626 ->
# 1.262-1.266 (q's and k's own tiles: 1.043-1.046 and 1.777-1.827); Qwen3-8B under TP 16 (2 of
# d 128, 64K) exact 0.971-0.974 -> 0.967-0.972, table 1.434-1.503 -> 1.258-1.269. At 4 query
# heads both lost: after the angles 0.836 -> 0.878-0.884 (TP 8, 16K tokens), half the tile
# 1.028-1.031 -> 1.075-1.084. On the H200 (same log): Gemma 3 exact 1.274 -> 1.077, table
# 1.890 -> 1.494; TP 16 exact 1.096 -> 1.084, table 1.812 -> 1.456.
NORM_PAIR_KEY_HEADS = 1
NORM_PAIR_FEW_HEADS = 2
NORM_PAIR_EXACT_MAX_HEADS = 4
# The backward takes tiles of NORM_BACKWARD_ROWS (token, head) rows (a norm over the whole
# token: whole tokens), the fused QKV's query tiles too, in as many warps as give each thread
# NORM_BACKWARD_THREAD_ELEMENTS elements of the tile, at most NORM_BACKWARD_MAX_WARPS, and
# launches NORM_BACKWARD_WARPS_PER_SM warps per SM along the tokens, each program looping over
# its share of the token blocks (as many as are resident at once, so that none waits for a
# second wave; the per-program partial sums of dL/dweight stay a small fraction of the
# traffic). At bf16 that is 4 KiB in 4 warps at d 128, 8 KiB in 8 warps at d 256, 2 KiB in 2
# warps at d 64. Kernels alone, bf16, against 8 KiB in 8 warps at every d (in copies of the
# tensor; ideal 1.5), H100 / H200: Qwen3-8B's 8 key heads 1.73 -> 1.71 / 1.96 -> 1.77 (exact
# angles), 2.04 -> 1.89 / 2.58 -> 2.25 (TE's table); Qwen3-8B's query and key heads at
# tensor parallelism 8, 64K tokens, exact angles, 4 heads 1.89 -> 1.72 / 2.64 -> 1.75, 1 head
# 2.64 -> 2.45 / 3.48 -> 3.25; two heads of d 64 2.58 -> 2.18 (H100). Slower at one point:
# 32 heads, packed thd with positions, H200, 1.62 -> 1.68. Tiles of 8 rows were 1.5-2.5x
# slower with exact angles (Gemma 3's d 256 in 4 KiB, d 128 in 2 KiB). The fused QKV's
# backward takes the same tiles and pipelining; against its 8 KiB query tiles, unpipelined, in
# copies of qkv, H100 / H200, exact angles: Qwen3-8B (8K tokens) 1.94 -> 1.87 / 2.45 -> 2.08,
# TP 8 at 16K 2.78 -> 1.84 / 3.65 -> 2.44 and at 64K 2.60 -> 1.60 / 3.51 -> 2.20, Qwen3-32B
# 1.82 -> 1.84 / 2.20 -> 2.01, Gemma 3 1.67 -> 1.72 / 1.95 -> 2.04 (slower); TE's table
# (8 rows): Qwen3-8B 1.99 -> 1.62 / 2.56 -> 1.89, TP 8 4.49 -> 2.23 / 5.95 -> 2.86, Gemma 3
# 1.74 -> 1.66 / 2.08 -> 1.97, Qwen3-32B 1.87 -> 2.20 / 2.31 -> 2.70 (slower). Unpipelined
# 16-row tiles were faster at Qwen3-8B (1.63 / 1.90) but slower at TP 8 and Qwen3-32B.
NORM_BACKWARD_ROWS = 16
# Angles from a table keep their loop unpipelined (NORM_PIPELINE_STAGES) and read their angles
# from the table, not from sin/cos each thread works out: there tiles of half the rows are
# faster. Kernels alone, q and k at 16K tokens, bf16 (rope_qknorm_rules.py, artifacts/qknorm/
# rules_*), in copies of q and k, H100 / H200, 8 rows against 16: Qwen3-8B 1.69 / 1.96 against
# 1.72 / 2.03, its TP-8 rank 2.36 / 2.82 against 2.46 / 2.98, Gemma 3 1.76 / 2.07 against 1.88 /
# 2.26, OLMo 2 (a token per tile either way) the same; 4 rows were faster at TP 8 alone.
NORM_TABLE_BACKWARD_ROWS = 8
NORM_BACKWARD_THREAD_ELEMENTS = 16
NORM_BACKWARD_MAX_WARPS = 8
NORM_BACKWARD_WARPS_PER_SM = 16
# thd calls that search cu_seqlens: the backward of a norm reads its tokens' positions from a
# pre-pass (sequence_positions_kernel, SEQUENCE_POSITIONS_BLOCK tokens per program in
# NUM_WARPS warps) instead of searching in every tile of its token loop, which lets that loop
# be pipelined. 14 packed sequences of lognormal lengths, 16K tokens, Qwen3-8B's q and k, bf16,
# exact angles, through autograd (rope_qknorm_bench.py): forward + backward 252 -> 231 us on
# the H200 (3.02 -> 2.74 copies), 313 -> 312 us on the H100. The query's backward kernel alone
# (32 heads): 1.89 -> 1.68 copies (H200), 1.64 either way (H100).
SEQUENCE_POSITIONS_BLOCK = 256
# That backward's token loop is software-pipelined this many stages deep where its angles come
# from positions: the next tiles' loads go to shared memory while a tile is worked on. Kernels
# alone, q and k at 16K tokens, bf16, exact angles (rope_qknorm_rules.py, artifacts/qknorm/
# rules_*), in copies of q and k, H100 / H200: Qwen3-8B 1.73 / 1.81 against 1.84 / 2.21
# unpipelined, Gemma 3 1.80 / 1.81 against 1.86 / 2.23, OLMo 2 1.77 / 1.83 against 2.07 / 2.62;
# 2 stages were slower everywhere, 4 everywhere but OLMo 2 on the H200 (1% faster). The
# pipelined tiles share their angles through `_own_layout` (`_tile_angles`). Each thread
# working out its own instead (more instructions, no barrier) measured 2.06, 2.08 and 2.15 on
# the H200, which is bound by instruction issue there, and 1.73, 1.73 and 1.69 on the H100,
# up to 5% faster there (docs/results.md); through autograd, sharing moved the H100's forward +
# backward by -4% to +2% and cut the H200's by 6-9%. Angles from a table keep the
# plain loop: pipelined, with shared angles, 6-9% slower at five of the six points.
NORM_PIPELINE_STAGES = 3
# The thd positions pre-pass (SEQUENCE_POSITIONS_BLOCK) serves the forward of q and k with
# norms in one call (set_rotary_qk_kernel) too, once for both: on the H200 a tile's search
# costs more than its share of the pass. Packed thd, Qwen3-8B's q and k, 16K tokens, bf16,
# kernels alone, in copies of q and k, search -> pre-pass
# (artifacts/qknorm/thd_positions_pass_ab_*): H200 exact angles 1.088 -> 1.032, TE's table
# 1.206 -> 1.127; H100 1.007 -> 1.018 and 1.043 -> 1.033. A call for one tensor keeps the
# search: with a pass of its own, q's and k's calls ran 1.082 -> 1.083 and 1.215 -> 1.171 on
# the H200, 1.029 -> 1.061 and 1.068 -> 1.083 on the H100.
QK_NORM_POSITIONS_PASS = True
# A pipelined norm backward plans NORM_BACKWARD_WARPS_PER_SM warps an SM (`norm_programs`):
# 16, so 128 registers a thread fill the register file. Uncapped, some take more and their
# programs run in a second wave. The fused QKV's holds the query's path and the key and value's
# in one kernel: 148-150 registers uncapped (Triton 3.6, sm_90), 3 programs of 4 warps an SM
# where 4 were planned; capped (Triton's `maxnreg`), 128 without spilling. Kernels alone, in
# copies of qkv, H100 / H200 (artifacts/qknorm/qkv_registers_ab_*, with norm_programs rounding
# down): Qwen3-8B 1.87 -> 1.70 / 2.09 -> 1.60, Gemma 3 1.72 -> 1.58 / 2.04 -> 1.59. TP 8's q
# and k in one launch take 146 uncapped, 128 capped, also without spilling: kernels alone, in
# copies of q and k, H200, uncapped against capped (artifacts/qknorm/rsqrt_ab_h200.log): TP 8's
# backward 2.04 / 1.95 against 1.63 / 1.53 at 16K / 64K tokens, the fused QKV's 2.46 against
# 1.73 (Qwen3-8B).
# Unpipelined backwards (TE's table, 2 warps, about 118 registers) are not capped: capped, they
# ran 2-3% slower on the H200. A cap below the plan costs more than the occupancy it buys: OLMo
# 2's backward (two programs of 8 warps an SM, 70.8% of DRAM bandwidth on the H200 by ncu,
# artifacts/qknorm/olmo2_ncu_h200.txt) capped at 80 for a third program ran 1.79 -> 2.48 copies
# of q and k there (kernels alone, artifacts/qknorm/rules_h200.log).
NORM_BACKWARD_MAX_REGISTERS = 128
# A norm over the whole token (OLMo 2) saves each row's rstd in the forward for the backward
# (`saves_rstd`, RMSNorm.rstd): there the backward's sum of squares crosses the tile's 8 warps
# (shared memory and barriers in every trip of its token loop), and reading the saved value
# takes its loop from 507 to 448 SASS instructions a thread (Triton 3.6, sm_90). Kernels alone,
# bf16, 16K tokens, forward + backward in copies of q and k, recomputed -> saved
# (artifacts/qknorm/saved_rstd_ab_h200_2.log, _h100_2.log): OLMo 2 on the H200 2.85 -> 2.69
# with exact angles, 3.85 -> 3.58 with TE's table; on the H100 2.76 -> 2.77 and 3.19 -> 3.07.
# A norm over each head sums within a warp, and its saved rows cost more than they save:
# Qwen3-8B's q and k in one call 2.54 -> 2.95 (exact) and 2.94 -> 4.21 (TE's table) on the
# H200, 2.65 -> 2.76 and 2.65 -> 3.54 on the H100; TP 8's pair-tile forward (the rows' stores)
# 1.04 -> 1.31 on the H200. So it works rstd out again.
SAVED_RSTD_OVER = ("token",)
# q and k with norms in two launches (where `_joins` keeps them apart: equal tiles, as OLMo 2's
# norm over the token takes both ways): the key's launch starts while the query's last programs
# run (programmatic dependent launch, compute capability 9.0 and later; `_overlapped`), instead
# of after the query's last wave drains. Kernels alone, bf16, 16K tokens, in copies of q and k,
# H100 / H200 (rope_qknorm_rules.py's qk_ lines, artifacts/qknorm/qk_overlap_ab_*): OLMo 2
# forward with exact angles 1.030 -> 1.012 / 1.057 -> 1.034, TE's table 1.057 -> 1.043 / 1.150 ->
# 1.130, backward 1.716 -> 1.674 / 1.787 -> 1.771 and 2.133 -> 2.079 / 2.691 -> 2.626; the
# Qwen3, Gemma 3 and TP 8 points within 0.01 either way; the same bits.
QK_NORM_OVERLAP = True
# The interpreter runs each program in Python: fewer, larger programs run much faster there.
# It has no software pipeliner (and those of Triton 3.5.1 and 3.6 fail on a `range` over
# tensor bounds), so its rule pipelines nothing. Warps mean nothing there: its norm backward
# gives each thread INTERPRETER_TILE_BYTES elements, more than a tile holds, so every tile is
# one warp and INTERPRETER_NORM_PROGRAMS warps per "SM" are as many programs. Every thd token
# counts as wide (SEARCH_WIDE_TOKEN 1, TABLE_SEARCH_TOKEN_16BIT 0): its tiles are of one size,
# and tiles with angles from positions then take the guessed window, as a GPU's of wide
# tokens do.
INTERPRETER_TILE_BYTES = 1 << 18
INTERPRETER_MIN_PROGRAMS = 0
INTERPRETER_NORM_ROWS = 1024
INTERPRETER_NORM_PROGRAMS = 2


class LaunchRule(NamedTuple):
    """The launch rule's constants (above), as `launch_config` takes them."""
    tile_bytes: int
    one_head_tile_bytes: int
    num_warps: int
    min_programs_per_sm: int    # the interpreter counts as one SM
    search_tile_bytes: int
    search_warps: int
    search_wide_token: int      # 0: never
    table_search_token_16bit: int   # 0: never
    search_guess: bool
    search_guess_one_head_token: int    # 0: never
    qkv_tile_bytes: int
    table_warps: int
    table_warps_min_heads: int
    norm_warps: int
    norm_one_head_warps: int
    norm_positions_tile_bytes: int
    norm_positions_warps: int
    norm_positions_max_heads: int
    norm_backward_rows: int
    norm_table_backward_rows: int
    norm_backward_thread_elements: int
    norm_backward_warps_per_sm: int
    norm_pipeline_stages: int
    qk_norm_positions_pass: bool
    norm_backward_max_registers: int    # 0: no cap
    norm_pair_key_heads: int    # 0: no pair tiles with norms
    norm_pair_few_heads: int
    norm_pair_exact_max_heads: int
    qk_norm_overlap: bool
    search_one_sequence: bool
    search_window_first: bool
    search_window_first_float32_token: int  # 0: never


GPU_RULE = LaunchRule(TILE_BYTES, ONE_HEAD_TILE_BYTES, NUM_WARPS, MIN_PROGRAMS_PER_SM,
                      SEARCH_TILE_BYTES, SEARCH_WARPS, SEARCH_WIDE_TOKEN, TABLE_SEARCH_TOKEN_16BIT,
                      SEARCH_GUESS, SEARCH_GUESS_ONE_HEAD_TOKEN, QKV_TILE_BYTES,
                      TABLE_WARPS, TABLE_WARPS_MIN_HEADS, NORM_WARPS, NORM_ONE_HEAD_WARPS,
                      NORM_POSITIONS_TILE_BYTES, NORM_POSITIONS_WARPS, NORM_POSITIONS_MAX_HEADS,
                      NORM_BACKWARD_ROWS, NORM_TABLE_BACKWARD_ROWS,
                      NORM_BACKWARD_THREAD_ELEMENTS, NORM_BACKWARD_WARPS_PER_SM,
                      NORM_PIPELINE_STAGES, QK_NORM_POSITIONS_PASS,
                      NORM_BACKWARD_MAX_REGISTERS,
                      NORM_PAIR_KEY_HEADS, NORM_PAIR_FEW_HEADS, NORM_PAIR_EXACT_MAX_HEADS,
                      QK_NORM_OVERLAP, SEARCH_ONE_SEQUENCE, SEARCH_WINDOW_FIRST,
                      SEARCH_WINDOW_FIRST_FLOAT32_TOKEN)
INTERPRETER_RULE = LaunchRule(INTERPRETER_TILE_BYTES, INTERPRETER_TILE_BYTES, NUM_WARPS,
                              INTERPRETER_MIN_PROGRAMS,
                              INTERPRETER_TILE_BYTES, NUM_WARPS, 1, 0, SEARCH_GUESS,
                              SEARCH_GUESS_ONE_HEAD_TOKEN, INTERPRETER_TILE_BYTES,
                              TABLE_WARPS, TABLE_WARPS_MIN_HEADS, NUM_WARPS, NUM_WARPS,
                              INTERPRETER_TILE_BYTES, NUM_WARPS, 0,
                              INTERPRETER_NORM_ROWS, INTERPRETER_NORM_ROWS,
                              INTERPRETER_TILE_BYTES, INTERPRETER_NORM_PROGRAMS, 0,
                              QK_NORM_POSITIONS_PASS, 0,
                              NORM_PAIR_KEY_HEADS, NORM_PAIR_FEW_HEADS,
                              NORM_PAIR_EXACT_MAX_HEADS, QK_NORM_OVERLAP, SEARCH_ONE_SEQUENCE,
                              SEARCH_WINDOW_FIRST, SEARCH_WINDOW_FIRST_FLOAT32_TOKEN)
_RULE_OVERRIDE = [None]


def _interpreting() -> bool:
    return _INTERPRETING


def launch_rule() -> LaunchRule:
    """The rule calls are planned with: GPU_RULE, INTERPRETER_RULE under the interpreter, or
    the one `use_launch_rule` set."""
    if _RULE_OVERRIDE[0] is not None:
        return _RULE_OVERRIDE[0]
    return INTERPRETER_RULE if _interpreting() else GPU_RULE


@contextlib.contextmanager
def use_launch_rule(rule: LaunchRule):
    """Plan the calls made inside with `rule` (the tests' way to try other tiles). Plans are
    keyed by the rule, so none made inside serves a call outside."""
    previous, _RULE_OVERRIDE[0] = _RULE_OVERRIDE[0], rule
    try:
        yield
    finally:
        _RULE_OVERRIDE[0] = previous


def _launch_rule():
    """What launch_config's result depends on besides the call; part of every plan's key."""
    return launch_rule(), _interpreting()


class RopeShape(NamedTuple):
    """Sizes of one RoPE call, as `check_rope_args` read them."""
    seq_len: int       # s (sbhd/bshd) or total tokens t (thd)
    batch: int         # b (sbhd/bshd) or number of sequences (thd)
    nheads: int
    head_dim: int      # d
    rotary_dim: int    # d2
    num_tokens: int    # rows of [h, d] to process


class AngleSource(NamedTuple):
    """Where a call's angles come from, read off `freqs` by `angle_source`."""
    angles: torch.Tensor      # the table [s2, 1, 1, d2] (float32), or inv_freq [d2/2] (float32)
    from_positions: bool      # angles = position * inv_freq, computed in the kernel
    pair_axis: object         # int32 [d2/2]: position axis of each pair (M-RoPE), or None
    n_axes: int               # position axes (1, or the M-RoPE sections)
    scale: float              # multiplies cos and sin (YaRN's attention factor)
    interleaved: object       # the module's pair layout; None for a table


def is_real_number(x):
    """A real number that is not a bool (an int, a float, a numpy scalar, a Fraction): what an
    argument documented as a number takes (the one rule for every such argument; where the
    value goes on into arithmetic, it is converted to a Python int or float first)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_finite_number(x):
    """A real number (`is_real_number`) that is finite."""
    return is_real_number(x) and math.isfinite(x)


def _finite_or_traced(x):
    """A finite number, or a float that torch.compile traces: it may be a symbol (a module's
    attention_scaling that differs between calls, or any float under dynamic=True) whose
    value exists only when the compiled graph runs, where the custom op's own check
    (`_check_source`) sees it as a float."""
    if torch.compiler.is_compiling():
        return isinstance(x, torch.SymFloat) or is_real_number(x)
    return is_finite_number(x)


def _check_source(source, name):
    """An AngleSource built elsewhere (the custom ops' arguments) holds what the kernel reads."""
    angles, pair_axis = source.angles, source.pair_axis
    if not isinstance(angles, torch.Tensor) or angles.dtype != torch.float32:
        raise TypeError(f"{name} angles must be a float32 tensor")
    if not isinstance(source.from_positions, bool):
        raise TypeError(f"{name}: from_positions must be a bool, got "
                        f"{type(source.from_positions).__name__}")
    if isinstance(source.n_axes, bool) or not isinstance(source.n_axes, int) or source.n_axes < 1:
        raise ValueError(f"{name}: n_axes must be an int >= 1, got {source.n_axes!r}")
    if not _finite_or_traced(source.scale):
        raise ValueError(f"{name}: scale must be a finite number, got {source.scale!r}")
    if source.interleaved is not None and not isinstance(source.interleaved, bool):
        raise TypeError(f"{name}: interleaved must be a bool or None, got "
                        f"{type(source.interleaved).__name__}")
    if source.from_positions:
        if angles.dim() != 1 or angles.numel() == 0:
            raise ValueError(f"{name}: inv_freq must be non-empty and 1-D, got "
                             f"{tuple(angles.shape)}")
        if (source.n_axes > 1) != (pair_axis is not None) or (
                pair_axis is not None and (pair_axis.dtype != torch.int32
                                           or pair_axis.shape != angles.shape)):
            raise TypeError(f"{name}: pair_axis must be int32 of inv_freq's shape exactly when "
                            f"n_axes > 1")
        # The kernel reads both one entry per pair, in order.
        for field, x in (("inv_freq", angles), ("pair_axis", pair_axis)):
            if x is not None and x.numel() > 1 and x.stride(0) != 1:
                raise ValueError(f"{name}: {field} must have unit stride, got stride "
                                 f"{x.stride(0)}")
    elif pair_axis is not None or source.n_axes != 1:
        raise ValueError(f"{name}: a table has one position axis and no pair_axis")


def angle_source(freqs, name="freqs"):
    """The AngleSource of `freqs`: a table tensor (TE's interface), or a module with
    `inv_freq` (RotaryPositionEmbedding, or anything with its attributes)."""
    if isinstance(freqs, AngleSource):
        _check_source(freqs, name)
        return freqs
    if isinstance(freqs, torch.Tensor):
        # A sparse or nested table is named by check_rope_args (once per plan, not per call).
        if not freqs.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (used as float32), got "
                            f"{freqs.dtype}")
        # Used as float32 (cast, as TE does); a negative-bit view is resolved, not read raw.
        # The cast only where it casts: .float() of a float32 table costs CPU time on every call.
        if freqs.dtype != torch.float32:
            freqs = freqs.float()
        return AngleSource(freqs.resolve_neg(), False, None, 1, 1.0, None)
    fields = _module_fields(freqs)
    if fields is not None:
        kept = _MODULE_SOURCES.get(freqs)
        if kept is not None and _same_fields(kept[0], fields):
            return kept[1]
    inv_freq = getattr(freqs, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (angle table) or a "
                        f"RotaryPositionEmbedding, got {type(freqs).__name__}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or inv_freq.numel() == 0:
        raise TypeError(f"{name}.inv_freq must be a non-empty 1-D float32 tensor, got "
                        f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    factor = getattr(freqs, "seq_len_interpolation_factor", None)
    if factor is not None and factor != 1:
        # Its table divides the positions by the factor (and by more past the trained length);
        # angles from positions would ignore that.
        raise ValueError(f"{name} interpolates positions (seq_len_interpolation_factor="
                         f"{factor!r}), which only its table holds: pass its table, "
                         f"{name}(max_seq_len), or build it with rope_scaling="
                         f"{{'rope_type': 'linear', 'factor': {factor!r}}} for exact angles")
    n_axes = int(getattr(freqs, "n_axes", 1))
    pair_axis = getattr(freqs, "pair_axis", None) if n_axes > 1 else None
    if n_axes > 1 and (not isinstance(pair_axis, torch.Tensor) or pair_axis.dtype != torch.int32
                       or pair_axis.shape != inv_freq.shape):
        raise TypeError(f"{name}.pair_axis must be int32 of inv_freq's shape "
                        f"{tuple(inv_freq.shape)} when {name}.n_axes > 1, got "
                        f"{getattr(pair_axis, 'dtype', pair_axis)} "
                        f"{tuple(getattr(pair_axis, 'shape', ()))}")
    scale = getattr(freqs, "attention_scaling", 1.0)
    if not _finite_or_traced(scale):
        raise ValueError(f"{name}.attention_scaling must be a finite number, got {scale!r}")
    interleaved = getattr(freqs, "interleaved", False)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{name}.interleaved must be a bool, got {type(interleaved).__name__}")
    source = AngleSource(inv_freq.resolve_neg().contiguous(), True,
                         None if pair_axis is None else pair_axis.resolve_neg().contiguous(),
                         n_axes, 1.0 * scale if torch.compiler.is_compiling() else float(scale),
                         interleaved)
    # Kept where it holds the module's own tensors (no copy), so that their values, changed in
    # place, reach the kernel as they would through a source made afresh.
    if fields is not None and source.angles is fields[0] and source.pair_axis is fields[1]:
        _MODULE_SOURCES[freqs] = (fields, source)
    return source


# A module's AngleSource, made afresh, reads its buffers through nn.Module.__getattr__ and
# checks them: about 4 µs a call on this repository's CPU machine, against 1 µs for a table.
# So the source is kept per module (weakly), with the objects and values it was made from
# (`_module_fields`), and serves while they are the same.
_MODULE_SOURCES = weakref.WeakKeyDictionary()
_PLAIN_VALUES = (int, float, bool)


def _module_fields(freqs):
    """(inv_freq, pair_axis, n_axes, attention_scaling, interleaved,
    seq_len_interpolation_factor) of a module as they are now, or None where its source is not
    kept: not an nn.Module, inv_freq (or pair_axis, with several axes) not a registered buffer,
    a field of another type than int, float or bool (the factor: or None), or under
    torch.compile (which traces the source made afresh). A source is kept only once
    `angle_source` has made it, so a module it refuses (an interpolating one) is never kept.

    INTERNAL(torch nn.Module._buffers, the dict of registered buffers; torch 2.11, 2.13): read
    for the buffers, a dict lookup where Module.__getattr__ costs about 0.7 µs each. A module
    without it warns once and has its source made on every call."""
    if not isinstance(freqs, torch.nn.Module) or torch.compiler.is_compiling():
        return None
    attributes = vars(freqs)
    buffers = attributes.get("_buffers")
    if not isinstance(buffers, dict):
        _warn_once("module buffers", "keeps no nn.Module._buffers dict: a module's angles are "
                   "read afresh on every call", library=f"torch {torch.__version__}")
        return None
    n_axes = getattr(freqs, "n_axes", 1)
    scale = getattr(freqs, "attention_scaling", 1.0)
    interleaved = getattr(freqs, "interleaved", False)
    factor = attributes.get("seq_len_interpolation_factor")
    if ("inv_freq" not in buffers or (n_axes != 1 and "pair_axis" not in buffers)
            or type(n_axes) not in _PLAIN_VALUES or type(scale) not in _PLAIN_VALUES
            or type(interleaved) not in _PLAIN_VALUES
            or (factor is not None and type(factor) not in _PLAIN_VALUES)):
        return None
    return (buffers["inv_freq"], buffers["pair_axis"] if n_axes != 1 else None, n_axes, scale,
            interleaved, factor)


def _same_fields(kept, now):
    """Whether a module's fields (`_module_fields`) are those its kept source was made from:
    the same tensors (by identity), the same values otherwise."""
    return kept[0] is now[0] and kept[1] is now[1] and kept[2:] == now[2:]


def check_layout(source, interleaved, freqs_name="freqs"):
    """`interleaved` is a bool, and the layout a module was built for."""
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if source.interleaved is not None and source.interleaved != interleaved:
        raise ValueError(f"interleaved={interleaved} but {freqs_name} was built with "
                         f"interleaved={source.interleaved}")


class RMSNorm(NamedTuple):
    """An RMSNorm applied before the rotation: x / sqrt(mean(x^2) + eps) * (offset + weight),
    the mean over each head's channels (`over="head"`, weight [d]) or over all heads of a token
    (`over="token"`, weight [h * d]).

    `rstd`, optional, holds each row's 1 / sqrt(mean(x^2) + eps) (`norm_rstd` makes it): the
    forward writes it and the backward, given the same buffer, reads it instead of working it
    out again: a reduction over each row and its multiply-adds fewer in every tile."""
    weight: torch.Tensor
    eps: float
    offset: float
    over: str
    rstd: Optional[torch.Tensor] = None


NORM_OVER = {"head": NORM_OVER_HEAD.value, "token": NORM_OVER_TOKEN.value}


def saves_rstd(norm):
    """Whether the entry points' forwards with `norm` (an RMSNorm) save each row's rstd for the
    backward (SAVED_RSTD_OVER says where that pays)."""
    return norm.over in SAVED_RSTD_OVER


def norm_rstd(t, norm):
    """The buffer of `RMSNorm.rstd` for the rows of t ([..., h, d], t's format): t's shape
    without its channels (a norm over each head) or without its heads and channels (over the
    token), in the compute dtype, contiguous, so that row i of token j sits at j * h + i (or
    j): the kernels' token order in every format."""
    shape, dtype = _rstd_layout(t, norm.over)
    return torch.empty(shape, dtype=dtype, device=t.device)


def _rstd_layout(t, over):
    return (t.shape[:-1] if over == "head" else t.shape[:-2],
            torch.float64 if t.dtype == torch.float64 else torch.float32)


def check_norm(norm, t, nheads, head_dim, prefix="norm_"):
    """`norm` (an RMSNorm) fits a tensor t of nheads heads of head_dim channels; names its
    fields with `prefix` (the entry points' argument names)."""
    weight = norm.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{prefix}weight must be a torch.Tensor, got {type(weight).__name__}")
    check_dense(f"{prefix}weight", weight)
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{prefix}weight must be float32, float16, bfloat16 or float64, got "
                        f"{weight.dtype}")
    if weight.device != t.device:
        raise TypeError(f"{prefix}weight is on {weight.device} but the input is on {t.device}")
    check_norm_options(norm.eps, norm.offset, norm.over)
    size = head_dim if norm.over == "head" else nheads * head_dim
    if weight.dim() != 1 or weight.numel() != size:
        what = "d" if norm.over == "head" else "h * d"
        raise ValueError(f"{prefix}weight must have shape [{what}] = [{size}] for "
                         f"norm_over={norm.over!r}, got {tuple(weight.shape)}")
    rstd = norm.rstd
    if rstd is not None:
        shape, dtype = _rstd_layout(t, norm.over)
        if not isinstance(rstd, torch.Tensor):
            raise TypeError(f"{prefix}rstd must be a torch.Tensor or None, got "
                            f"{type(rstd).__name__}")
        if (rstd.shape != shape or rstd.dtype != dtype or rstd.device != t.device
                or not rstd.is_contiguous()):
            raise ValueError(f"{prefix}rstd must be contiguous, of shape {tuple(shape)}, {dtype}, "
                             f"on {t.device} (norm_rstd makes it), got {tuple(rstd.shape)} "
                             f"{rstd.dtype} on {rstd.device}")


def check_norm_options(eps, offset, over):
    """norm_eps and norm_offset: finite real numbers, eps >= 0; norm_over: 'head' or 'token'.
    Checked with or without a weight: a call without one ignores them, but a wrong value is
    still a wrong argument."""
    if not isinstance(over, str) or over not in NORM_OVER:
        raise ValueError(f"norm_over must be 'head' or 'token', got {over!r}")
    for name, value in (("norm_eps", eps), ("norm_offset", offset)):
        if not is_real_number(value):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if not abs(value) < float("inf"):
            raise ValueError(f"{name} must be finite, got {value}")
    if eps < 0:
        raise ValueError(f"norm_eps must be >= 0, got {eps}")


def _check_norm_input(norm_input, t, name="norm_input"):
    """The backward of a norm reads the forward's input: a tensor like t."""
    if not isinstance(norm_input, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (the forward's input), got "
                        f"{type(norm_input).__name__}")
    if norm_input.shape != t.shape or norm_input.dtype != t.dtype or norm_input.device != t.device:
        raise ValueError(f"{name} must have the gradient's shape {tuple(t.shape)}, dtype {t.dtype} "
                         f"and device {t.device}, got {tuple(norm_input.shape)} "
                         f"{norm_input.dtype} {norm_input.device}")


def _norm_key(norm):
    """A norm's part of a plan key: its weight's and rstd's metadata and the other fields."""
    if not isinstance(norm, RMSNorm):
        return (norm,)
    return (*_tensor_key(norm.weight), norm.eps, type(norm.eps), norm.offset, type(norm.offset),
            norm.over, *_tensor_key(norm.rstd))


def _tensor_key(x):
    """A key part of a norm's tensor: its metadata, or its type (None, or what the checks
    will name)."""
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.device
    return (type(x),)


def _weight_as_read(norm):
    """The weight as the kernel reads it: unit stride, no negative bit."""
    weight = norm.weight
    if weight.is_neg() or weight.stride(0) != 1:
        weight = weight.resolve_neg().contiguous()
    return weight


def norm_programs(token_blocks, head_programs, device, rule, num_warps, gpu_share=1.0):
    """Programs along the tokens for the backward of a norm, of num_warps warps each: about
    rule.norm_backward_warps_per_sm warps per SM in all (`gpu_share` of them, where a launch
    shares the GPU with another tensor's programs), each program looping over its share of
    the token blocks."""
    per_sm = max(1, rule.norm_backward_warps_per_sm // num_warps)
    # Rounded down: programs past what is resident at once would run after the others, alone.
    resident = int(per_sm * _sm_count(device) * gpu_share)
    return max(1, min(token_blocks, resident // head_programs))


def _norm_group(norm, norm_input, partial):
    """The fields of the kernel's Norm group; norm_input and partial None in the forward."""
    return _weight_as_read(norm), norm.eps, norm.offset, norm_input, partial, norm.rstd


def _partial_sums(plan, x):
    """The buffer of per-program partial sums of dL/dweight (a _WeightGradientPlan's), in x's
    compute dtype."""
    return torch.empty(plan.partial_shape, device=x.device,
                       dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


class _WeightGradientPlan(NamedTuple):
    """dL/dweight of a norm's backward: the shape of the partial sums the backward's programs
    write, one row each, and the launch of the second pass that adds them up; `rows` (the
    first weight's rows, the second's: 0 for one weight)."""
    partial_shape: tuple
    launch: object
    rows: tuple


# The second pass reads the partial sums from L2 (the backward has just written them), so it
# is bound by latency: enough programs to spread it (WEIGHT_GRADIENT_PROGRAMS, at d 128 a
# program per 4 columns) and a whole column of 1-2K partial sums loaded in one step.
WEIGHT_GRADIENT_PROGRAMS = 32
WEIGHT_GRADIENT_TILE = 8192       # elements per step
WEIGHT_GRADIENT_WARPS = 8


def _weight_gradient_plan(rows, width, second_rows=0):
    """The second pass of `rows` partial sums of one weight, or, with second_rows, of two
    weights of the same width in one launch (the second's rows after the first's)."""
    block_w = min(64, max(4, triton.next_power_of_2(triton.cdiv(width, WEIGHT_GRADIENT_PROGRAMS))))
    block_rows = min(triton.next_power_of_2(max(rows, second_rows)), WEIGHT_GRADIENT_TILE // block_w)
    return _WeightGradientPlan(
        (rows + second_rows, width),
        _Launch(weight_gradient_kernel, (), (triton.cdiv(width, block_w), 2 if second_rows else 1),
                WeightGradientTile(block_rows, block_w), WEIGHT_GRADIENT_WARPS),
        (rows, second_rows))


def _weight_gradient(plan, partial, norm, second_norm=None):
    """dL/dweight from the programs' partial sums, in the weight's dtype (zeros where the
    backward had nothing to launch); with second_norm (a plan of two weights), the pair."""
    if partial is None:
        return torch.zeros_like(norm.weight)
    # float64 sums (float64 inputs) stay float64 in the kernel and torch rounds them to the
    # weight's dtype: the interpreters of Triton 3.7.1 and 3.9 convert float64 to bfloat16 wrongly.
    wide = partial.dtype == torch.float64
    dws = [torch.empty(norm.weight.shape, device=partial.device,
                       dtype=partial.dtype if wide else norm.weight.dtype)
           for _ in range(1 if second_norm is None else 2)]
    rows, second_rows = plan.rows
    plan.launch(partial, dws[0], dws[-1], rows, partial.shape[1], second_rows)
    if wide:
        dws = [dw.to(norm.weight.dtype) for dw in dws]
    return dws[0] if second_norm is None else tuple(dws)


def _weight_gradient_plans(q_rows, k_rows, q_norm, k_norm):
    """The second passes of q's and k's norms: one launch for both where their weights have
    the same width and dtype, else one each. A launch's fixed cost is about a tenth of a copy
    of q and k at one rank of TP 8 (16K tokens, 14-18 µs a copy on the H100 and H200)."""
    q_weight, k_weight = q_norm.weight, k_norm.weight
    if q_weight.shape == k_weight.shape and q_weight.dtype == k_weight.dtype:
        return (_weight_gradient_plan(q_rows, q_weight.numel(), k_rows),)
    return (_weight_gradient_plan(q_rows, q_weight.numel()),
            _weight_gradient_plan(k_rows, k_weight.numel()))


def _pair_partial_sums(plans, x):
    """(q's partial sums, k's, the buffer of both or None) for `_weight_gradient_plans`."""
    if len(plans) == 1:
        partial = _partial_sums(plans[0], x)
        return (*partial.split(plans[0].rows), partial)
    return _partial_sums(plans[0], x), _partial_sums(plans[1], x), None


def _pair_weight_gradients(plans, partials, q_norm, k_norm):
    """(dL/dq_weight, dL/dk_weight) from `_pair_partial_sums`' buffers."""
    q_partial, k_partial, partial = partials
    if partial is not None:
        return _weight_gradient(plans[0], partial, q_norm, k_norm)
    return (_weight_gradient(plans[0], q_partial, q_norm),
            _weight_gradient(plans[1], k_partial, k_norm))


def _is_dense(x):
    """Whether x is a tensor the kernels can read: strided, not nested (sparse and nested
    tensors have no strides)."""
    return isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_nested


def check_dense(name, x):
    """A tensor argument is strided and not nested."""
    if not _is_dense(x):
        raise TypeError(f"{name} must be a strided (dense) tensor, got "
                        f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}")


def _check_index_type(name, value, device, t_name):
    """An index argument: a dense torch.Tensor of an INDEX_DTYPES dtype on t's device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
    check_dense(name, value)
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    if value.device != device:
        raise TypeError(f"{name} is on {value.device} but {t_name} is on {device}")


def _check_index_tensor(name, value, device, length=None, t_name="t"):
    _check_index_type(name, value, device, t_name)
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if length is not None and value.numel() != length:
        raise ValueError(f"{name} must have {length} entries (one per sequence), "
                         f"got {value.numel()}")


def check_rope_args(t, freqs, tensor_format="sbhd", start_positions=None, cu_seqlens=None,
                    cp_size=1, cp_rank=0, interleaved=False, positions=None, need_kernel=True,
                    t_name="t", freqs_name="freqs", inverse=False) -> RopeShape:
    """Validate one call's arguments (TE's semantics, plus `positions` and angles from a
    RotaryPositionEmbedding) and return its sizes.

    Raises TypeError for wrong types, dtypes or devices and ValueError for wrong shapes,
    formats or values, each naming the argument (`t_name`/`freqs_name` for entry points that
    call them otherwise). Reads only metadata: no device sync, so it is safe under CUDA graph
    capture and on fake tensors. Checks that need the *values* of positions / cu_seqlens are
    made by the kernel itself (NaN or pass-through, see `apply_rotary_pos_emb`).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{t_name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(t_name, t)
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{t_name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if not isinstance(tensor_format, str) or tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    want_rank = 3 if tensor_format == "thd" else 4
    if t.dim() != want_rank:
        raise ValueError(f"{t_name} must be {want_rank}-D for tensor_format={tensor_format!r} "
                         f"([{', '.join(tensor_format)}]), got shape {tuple(t.shape)}")
    source = angle_source(freqs, freqs_name)
    check_dense(freqs_name, source.angles)
    if source.angles.device != t.device:
        raise TypeError(f"{freqs_name} is on {source.angles.device} but {t_name} is on {t.device}")
    if source.pair_axis is not None and source.pair_axis.device != t.device:
        raise TypeError(f"{freqs_name}.pair_axis is on {source.pair_axis.device} but {t_name} "
                        f"is on {t.device}")
    check_layout(source, interleaved, freqs_name)
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= cp_size <= _INT32_MAX:
        raise ValueError(f"cp_size must be in [1, {_INT32_MAX}], got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if start_positions is not None and cp_size > 1:
        raise ValueError("start_positions is not supported with cp_size > 1 (as in TE)")

    head_dim = t.shape[-1]
    if source.from_positions:
        rotary_dim = 2 * source.angles.numel()
    else:
        if source.angles.dim() != 4 or source.angles.shape[1] != 1 or source.angles.shape[2] != 1:
            raise ValueError(f"{freqs_name} must have shape [s2, 1, 1, d2], got "
                             f"{tuple(source.angles.shape)}")
        rotary_dim = source.angles.shape[-1]
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"{freqs_name}' last dimension (rotary dim d2) must be even and > 0, "
                             f"got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"{freqs_name}' rotary dim d2={rotary_dim} exceeds {t_name}'s head dim "
                         f"d={head_dim}")

    if tensor_format == "thd":
        num_tokens, nheads = t.shape[0], t.shape[1]
        if positions is None:
            if cu_seqlens is None:
                raise ValueError("cu_seqlens is required when tensor_format='thd' (or positions)")
            _check_index_tensor("cu_seqlens", cu_seqlens, t.device, t_name=t_name)
            if cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens must have at least 2 entries ([b + 1]), "
                                 f"got {cu_seqlens.numel()}")
            batch = cu_seqlens.numel() - 1
            if batch > MAX_SEQUENCES:
                raise ValueError(f"cu_seqlens holds {batch} sequences; at most {MAX_SEQUENCES} "
                                 f"(the search for a token's sequence indexes it in int32)")
        elif cu_seqlens is not None:
            raise ValueError("give cu_seqlens or positions for tensor_format='thd', not both: "
                             "positions already place every token")
        else:
            batch = 1
        seq_len = num_tokens
    else:
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens is only valid with tensor_format='thd', "
                             f"got tensor_format={tensor_format!r}")
        seq_len, batch = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        nheads = t.shape[2]
        num_tokens = seq_len * batch
        if not source.from_positions and positions is None and seq_len * cp_size > source.angles.shape[0]:
            raise ValueError(f"{freqs_name} has {source.angles.shape[0]} positions but the "
                             f"sequence needs s * cp_size = {seq_len} * {cp_size}")
        if cp_size > 1 and seq_len % 2:
            raise ValueError(f"with cp_size > 1 the local sequence length must be even "
                             f"(two chunks per rank), got {seq_len}")
    if start_positions is not None:
        _check_index_tensor("start_positions", start_positions, t.device, length=batch,
                            t_name=t_name)
    if positions is not None:
        _check_positions(positions, source, tensor_format, seq_len, batch, t.device, t_name,
                         freqs_name, start_positions is not None, cp_size)
    # Triton's interpreter runs the kernel on CPU tensors (and on CUDA tensors through host
    # copies); a tensor without data (meta) or of another device reaches no kernel.
    if need_kernel and t.device.type not in (("cuda", "cpu") if _interpreting() else ("cuda",)):
        raise TypeError(f"{t_name} is on {t.device}: the Triton kernel needs a CUDA tensor "
                        f"(or, under TRITON_INTERPRET=1, a CPU tensor)")
    if num_tokens > _INT32_MAX:
        raise ValueError(f"{t_name} has {num_tokens} tokens; at most {_INT32_MAX} are supported")
    return RopeShape(seq_len, batch, nheads, head_dim, rotary_dim, num_tokens)


def _check_positions(positions, source, tensor_format, seq_len, batch, device, t_name,
                     freqs_name, has_start, cp_size):
    """`positions`: one integer position per token, [s] or [b, s] (sbhd/bshd), [t] (thd);
    with an M-RoPE module a leading axis dimension, [n_axes, ...]."""
    _check_index_type("positions", positions, device, t_name)
    if has_start:
        raise ValueError("positions and start_positions cannot be combined: positions "
                         "already give every token's position")
    if cp_size > 1:
        raise ValueError("positions cannot be combined with cp_size > 1: give each rank's "
                         "own positions instead")
    shapes = [(seq_len,)] if tensor_format == "thd" else [(seq_len,), (batch, seq_len)]
    names = ["[t]"] if tensor_format == "thd" else ["[s]", "[b, s]"]
    if source.n_axes > 1:
        shapes = [(source.n_axes, *s) for s in shapes]
        names = [f"[{source.n_axes}, {n[1:]}" for n in names]
    if tuple(positions.shape) not in shapes:
        raise ValueError(f"positions must have shape {' or '.join(names)} "
                         f"({' or '.join(str(s) for s in shapes)}) for "
                         f"tensor_format={tensor_format!r}"
                         + (f" and {freqs_name} with {source.n_axes} position axes"
                            if source.n_axes > 1 else "")
                         + f", got {tuple(positions.shape)}")


def _position_strides(positions, source, tensor_format):
    """(axis, seq, batch) element strides of `positions`; a [s] tensor is shared by the batch."""
    if positions is None:
        return 0, 0, 0
    strides = list(positions.stride())
    axis = strides.pop(0) if source.n_axes > 1 else 0
    if len(strides) == 1:
        return axis, strides[0], 0
    return axis, strides[1], strides[0]


def _overlaps_itself(x: torch.Tensor) -> bool:
    """True if two elements of x share memory (e.g. an expanded tensor): walking the dims
    from the smallest stride up, each stride must step past everything spanned so far."""
    span = 0
    for stride, size in sorted((st, s) for s, st in zip(x.shape, x.stride()) if s > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of a and b in one storage intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(x):
        start = x.storage_offset() * x.element_size()
        extent = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride())) + 1
        return start, start + extent * x.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _token_strides(x: torch.Tensor, tensor_format: str):
    """(seq, batch, head, dim) strides of x in the given format; thd has no batch stride."""
    if tensor_format == "thd":
        return x.stride(0), 0, x.stride(1), x.stride(2)
    return (*_seq_batch_strides(x, tensor_format), x.stride(2), x.stride(3))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _compute_capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _sm_count(device: torch.device) -> int:
    """SMs of the device's GPU; the interpreter counts as one."""
    if _interpreting():
        return 1
    return _num_sms(_device_index(device))


def _launches_early(device: torch.device) -> bool:
    """Whether the device's GPU takes programmatic dependent launch (compute capability 9.0 or
    later; Triton emits its PTX griddepcontrol for those only); the interpreter plans such
    launches too (the kernels leave the PTX out there)."""
    return _interpreting() or _compute_capability(_device_index(device))[0] >= 9


def launch_config(shape: RopeShape, device: torch.device, copy_pass: bool, element_size: int,
                  tile_bytes: int, rule: LaunchRule, whole_tokens: bool = False):
    """Tile sizes, grid and warps for one non-empty call: a pure function of the sizes (no
    autotuning). Large inputs get one tile shape whatever their length; only inputs too small
    to give every SM rule.min_programs_per_sm programs get smaller tiles (a bounded set of
    compiled variants). `tile_bytes`: one of the rule's tiles, in rule.num_warps warps (a
    norm's warps: `_norm_warps`). `whole_tokens`: a tile holds all heads of its tokens (a norm
    over the whole token)."""
    block_half = triton.next_power_of_2(shape.rotary_dim // 2)
    pass_dims = shape.head_dim - shape.rotary_dim if copy_pass else 0
    block_pass = triton.next_power_of_2(pass_dims) if pass_dims else 0
    row_bytes = (shape.rotary_dim + pass_dims) * element_size   # one (token, head) of a tile
    min_programs = rule.min_programs_per_sm * _sm_count(device)
    rows = triton.next_power_of_2(triton.cdiv(tile_bytes, row_bytes))
    block_h = triton.next_power_of_2(shape.nheads)
    if not whole_tokens:
        block_h = min(block_h, rows)
    block_t = min(triton.next_power_of_2(shape.num_tokens), max(1, rows // block_h))

    def programs():
        return triton.cdiv(shape.num_tokens, block_t) * triton.cdiv(shape.nheads, block_h)

    while block_t > 1 and programs() < min_programs:
        block_t //= 2
    while block_h > 1 and programs() < min_programs and not whole_tokens:
        block_h //= 2
    grid = (triton.cdiv(shape.num_tokens, block_t), triton.cdiv(shape.nheads, block_h))
    meta = dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
                num_warps=rule.num_warps)
    return grid, meta


def _norm_warps(rule: LaunchRule, tile: dict, backward: bool, positions_tile: bool) -> int:
    """Warps of a tile (launch_config's) with a norm (NORM_WARPS, NORM_POSITIONS_TILE_BYTES and
    NORM_BACKWARD_ROWS say why): forward, rule.norm_one_head_warps for a tile of one head,
    rule.norm_positions_warps for a tile `_norm_positions_tile` chose (the fused QKV: any
    with angles from positions), else rule.norm_warps;
    backward, as many as give each thread rule.norm_backward_thread_elements of the tile."""
    if not backward:
        if tile["BLOCK_H"] == 1:
            return rule.norm_one_head_warps
        return rule.norm_positions_warps if positions_tile else rule.norm_warps
    elements = tile["BLOCK_T"] * tile["BLOCK_H"] * (2 * tile["BLOCK_HALF"] + tile["BLOCK_PASS"])
    warps = elements // (32 * rule.norm_backward_thread_elements)
    return max(1, min(NORM_BACKWARD_MAX_WARPS, warps))


def _norm_positions_tile(rule: LaunchRule, source, nheads: int) -> bool:
    """Whether a norm's forward takes rule.norm_positions_tile_bytes (NORM_POSITIONS_TILE_BYTES
    says why): angles from positions, 2 to rule.norm_positions_max_heads heads."""
    return source.from_positions and 1 < nheads <= rule.norm_positions_max_heads


def _pipeline_stages(stages: int, source, norm_backward: bool, searches: bool) -> int:
    """The Variant's PIPELINE_STAGES: `stages` (the rule's for the kernel) for the backward of a
    norm with angles from positions, else 0: not for angles from a table (NORM_PIPELINE_STAGES
    says why), nor where thd tiles search cu_seqlens (the search's loops leave Triton nothing to
    pipeline)."""
    if norm_backward and source.from_positions and not searches:
        return stages
    return 0


def _max_registers(rule: LaunchRule, cfg) -> int:
    """Triton's `maxnreg` for a launch of `cfg` (a Variant): the rule's cap for a pipelined norm
    backward (NORM_BACKWARD_MAX_REGISTERS), else 0 (none)."""
    return rule.norm_backward_max_registers if cfg.PIPELINE_STAGES else 0


def _norm_backward_tile_bytes(rule: LaunchRule, source, head_dim: int, element_size: int) -> int:
    """Bytes of a norm backward's tile: rule.norm_backward_rows rows of the head
    (rule.norm_table_backward_rows with angles from a table)."""
    rows = rule.norm_backward_rows if source.from_positions else rule.norm_table_backward_rows
    return rows * head_dim * element_size


_MAX_GRID_X = 2**31 - 1


def _program_grid(token_blocks: int, head_programs: int, t_name: str = "t"):
    """(grid, FLAT_GRID) for token_blocks x head_programs programs. Several programs per token
    block go on one grid axis, those of a token block next to each other, so that a token's
    heads are rotated at about the same time and memory is walked in order (on axis 1 they
    would come a whole pass over the tokens apart). One program per token block needs no
    division of the program id."""
    if head_programs == 1:
        return (token_blocks, 1), False
    if token_blocks * head_programs > _MAX_GRID_X:
        raise ValueError(f"{t_name} needs {token_blocks * head_programs} programs; a launch takes at "
                         f"most {_MAX_GRID_X}")
    return (token_blocks * head_programs, 1), True


def _search_levels(num_seqs: int) -> int:
    """Steps of one token's thd search, SEARCH_FAN ** levels > num_seqs (indices
    0..num_seqs; the search for a tile's first token takes half as many), and at least 2.

    WORKAROUND(Triton 3.6): with one step, LLVM's SLP vectorizer aborts on some tiles (an
    assertion in BoUpSLP; interleaved float32 tiles of 8 tokens x 8 heads)."""
    levels = 2
    while SEARCH_FAN.value ** levels <= num_seqs:
        levels += 1
    return levels


_WARNED = set()


def _warn_once(kind, message, library=None):
    """Warn about `kind` (a short tag) once per process; `message` follows the library's name
    and version (Triton's unless `library` names another)."""
    if kind not in _WARNED:
        _WARNED.add(kind)
        library = library or f"Triton {triton.__version__}"
        warnings.warn(f"triton_rotary: {library} {message}", RuntimeWarning, stacklevel=4)


# The direct launch (`_compiled_runner`) uses Triton internals: CompiledKernel.run with the
# kernel's packed metadata, and the launch hooks of triton.knobs.runtime. Measured and tested on
# Triton 3.6 (H100, H200); where a part is missing it warns once and falls back to Triton's
# runner or JIT. ROPE_DIRECT_LAUNCH=0 (read at import) turns it off: every launch then goes
# through Triton's JIT, the same kernels at more CPU time per call.
DIRECT_LAUNCH = os.environ.get("ROPE_DIRECT_LAUNCH", "1") != "0"


def _compiled_runner(kernel, grid):
    """A launcher for a compiled kernel and a grid, or None, with one warning, on a Triton
    whose compiled kernels have no runner.

    Triton's runner (`CompiledKernel.__getitem__`, what Triton's JIT launches through after
    binding the arguments) looks up the stream and builds launch metadata for launch hooks
    (profilers register them) before calling the kernel's C launcher, `CompiledKernel.run`.
    While no hook is registered, the launcher returned here calls `run` directly, without
    metadata; otherwise it calls the runner. `direct` says whether it can call `run`."""
    try:
        runner = kernel[(grid[0], grid[1], 1)]
    except (TypeError, AttributeError, KeyError) as err:
        _warn_once("no runner", f"gives no runner for a compiled kernel ({err!r}); every launch "
                   f"goes through Triton's JIT, which costs more CPU time per call")
        return None
    try:
        from triton import knobs
        from triton.runtime import driver
        hooks = knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
        get_stream, device = driver.active.get_current_stream, driver.active.get_current_device()
        enter.calls, leave.calls            # noqa: B018 (hook chains: lists of hooks)
    except (ImportError, AttributeError) as err:
        _warn_once("no direct launch", f"lacks a part of the direct launch ({err!r}); launches "
                   f"go through Triton's runner, which costs more CPU time per call")
        runner.direct = False
        return runner
    g0, g1 = grid

    def launch(*args):
        if (hooks.launch_enter_hook is enter and hooks.launch_exit_hook is leave
                and not enter.calls and not leave.calls):
            run(g0, g1, 1, get_stream(device), function, packed, None, None, None, *args)
        else:
            runner(*args)
    launch.direct = True
    return launch


class _Launch:
    """One planned launch of a Triton kernel: its grid and compile-time choices (`cfg`, a
    Variant) fixed; called with the kernel's runtime arguments.

    The arguments come as plain tuples, grouped and ordered as the kernel's parameters;
    `groups` gives the NamedTuple type of each tuple parameter, in order. Triton's JIT gets
    them as those NamedTuples (the kernel reads their fields by name); the compiled kernel's
    C launcher gets the plain tuples, which it parses several times faster: CPython reads a
    tuple subclass's items one by one through `__getitem__` (about 0.1 µs per group, per
    call, on the GPU hosts' CPUs).

    The first call per device and pointer alignment (which Triton specializes on) goes
    through Triton's JIT, which compiles or finds the kernel; later calls hand the arguments
    to the compiled kernel's launcher (`_compiled_runner`), skipping the JIT's per-call binding
    and specialization of every argument, which costs more CPU time than a small RoPE takes
    on the GPU. `runners` holds the launchers (tests check that it fills).
    """

    def __init__(self, kernel, groups, grid, cfg, num_warps, max_registers=0, early=False):
        self.kernel, self.groups, self.grid, self.num_warps = kernel, groups, grid, num_warps
        # Triton's `maxnreg` compile option (registers per thread), where a rule caps them.
        self.options = dict(maxnreg=max_registers) if max_registers else {}
        if early:
            # Programmatic dependent launch: may start before the launch before it ends.
            self.options["launch_pdl"] = True
        # The kernel's compile-time arguments, last: `cfg`, a Variant (or the like), or a
        # plain tuple of them for a kernel that takes several (rotary_qk_kernel: q's and k's).
        self.cfg = cfg
        self.constexprs = cfg if type(cfg) is tuple else (cfg,)
        self.plain_cfg = tuple(None if c is None else tuple(c) for c in self.constexprs)
        self.runners = {}
        self.tensor_paths = None

    def with_cfg(self, cfg, early=False):
        """This launch with other compile-time choices, launched early or not: a new launch
        (its runners are of its own compiled kernel)."""
        return _Launch(self.kernel, self.groups, self.grid, cfg, self.num_warps,
                       self.options.get("maxnreg", 0), early)

    def jit(self, *args):
        """Launch through Triton's JIT; returns the compiled kernel."""
        named = [_as_group(arg, group) for arg, group in zip(args, self.groups)]
        return self.kernel[self.grid](*named, *args[len(self.groups):], *self.constexprs,
                                      num_warps=self.num_warps, **self.options)

    def __call__(self, *args):
        # How to launch follows the real environment (tests vary the launch rule alone,
        # through _interpreting()).
        if _INTERPRETING or not DIRECT_LAUNCH:
            self.jit(*args)
            return
        if self.tensor_paths is None:   # where the tensors sit: fixed by the plan's key
            self.tensor_paths = _tensor_paths(args)
        key = [torch.cuda.current_device()]
        for path in self.tensor_paths:
            x = args
            for i in path:
                x = x[i]
            key.append(not x.data_ptr() % 16)
        key = tuple(key)
        runner = self.runners.get(key)
        if runner is not None:
            runner(*args, *self.plain_cfg)
            return
        runner = _compiled_runner(self.jit(*args), self.grid)
        if runner is not None:
            self.runners[key] = runner


def _as_group(value, group):
    """The plain tuple `value` as the NamedTuple `group`, and so its fields that are groups
    themselves (by the fields' annotations: InOut holds two Views)."""
    if value is None:          # a group left out (no norm)
        return None
    return group(*[_as_group(v, kind) if _is_group(kind) else v
                   for v, kind in zip(value, group.__annotations__.values())])


def _is_group(kind):
    return isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields")


def _tensor_paths(value, path=()):
    """The index paths of the tensors inside a (nested) tuple of kernel arguments."""
    if isinstance(value, torch.Tensor):
        return [path]
    if isinstance(value, tuple):
        return [p for i, v in enumerate(value) for p in _tensor_paths(v, (*path, i))]
    return []


class _RopePlan(NamedTuple):
    """A validated call to rotary_kernel: its launch (None when there is nothing to compute)
    and the arguments that follow from the tensors' metadata."""
    launch: object
    x_strides: tuple = ()
    out_strides: tuple = ()
    table: tuple = ()            # (strides, rows) of the table (`_table_layout`)
    position_strides: tuple = ()
    shape: tuple = ()            # HeadShape's fields
    tokens: Tokens = None
    norm_input_strides: tuple = ()   # backward of a norm: of the forward's input
    weight_gradient: object = None   # backward of a norm: a _WeightGradientPlan
    positions_pass: object = None    # thd backward of a norm: sequence_positions_kernel's launch
    k_strides: tuple = ()        # q and k together (rotary_qk_kernel): k's, and its result's
    # The plan of the same call transposed (`_keep_transposed`): a list of one entry, None or
    # (the gradients' layout, the launch rule, the plan); None: an empty call's plan keeps none.
    transposed: list = None


class _QKNormPlan(NamedTuple):
    """A validated call to rotary_qk_kernel with norms: q's and k's plans as set_rotary_kernel
    makes them (each its tiles, strides, tokens and launch), their joint launch (None: each
    plan's own, `_joins`), the thd backward's positions pre-pass, which serves both, and the
    weights' second pass."""
    launch: object
    q: _RopePlan
    k: _RopePlan
    shape: tuple = ()            # QKShape's fields
    positions_pass: object = None
    weight_gradients: tuple = ()     # backward: `_weight_gradient_plans`


_QK_GROUPS = (InOut, InOut, Angles, Positions, QKShape, Norm, Norm)


class _QKVPlan(NamedTuple):
    """A validated call to rotary_qkv_kernel, as _RopePlan; `split` holds the (q, k, v) widths."""
    launch: object
    split: tuple
    view_strides: tuple = ()     # of q, k and v's source and destination views, in that order
    q_table: tuple = ()          # (strides, rows) of q's table (`_table_layout`)
    k_table: tuple = ()
    position_strides: tuple = ()
    shape: tuple = ()            # QKVShape's fields
    tokens: Tokens = None
    input_strides: tuple = ()    # backward of a norm: of the forward's q and k inside qkv
    weight_gradients: tuple = ()  # backward of a norm: `_weight_gradient_plans`


# Launch plans keyed by everything the checks and the launch rule read (tensors' metadata,
# never their values; other arguments with their types). A repeated call skips both: small
# RoPE calls take less GPU time than the checks take CPU time, so host time decides them.
_PLANS = {}
_MAX_PLANS = 4096


def _metadata_key(tensors, values):
    """A plan's key: each tensor's metadata (never its values), the other arguments with
    their types (so that 2 and 2.0, True and 1 are told apart), and the launch rule; None
    where an argument has no tensor metadata (the checks will say what is wrong with it)."""
    try:
        meta = [None if x is None else (x.shape, x.stride(), x.dtype, x.device) for x in tensors]
    except (AttributeError, TypeError, RuntimeError):    # RuntimeError: a nested tensor's sizes
        return None
    return (*meta, values, tuple(map(type, values)), _launch_rule())


def _typed(seq):
    """A list argument as a hashable key part that keeps each element's type."""
    if isinstance(seq, (list, tuple)):
        return tuple([(e, type(e)) for e in seq])
    return seq


# A call looks its plan up with _cached_plan and, on a miss, stores the one it made (and so
# validated) with _keep_plan: written out at each launcher, not as a function given a closure
# that makes the plan, whose creation on every hit costs CPU time (0.35 µs on this
# repository's CPU machine) though a hit never calls it.

def _cached_plan(key):
    """The plan stored under `key`, or None: none yet, or a key that cannot be stored (None,
    or unhashable: an argument the checks will name)."""
    try:
        return _PLANS.get(key) if key is not None else None
    except TypeError:
        return None


def _keep_plan(key, plan):
    """Store `plan`, just made, under `key` where it can be (`_cached_plan`); returns it."""
    try:
        hash(key)
    except TypeError:
        return plan
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _source_key(source):
    """The non-tensor fields of an AngleSource (whatever `source` is: the checks judge it)."""
    if isinstance(source, AngleSource):
        return source.from_positions, source.n_axes, source.scale, source.interleaved
    return (type(source),)


def _table_layout(source):
    """((row, channel) element strides, rows) of a table; zeros for angles from positions."""
    if source.from_positions:
        return (0, 0), 0
    return (source.angles.stride(0), source.angles.stride(3)), source.angles.shape[0]


def _angles(source, table):
    """The fields of the kernel's Angles group for an AngleSource and its plan's
    `_table_layout`."""
    strides, rows = table
    return source.angles, strides, rows, source.pair_axis, source.n_axes, source.scale


def _as_source(freqs, name):
    """A table or module as an AngleSource; anything else, an AngleSource included, is left
    for the plan's checks (everything `_check_source` reads is part of the plan's key)."""
    if isinstance(freqs, AngleSource):     # what the autograd functions pass
        return freqs
    if (isinstance(freqs, (torch.Tensor, torch.nn.Module))    # a Module: no __getattr__ here
            or hasattr(freqs, "inv_freq")):
        return angle_source(freqs, name)
    return freqs


def _positions_mode(source, positions):
    if positions is None:
        return IMPLICIT_POSITIONS.value
    return AXIS_POSITIONS_TENSOR.value if source.n_axes > 1 else POSITIONS_TENSOR.value


def _make_plan(t, source, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
               interleaved, backward, out, positions, inverse, norm, norm_input, k=None,
               name="t", gpu_share=1.0, beside_plain_query=False, qk_norm=False):
    """The plan of a call of set_rotary_kernel, or with `k`, of set_rotary_qk_kernel in pair
    tiles (`t` then being q; without norms, or the forward with q's norm, `_norm_pair_tiles`,
    k's then in the launch's second Norm group). `name`: t's name in errors (its norm's
    arguments are then `{name}_norm_weight`, `{name}_input`); `gpu_share`: the share of the
    GPU's resident programs a norm's backward takes (`norm_programs`); `beside_plain_query`:
    t is the key of a q,k forward with norms whose query takes the plain tile
    (NORM_POSITIONS_TILE_BYTES says why it then does too); `qk_norm`: t is q or k of a call
    for both with norms (`_make_qk_norm_plan`)."""
    if k is not None:
        name = "q"
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")
    shape = check_rope_args(t, source, tensor_format, start_positions, cu_seqlens, cp_size,
                            cp_rank, interleaved, positions, inverse=inverse, t_name=name)
    if k is not None:
        check_qk_pair(t, k)
        k_shape = check_rope_args(k, source, tensor_format, start_positions, cu_seqlens, cp_size,
                                  cp_rank, interleaved, positions, inverse=inverse, t_name="k")
    if norm is not None:
        if not isinstance(norm, RMSNorm):
            raise TypeError(f"norm must be an RMSNorm or None, got {type(norm).__name__}")
        prefix = "" if name == "t" else f"{name}_"
        check_norm(norm, t, shape.nheads, shape.head_dim, prefix=f"{prefix}norm_")
        if backward:
            _check_norm_input(norm_input, t, "norm_input" if name == "t" else f"{name}_input")
    in_place = out is t
    if in_place and _overlaps_itself(t):
        raise ValueError("in-place RoPE needs t without overlapping memory (e.g. not an "
                         "expanded tensor)")
    if out is not None and not in_place:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != t.shape or out.dtype != t.dtype or out.device != t.device:
            raise ValueError(f"out must have t's shape {tuple(t.shape)}, dtype {t.dtype} and "
                             f"device {t.device}, got {tuple(out.shape)} {out.dtype} {out.device}")
        if _overlaps_itself(out):
            raise ValueError("out must not overlap itself in memory")
    if t.numel() == 0:
        return _RopePlan(None)
    x_strides = _token_strides(t, tensor_format)
    out_strides = x_strides if in_place else (
        _token_strides(out, tensor_format) if out is not None else
        _token_strides(torch.empty(t.shape, device="meta"), tensor_format))
    views = [(shape.nheads, x_strides), (shape.nheads, out_strides)]
    if k is not None:
        k_strides = _token_strides(k, tensor_format)
        k_out_strides = _token_strides(torch.empty(k.shape, device="meta"), tensor_format)
        views += [(k_shape.nheads, k_strides), (k_shape.nheads, k_out_strides)]
    widest = max((nheads - 1) * abs(s_h) + (shape.head_dim - 1) * abs(s_d)
                 for nheads, (_, _, s_h, s_d) in views)
    is_thd = tensor_format == "thd"
    rule = launch_rule()
    searches = is_thd and positions is None          # tiles search cu_seqlens
    norm_backward = norm is not None and backward
    positions_pass = None
    if searches and (norm_backward or (qk_norm and rule.qk_norm_positions_pass)):
        # positions from a pre-pass (SEQUENCE_POSITIONS_BLOCK, QK_NORM_POSITIONS_PASS)
        positions_pass = _sequence_positions_launch(shape, start_positions is not None, cp_size)
        searches = False
    # One tensor without a norm: where SEARCH_TILE_BYTES, SEARCH_GUESS and ONE_HEAD_TILE_BYTES
    # were measured.
    lone = norm is None and k is None
    lone_search = searches and lone
    token_bytes = shape.nheads * shape.head_dim * t.element_size()
    # TE's table in a 16-bit dtype keeps search tiles for wide tokens (TABLE_SEARCH_TOKEN_16BIT)
    table_keeps_search = (not source.from_positions and t.element_size() == 2
                          and 0 < rule.table_search_token_16bit <= token_bytes)
    narrow_token = not 0 < rule.search_wide_token <= token_bytes
    wide_token = lone_search and not narrow_token and not table_keeps_search
    # The guessed window: TE's table and wide tokens (SEARCH_GUESS), one-head tokens
    # (SEARCH_GUESS_ONE_HEAD_TOKEN).
    guess = rule.search_guess and lone_search and (
        wide_token or not source.from_positions
        or (shape.nheads == 1 and 0 < rule.search_guess_one_head_token <= token_bytes))
    # Search tiles of narrow tokens that lie inside one sequence skip the search: with angles
    # from positions without the guessed window, with TE's table at one head
    # (SEARCH_ONE_SEQUENCE says why only these). 16-bit one-head tiles that read the guessed
    # window, with angles from positions too, find the sequence in the window, and so do
    # narrow float32 ones with angles from positions (SEARCH_WINDOW_FIRST).
    checked_guess_first = not guess if source.from_positions else shape.nheads == 1
    narrow_float32 = (source.from_positions and t.element_size() == 4
                      and token_bytes <= rule.search_window_first_float32_token)
    window_first = (rule.search_window_first and guess
                    and (source.from_positions or shape.nheads == 1)
                    and (t.element_size() == 2 or narrow_float32))
    one_sequence = (rule.search_one_sequence and lone_search and narrow_token
                    and (checked_guess_first or window_first))
    window_first = window_first and one_sequence
    if searches:
        # Wide tokens take the plain tile (SEARCH_TILE_BYTES says why).
        tile_bytes = rule.tile_bytes if wide_token else rule.search_tile_bytes
    elif lone and shape.nheads == 1:
        tile_bytes = rule.one_head_tile_bytes           # ONE_HEAD_TILE_BYTES says why
    else:
        tile_bytes = rule.tile_bytes
    if norm_backward:
        tile_bytes = _norm_backward_tile_bytes(rule, source, shape.head_dim, t.element_size())
    positions_tile = (norm is not None and not backward
                      and _norm_positions_tile(rule, source, shape.nheads))
    if positions_tile and beside_plain_query:
        tile_bytes, positions_tile = rule.tile_bytes, False
    elif positions_tile:
        tile_bytes = rule.norm_positions_tile_bytes
    # Pair tiles with norms, of a query of few heads (NORM_PAIR_KEY_HEADS says why).
    few_head_pairs = (k is not None and norm is not None
                      and 1 < shape.nheads <= rule.norm_pair_few_heads)
    if few_head_pairs and not source.from_positions:
        tile_bytes //= 2
    # A norm covers every channel: a row of its tile is the whole head, and the channels past
    # rotary_dim are written in place too.
    grid, tile = launch_config(
        shape, t.device, copy_pass=not in_place or norm is not None,
        element_size=t.element_size(), tile_bytes=tile_bytes, rule=rule,
        whole_tokens=norm is not None and norm.over == "token")
    num_warps = tile.pop("num_warps")        # the rest: the Variant's tile fields, by name
    if norm is not None:
        num_warps = _norm_warps(rule, tile, backward, positions_tile)
    elif searches and source.from_positions:
        num_warps = rule.search_warps                   # SEARCH_WARPS says why
    elif (not source.from_positions and tile["BLOCK_H"] >= rule.table_warps_min_heads
          and (wide_token or not searches)):
        num_warps = rule.table_warps                    # TABLE_WARPS says why
    token_blocks, head_programs = grid
    if k is not None:
        # As many programs per token block as q's tiles take, each with a share of k's heads
        # (all of them where q's heads take one program, as at one rank of TP 8).
        tile["BLOCK_KV"] = triton.next_power_of_2(triton.cdiv(k_shape.nheads, head_programs))
        head_programs = max(head_programs, triton.cdiv(k_shape.nheads, tile["BLOCK_KV"]))
    if norm_backward:
        token_blocks = norm_programs(token_blocks, head_programs, t.device, rule, num_warps,
                                     gpu_share)
    grid, flat_grid = _program_grid(token_blocks, head_programs)
    # Read positions leave start_positions and the search to the pre-pass: a Variant without
    # them compiles once whatever the number of sequences.
    cfg = Variant(**tile, INTERLEAVED=interleaved, BACKWARD=backward,
                  SEQ_MAJOR=tensor_format == "sbhd",
                  HAS_START=start_positions is not None and positions_pass is None,
                  WIDE_INNER=widest > _INT32_MAX, ANGLES_FROM_POSITIONS=source.from_positions,
                  POSITIONS_FROM=(SEQUENCE_POSITIONS.value if positions_pass else
                                  _positions_mode(source, positions)),
                  FLAT_GRID=flat_grid, IS_THD=is_thd,
                  SEARCH_LEVELS=(_search_levels(shape.batch) if is_thd and positions_pass is None
                                 else 0),
                  SEARCH_GUESS=guess, SEARCH_ONE_SEQUENCE=one_sequence,
                  SEARCH_WINDOW_FIRST=window_first,
                  INVERSE=inverse, NORM=NO_NORM.value if norm is None else NORM_OVER[norm.over],
                  SAVED_RSTD=norm is not None and norm.rstd is not None,
                  NORM_AFTER_ANGLES=(norm is not None and not backward
                                     and _norm_after_angles(source, tile, norm, searches,
                                                            few_head_pairs)),
                  PIPELINE_STAGES=_pipeline_stages(rule.norm_pipeline_stages, source,
                                                   norm_backward, searches),
                  BATCH_OF_ONE=not is_thd and shape.batch == 1, CONTEXT_PARALLEL=cp_size > 1)
    if k is None:
        launch = _Launch(rotary_kernel, (View, View, Angles, Positions, HeadShape, Norm), grid,
                         cfg, num_warps, _max_registers(rule, cfg))
        kernel_shape = (shape.nheads, shape.head_dim, shape.rotary_dim)          # HeadShape
    else:
        launch = _Launch(rotary_qk_kernel, _QK_GROUPS, grid, (cfg, None), num_warps,
                         _max_registers(rule, cfg))
        kernel_shape = (shape.nheads, k_shape.nheads, shape.head_dim, shape.rotary_dim,
                        head_programs, 0)                                       # QKShape
    return _RopePlan(
        launch,
        x_strides=x_strides, out_strides=out_strides,
        table=_table_layout(source),
        position_strides=((0, 1, 0) if positions_pass else
                          _position_strides(positions, source, tensor_format)),
        shape=kernel_shape,
        tokens=Tokens(shape.num_tokens, shape.seq_len, shape.batch, cp_size, cp_rank),
        norm_input_strides=_token_strides(norm_input, tensor_format) if norm_backward else (),
        weight_gradient=_weight_gradient_plan(token_blocks * head_programs, norm.weight.numel())
        if norm_backward else None,
        positions_pass=positions_pass,
        k_strides=(k_strides, k_out_strides) if k is not None else (),
        transposed=[None])


def check_qk_pair(q, k):
    """q and k of one call of set_rotary_qk_kernel: tensors of the same dtype, device, tokens
    and head dim (their head counts may differ)."""
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k must have q's dtype {q.dtype} and device {q.device}, got {k.dtype} "
                         f"{k.device}")
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1:] != q.shape[-1:]:
        raise ValueError(f"k must have q's tokens and head dim, as [..., heads, d] of the same "
                         f"leading dims and d: q {tuple(q.shape)}, k {tuple(k.shape)}")


def check_qk_norms(q, k, q_norm, k_norm):
    """q's and k's norms (RMSNorms or None) fit them, each named as its tensor's
    (`q_norm_weight`, `k_norm_weight`): for calls of q and k made as two calls of one tensor,
    whose own checks would name both `norm_weight`."""
    for name, x, norm in (("q", q, q_norm), ("k", k, k_norm)):
        if norm is not None and x.dim() >= 2:
            check_norm(norm, x, x.shape[-2], x.shape[-1], prefix=f"{name}_norm_")


def _sequence_positions_launch(shape, has_start, cp_size):
    """The launch of sequence_positions_kernel for a thd call (SEQUENCE_POSITIONS_BLOCK says
    why)."""
    block = min(SEQUENCE_POSITIONS_BLOCK, triton.next_power_of_2(shape.num_tokens))
    cfg = PositionsTile(BLOCK_T=block, HAS_START=has_start,
                        SEARCH_LEVELS=_search_levels(shape.batch), CONTEXT_PARALLEL=cp_size > 1)
    return _Launch(sequence_positions_kernel, (Positions,),
                   (triton.cdiv(shape.num_tokens, block), 1), cfg, NUM_WARPS)


def _pre_pass_positions(positions_pass, tokens, start_positions, cu_seqlens, device):
    """The thd tokens' positions from a plan's sequence_positions_kernel launch, as (positions,
    start_positions, cu_seqlens) for the launch that reads them (the pre-pass applied the
    other two)."""
    positions = torch.empty(tokens.num_tokens, dtype=torch.int64, device=device)
    positions_pass((None, (0, 0, 0), start_positions, cu_seqlens), positions, *tokens)
    return positions, None, None


def _index_tensors(start_positions, cu_seqlens, positions):
    """The index tensors as the kernels read them: with unit stride and without a negative bit
    (anything else as it is, for the checks to name)."""
    if start_positions is None and cu_seqlens is None and positions is None:
        return None, None, None
    return tuple(x.resolve_neg().contiguous() if _is_dense(x) else x
                 for x in (start_positions, cu_seqlens, positions))


def set_rotary_kernel(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                      cu_seqlens=None, cp_size=1, cp_rank=0, backward=False, out=None,
                      positions=None, inverse=False, norm=None, norm_input=None,
                      return_plan=False):
    """Check the arguments, allocate the output, set up the grid and launch `rotary_kernel`.

    `freqs` is a table tensor, a RotaryPositionEmbedding or an AngleSource. `t` may have any
    strides; the result is contiguous in `t`'s format and dtype. With `backward=True`, `t` is
    the gradient of the output and the result the gradient of the input. `out=t` rotates in
    place (channels past d2 are not touched); `t` must then not overlap itself in memory.
    `inverse=True` rotates by the negated angles (its backward: `backward=True` with it).
    `norm` (an RMSNorm) normalizes t before the rotation (in place: every channel is
    written); its backward needs `norm_input`, the forward's t, and returns (the gradient of
    the input, the gradient of norm.weight). `return_plan=True` returns (the result, the launch
    plan), the plan for `set_rotary_kernel_transposed`.
    """
    if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj()):
        if out is t:
            raise ValueError("in-place RoPE needs t without a negative or conjugate bit "
                             "(call t.resolve_neg() first)")
        t = t.resolve_neg()          # the kernel reads raw memory: apply the sign first
    if isinstance(out, torch.Tensor) and out is not t and out.is_neg():
        raise ValueError("out must not have the negative bit")
    if isinstance(norm_input, torch.Tensor) and norm_input.is_neg():
        norm_input = norm_input.resolve_neg()
    source = _as_source(freqs, "freqs")
    start_positions, cu_seqlens, positions = _index_tensors(start_positions, cu_seqlens,
                                                            positions)
    tensors = (t, getattr(source, "angles", source), getattr(source, "pair_axis", None),
               start_positions, cu_seqlens, positions, None if out is t else out)
    values = ("rope", tensor_format, interleaved, cp_size, cp_rank, backward, out is t, inverse,
              *_source_key(source))
    if norm is not None:
        tensors += (norm_input,)
        values += _norm_key(norm)
    key = _metadata_key(tensors, values)
    plan = _cached_plan(key)
    if plan is None:
        plan = _keep_plan(key, _make_plan(t, source, tensor_format, start_positions, cu_seqlens,
                                          cp_size, cp_rank, interleaved, backward, out,
                                          positions, inverse, norm, norm_input))
    # After the plan, which validated out against t: whether they share memory is a matter
    # of data pointers, which no plan's key holds, so it is checked on every call.
    if out is not None and out is not t and _share_memory(out, t):
        raise ValueError("out must not share memory with t (pass out=t to rotate in place)")
    if out is None:
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    norm_group = partial = None
    if norm is not None and plan.launch is not None:
        if backward:
            partial = _partial_sums(plan.weight_gradient, t)
            norm_input = (norm_input, plan.norm_input_strides)
        norm_group = _norm_group(norm, norm_input, partial)
        if plan.positions_pass is not None:
            positions, start_positions, cu_seqlens = _pre_pass_positions(
                plan.positions_pass, plan.tokens, start_positions, cu_seqlens, t.device)
    if plan.launch is not None:
        _launch_rope(plan, t, out, source, positions, start_positions, cu_seqlens, norm_group)
    if norm is not None and backward:
        out = out, _weight_gradient(plan.weight_gradient, partial, norm)
    return (out, plan) if return_plan else out


def _launch_rope(plan, t, out, source, positions, start_positions, cu_seqlens, norm_group):
    """Launch `plan` (a _RopePlan of rotary_kernel) on t into out."""
    # The kernel's groups as plain tuples, field by field (`_Launch` says why).
    plan.launch(
        (t, plan.x_strides),                                                # x: View
        (out, plan.out_strides),                                            # out: View
        _angles(source, plan.table),                                        # Angles
        (positions, plan.position_strides, start_positions, cu_seqlens),    # Positions
        plan.shape,                                                         # HeadShape
        norm_group,                                                         # Norm or None
        *plan.tokens)             # num_tokens, seq_len, batch, cp_size, cp_rank


def _kept_transposed(plan, layout):
    """The transposed plan kept with `plan` (`_keep_transposed`) for gradients of `layout`
    (strides and dtype) under the launch rule in force, or None."""
    entry = plan.transposed[0] if plan.transposed is not None else None
    if entry is not None and entry[0] == layout and entry[1] == _launch_rule():
        return entry[2]
    return None


def _keep_transposed(plan, layout, transposed):
    """Keep `transposed` with `plan` for gradients of `layout` under the launch rule in force,
    in place of what was kept: one entry, replaced whole, so that threads sharing `plan` never
    see half of one. The transposed launchers look it up and keep it written out, not through
    a function given closures, whose creation on every call costs CPU time (as
    `_cached_plan`'s comment says)."""
    if plan.transposed is not None:
        plan.transposed[0] = (layout, _launch_rule(), transposed)


def set_rotary_kernel_transposed(grad, plan, source, tensor_format="sbhd", start_positions=None,
                                 interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0,
                                 backward=True, positions=None, inverse=False):
    """`set_rotary_kernel(grad, source, ..., backward)` (no norm, no `out`), where `plan` is the
    plan `set_rotary_kernel(..., return_plan=True)` returned for the same call with the
    rotation transposed (`backward` the other way): an autograd backward's launch. The
    transposed plan is kept with `plan`, for the last gradient strides, dtype and launch rule
    seen, so that a backward skips the plan's key, whose metadata of every tensor costs CPU
    time on every step (and twice as much on autograd's device thread, where backwards run).
    `source` is the AngleSource the forward was called with."""
    if grad.is_neg():
        grad = grad.resolve_neg()        # the kernel reads raw memory: apply the sign first
    layout = (grad.stride(), grad.dtype)
    transposed = _kept_transposed(plan, layout)
    if transposed is None:
        out, transposed = set_rotary_kernel(grad, source, tensor_format, start_positions,
                                            interleaved, cu_seqlens, cp_size, cp_rank, backward,
                                            positions=positions, inverse=inverse,
                                            return_plan=True)
        _keep_transposed(plan, layout, transposed)
        return out
    # A kept plan is of a call with elements: the forward's, whose gradient has its shape.
    start_positions, cu_seqlens, positions = _index_tensors(start_positions, cu_seqlens,
                                                            positions)
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    _launch_rope(transposed, grad, out, source, positions, start_positions, cu_seqlens, None)
    return out


def set_rotary_qk_kernel(q, k, freqs, tensor_format="sbhd", start_positions=None,
                         interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0, backward=False,
                         positions=None, inverse=False, q_norm=None, k_norm=None, q_input=None,
                         k_input=None, return_plan=False):
    """`set_rotary_kernel` of q and of k by the same angles, in one launch of
    `rotary_qk_kernel`: q and k of the same tokens and head dim, any head counts, any strides.
    Returns (q's result, k's), contiguous. q_norm and k_norm (RMSNorms, both or neither)
    normalize q and k before the rotation, in one launch of pair tiles (`_norm_pair_tiles`)
    or of q's and k's own tiles where those allow it (`_joins`), else in two; their backward
    reads the forward's q and k (q_input, k_input) and returns (dq, dk, the gradient of
    q_norm.weight, that of k_norm.weight). Without norms, `return_plan=True` returns ((q's
    result, k's), the launch plan), the plan for `set_rotary_qk_kernel_transposed` (None for
    a call without elements)."""
    check_norm_pair(q_norm, k_norm)
    norm_backward = q_norm is not None and backward
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        check_qk_pair(q, k)          # names q or k (a plan's key has no place for a missing k)
    if q.numel() == 0 or k.numel() == 0:
        # Nothing to share: each its own call (the one with elements launches), of a valid pair
        # whose weights are named as q's and k's.
        check_qk_pair(q, k)
        check_qk_norms(q, k, q_norm, k_norm)
        results = [set_rotary_kernel(x, freqs, tensor_format, start_positions, interleaved,
                                     cu_seqlens, cp_size, cp_rank, backward, positions=positions,
                                     inverse=inverse, norm=norm, norm_input=x_in)
                   for x, norm, x_in in ((q, q_norm, q_input), (k, k_norm, k_input))]
        if norm_backward:                      # (dq, dwq), (dk, dwk) -> dq, dk, dwq, dwk
            (dq, dwq), (dk, dwk) = results
            return dq, dk, dwq, dwk
        return (tuple(results), None) if return_plan else tuple(results)
    q, k, q_input, k_input = (x.resolve_neg() if isinstance(x, torch.Tensor) else x
                              for x in (q, k, q_input, k_input))
    source = _as_source(freqs, "freqs")
    start_positions, cu_seqlens, positions = _index_tensors(start_positions, cu_seqlens,
                                                            positions)
    tensors = (q, k, getattr(source, "angles", source), getattr(source, "pair_axis", None),
               start_positions, cu_seqlens, positions)
    values = ("qk", tensor_format, interleaved, cp_size, cp_rank, backward, inverse,
              *_source_key(source))
    if q_norm is None:
        key = _metadata_key(tensors, values)
        plan = _cached_plan(key)
        if plan is None:
            plan = _keep_plan(key, _make_plan(
                q, source, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
                interleaved, backward, None, positions, inverse, None, None, k))
        outs = _launch_rope_qk(plan, q, k, source, positions, start_positions, cu_seqlens)
        return (outs, plan) if return_plan else outs
    if backward:
        tensors += (q_input, k_input)
    values += (*_norm_key(q_norm), *_norm_key(k_norm))
    key = _metadata_key(tensors, values)
    plan = _cached_plan(key)
    if plan is None:
        plan = _keep_plan(key, _make_qk_norm_plan(
            q, k, source, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
            interleaved, backward, positions, inverse, q_norm, k_norm, q_input, k_input))
    q_out, k_out = _contiguous_outputs(q, k)
    partials = (None, None, None)
    inputs = (None, None)
    if backward:
        partials = _pair_partial_sums(plan.weight_gradients, q)
        inputs = ((q_input, plan.q.norm_input_strides), (k_input, plan.k.norm_input_strides))
    q_partial, k_partial, _ = partials
    if plan.positions_pass is not None:
        positions, start_positions, cu_seqlens = _pre_pass_positions(
            plan.positions_pass, plan.q.tokens, start_positions, cu_seqlens, q.device)
    q_norm_group = _norm_group(q_norm, inputs[0], q_partial)
    k_norm_group = _norm_group(k_norm, inputs[1], k_partial)
    angles = _angles(source, plan.q.table)
    positions_group = (positions, plan.q.position_strides, start_positions, cu_seqlens)
    # The kernels' groups as plain tuples, field by field (`_Launch` says why).
    if plan.launch is not None:
        plan.launch(
            ((q, plan.q.x_strides), (q_out, plan.q.out_strides)),               # q: InOut
            ((k, plan.k.x_strides), (k_out, plan.k.out_strides)),               # k: InOut
            angles, positions_group, plan.shape, q_norm_group, k_norm_group,
            *plan.q.tokens)           # num_tokens, seq_len, batch, cp_size, cp_rank
    else:
        for x, out, x_plan, norm_group in ((q, q_out, plan.q, q_norm_group),
                                           (k, k_out, plan.k, k_norm_group)):
            x_plan.launch((x, x_plan.x_strides), (out, x_plan.out_strides), angles,
                          positions_group, x_plan.shape, norm_group, *x_plan.tokens)
    if backward:
        return (q_out, k_out,
                *_pair_weight_gradients(plan.weight_gradients, partials, q_norm, k_norm))
    return q_out, k_out


def _launch_rope_qk(plan, q, k, source, positions, start_positions, cu_seqlens):
    """Launch `plan` (a _RopePlan of rotary_qk_kernel without norms) on q and k; returns their
    results, contiguous."""
    q_out, k_out = _contiguous_outputs(q, k)
    k_strides, k_out_strides = plan.k_strides
    # The kernel's groups as plain tuples, field by field (`_Launch` says why).
    plan.launch(
        ((q, plan.x_strides), (q_out, plan.out_strides)),                   # q: InOut
        ((k, k_strides), (k_out, k_out_strides)),                           # k: InOut
        _angles(source, plan.table),                                        # Angles
        (positions, plan.position_strides, start_positions, cu_seqlens),    # Positions
        plan.shape,                                                         # QKShape
        None, None,                                                         # no norms
        *plan.tokens)             # num_tokens, seq_len, batch, cp_size, cp_rank
    return q_out, k_out


def set_rotary_qk_kernel_transposed(grad_q, grad_k, plan, source, tensor_format="sbhd",
                                    start_positions=None, interleaved=False, cu_seqlens=None,
                                    cp_size=1, cp_rank=0, backward=True, positions=None,
                                    inverse=False):
    """`set_rotary_kernel_transposed` of `set_rotary_qk_kernel` without norms: its call on
    grad_q and grad_k, where `plan` is what `set_rotary_qk_kernel(..., return_plan=True)`
    returned for the call with the rotation transposed."""
    grad_q, grad_k = (g.resolve_neg() if g.is_neg() else g for g in (grad_q, grad_k))
    layout = (grad_q.stride(), grad_k.stride(), grad_q.dtype)
    transposed = _kept_transposed(plan, layout)
    if transposed is None:
        outs, transposed = set_rotary_qk_kernel(grad_q, grad_k, source, tensor_format,
                                                start_positions, interleaved, cu_seqlens, cp_size,
                                                cp_rank, backward, positions, inverse,
                                                return_plan=True)
        _keep_transposed(plan, layout, transposed)
        return outs
    start_positions, cu_seqlens, positions = _index_tensors(start_positions, cu_seqlens,
                                                            positions)
    return _launch_rope_qk(transposed, grad_q, grad_k, source, positions, start_positions,
                           cu_seqlens)


def _contiguous_outputs(q, k):
    """Results like q and k, contiguous in their format."""
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k))


def _make_qk_norm_plan(q, k, source, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
                       interleaved, backward, positions, inverse, q_norm, k_norm, q_input,
                       k_input):
    """The plan of set_rotary_qk_kernel with norms (q and k not empty): each tensor planned as
    its own call of set_rotary_kernel (but a key beside a query in the plain tile, forward:
    NORM_POSITIONS_TILE_BYTES), then pair tiles where `_norm_pair_tiles` says so, else both
    launched as one where that keeps each tensor's tiles as they are (`_joins`), else the two
    launches. A norm's backward in one launch keeps about as many programs resident as one
    call would, shared between q and k in proportion to their sizes (each program loops over
    its share of the token blocks)."""
    check_qk_pair(q, k)
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if not isinstance(norm, RMSNorm):
            raise TypeError(f"{name} must be an RMSNorm or None, got {type(norm).__name__}")

    def plan(x, norm, x_input, name, share=1.0, beside_plain_query=False, k=None):
        return _make_plan(x, source, tensor_format, start_positions, cu_seqlens, cp_size,
                          cp_rank, interleaved, backward, None, positions, inverse, norm,
                          x_input, k, name=name, gpu_share=share,
                          beside_plain_query=beside_plain_query, qk_norm=True)
    q_plan = plan(q, q_norm, q_input, "q")       # checks the call, the source included
    # A query in the plain tile (neither one head nor the positions tile): the key takes it too.
    q_heads = q.shape[-2]
    beside_plain_query = (not backward and q_heads > 1
                          and not _norm_positions_tile(launch_rule(), source, q_heads))
    k_plan = plan(k, k_norm, k_input, "k", beside_plain_query=beside_plain_query)
    if _norm_pair_tiles(launch_rule(), backward, source, q_heads, k.shape[-2], q_norm, k_norm):
        pair = plan(q, q_norm, None, "q", k=k)       # q's forward tile with k's heads joined
        return _QKNormPlan(pair.launch, q_plan, k_plan, pair.shape, pair.positions_pass)
    if not _joins(q_plan.launch, k_plan.launch):
        if launch_rule().qk_norm_overlap and _launches_early(q.device):
            q_plan, k_plan = _overlapped(q_plan, k_plan)
        return _QKNormPlan(None, q_plan, k_plan, positions_pass=q_plan.positions_pass,
                           weight_gradients=_qk_weight_gradients(q_plan, k_plan, q_norm, k_norm))
    if backward:
        q_share = q.numel() / (q.numel() + k.numel())
        q_plan = plan(q, q_norm, q_input, "q", q_share)
        k_plan = plan(k, k_norm, k_input, "k", 1.0 - q_share)
    q_launch, k_launch = q_plan.launch, k_plan.launch
    q_programs, programs = q_launch.grid[0], q_launch.grid[0] + k_launch.grid[0]
    if programs > _MAX_GRID_X:
        raise ValueError(f"q and k need {programs} programs; a launch takes at most {_MAX_GRID_X}")
    q_shape, k_shape = q_plan.shape, k_plan.shape                  # HeadShapes
    return _QKNormPlan(
        _Launch(rotary_qk_kernel, _QK_GROUPS, (programs, 1), (q_launch.cfg, k_launch.cfg),
                q_launch.num_warps, q_launch.options.get("maxnreg", 0)),
        q_plan, k_plan, (q_shape[0], k_shape[0], q_shape[1], q_shape[2], 0, q_programs),  # QKShape
        q_plan.positions_pass, _qk_weight_gradients(q_plan, k_plan, q_norm, k_norm))


def _overlapped(first, second):
    """Two rotary_kernel plans launched one right after the other, the second free to start
    while the first's last programs run (QK_NORM_OVERLAP): the first lets it start once all its
    programs have begun (Variant.LAUNCH_DEPENDENTS), and the second, launched early, waits for
    the first at its end (Variant.WAITS_FOR_PREVIOUS), so that what the stream runs next starts
    after both. The second reads nothing the first writes, and everything it reads was written
    before the first began (which was launched as usual)."""
    a, b = first.launch, second.launch
    return (first._replace(launch=a.with_cfg(a.cfg._replace(LAUNCH_DEPENDENTS=True))),
            second._replace(launch=b.with_cfg(b.cfg._replace(WAITS_FOR_PREVIOUS=True), early=True)))


def _qk_weight_gradients(q_plan, k_plan, q_norm, k_norm):
    """`_weight_gradient_plans` for q's and k's plans (none in the forward)."""
    if q_plan.weight_gradient is None:
        return ()
    return _weight_gradient_plans(q_plan.weight_gradient.rows[0], k_plan.weight_gradient.rows[0],
                                  q_norm, k_norm)


def _norm_pair_tiles(rule, backward, source, q_heads, k_heads, q_norm, k_norm):
    """Whether a q,k forward with norms takes pair tiles (rotary_qk_kernel's: a tile of query
    heads with the key heads of its tokens, their angles worked out once for both), planned as
    q's own forward tile with the key heads joined: a query of several heads (with angles from
    positions, at most rule.norm_pair_exact_max_heads) and at most rule.norm_pair_key_heads key
    heads, under per-head norms (NORM_PAIR_KEY_HEADS says why)."""
    return (not backward and q_heads > 1 and k_heads <= rule.norm_pair_key_heads
            and q_norm.over == k_norm.over == "head"
            and (not source.from_positions or q_heads <= rule.norm_pair_exact_max_heads))


def _norm_after_angles(source, tile, norm, searches, few_head_pairs=False):
    """Whether a forward with a norm normalizes after working out its tile's angles
    (Variant.NORM_AFTER_ANGLES): where no tile searches cu_seqlens, a per-head norm in tiles
    of several heads that hold one token or take their angles from a table, and the pair
    tiles of a query of few heads with angles from positions (`few_head_pairs`;
    NORM_PAIR_KEY_HEADS says why).

    The norm's sums wait for the tile's loads. A tile of several heads works its angles out in
    one-trip loops (`_tile_angles`), which the compiler does not move ahead of that wait;
    normalizing after them fills the wait with their arithmetic, but keeps the loads and the
    weights live across them (more registers). Forward of q and k with norms, 16K tokens
    unless named, in copies of q and k, H100 / H200 (artifacts/qknorm/norm_after_angles_ab_*):
    with TE's table, Qwen3-8B 1.046 -> 1.043 / 1.176 -> 1.070, Gemma 3 1.077 -> 1.070 /
    1.227 -> 1.064, Qwen3-8B under TP 8 at 64K 1.514 -> 1.406 / 1.739 -> 1.534; with exact
    angles within 0.01 both ways. After the angles everywhere, the H200 lost where this rule
    normalizes first: positions tiles of several tokens (TP 8's query, 8 tokens x 4 heads)
    0.842 -> 0.897 of the pair's copy, OLMo 2's norm over the token 1.057 -> 1.106 (TE's
    table 1.155 -> 1.701), tiles that search cu_seqlens with TE's table 0.913 -> 0.987, and
    one-head tiles with TE's table 0.538 -> 0.566."""
    if searches:
        return False
    if few_head_pairs and source.from_positions:
        return True
    return norm.over == "head" and tile["BLOCK_H"] > 1 and (tile["BLOCK_T"] == 1
                                                            or not source.from_positions)


def _joins(q_launch, k_launch):
    """Whether q's and k's launches (with norms) go as one: where their tiles differ and take
    the same warps. With the same tiles both branches of rotary_qk_kernel are the same code,
    which the compiler merges into one that takes more registers than either (Triton 3.6,
    sm_90: the backward of 4 + 4 heads 128 -> 135, OLMo 2's norm over 32 + 32 heads 128 ->
    166), so that fewer programs are resident; OLMo 2's forward + backward, 2.62 -> 2.84
    copies on the H100. With other warps, one tensor would run tiles sized for other warps:
    Qwen3-8B's forward (2 and 4 warps), 1.015 -> 1.04 copies on the H100
    (artifacts/qknorm/qk_joint_always_ab_h100.log)."""
    return q_launch.cfg != k_launch.cfg and q_launch.num_warps == k_launch.num_warps


def check_qkv_args(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                   cp_size, cp_rank, interleaved, positions=None, need_kernel=True,
                   inverse=False):
    """Validate a fused-QKV call; returns (RopeShape of the key part, (q, k, v) widths)."""
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format must be 'sbhd' or 'bshd' for fused QKV, got {tensor_format!r}")
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    split = qkv_split_arg_list
    if (not isinstance(split, (list, tuple)) or len(split) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split)):
        raise ValueError(f"qkv_split_arg_list must be three positive ints [q, k, v], got {split!r}")
    if qkv.dim() != 4 or qkv.shape[-1] != sum(split):
        raise ValueError(f"qkv must be 4-D [{', '.join(tensor_format[:3])}, q+k+v] with last dim "
                         f"{sum(split)} = sum(qkv_split_arg_list), got shape {tuple(qkv.shape)}")
    if split[0] % split[1]:
        raise ValueError(f"qkv_split_arg_list: q width {split[0]} must be a multiple of the head "
                         f"dim (k width) {split[1]}")
    key_part = qkv[..., split[0]:split[0] + split[1]]
    shapes = [check_rope_args(key_part, freqs, tensor_format, start_positions, None, cp_size,
                              cp_rank, interleaved, positions, need_kernel, t_name="qkv",
                              freqs_name=name, inverse=inverse)
              for name, freqs in (("q_freqs", q_freqs), ("k_freqs", k_freqs))]
    q_source, k_source = angle_source(q_freqs, "q_freqs"), angle_source(k_freqs, "k_freqs")
    if shapes[0].rotary_dim != shapes[1].rotary_dim:
        raise ValueError(f"q_freqs and k_freqs must rotate the same number of channels, got "
                         f"{shapes[0].rotary_dim} and {shapes[1].rotary_dim}")
    if (q_source.from_positions, q_source.n_axes) != (k_source.from_positions, k_source.n_axes):
        raise TypeError("q_freqs and k_freqs must be of one kind: both tables, or both "
                        "RotaryPositionEmbedding with the same number of position axes")
    return shapes[1], tuple(split)


def _seq_batch_strides(x: torch.Tensor, tensor_format: str):
    return (x.stride(0), x.stride(1)) if tensor_format == "sbhd" else (x.stride(1), x.stride(0))


def _packed_views(packed, split):
    """q, k and v inside a packed tensor; q as [.., kv heads, q heads per kv, d]."""
    q_dim, k_dim, _ = split
    return (packed[..., :q_dim].unflatten(-1, (q_dim // k_dim, k_dim)),
            *_packed_starts(packed, split)[1:])


def _packed_starts(packed, split):
    """Tensors that start where q, k and v start inside a packed tensor (q: the packed tensor
    itself). A launch needs of them only where they start (the plan holds the views' strides,
    `_packed_views`), and every view made per call costs CPU time: an unflatten alone about
    as much as allocating the output."""
    q_dim, k_dim, _ = split
    return packed, packed[..., q_dim:q_dim + k_dim], packed[..., q_dim + k_dim:]


def _qkv_views(qkv, split, grads, result):
    """(source, destination) views of q, k and v for the kernel, in that order: forward from
    the packed tensor, backward into it; q as [.., kv heads, q heads per kv, d]."""
    q_per_kv, kv_heads = split[0] // split[1], qkv.shape[2]
    q_packed, k_packed, v_packed = _packed_views(qkv if grads is None else result, split)
    if grads is None:
        return (q_packed, result[0].unflatten(2, (kv_heads, q_per_kv)), k_packed, result[1],
                v_packed, result[2])
    dq, dk, dv = grads
    return dq.unflatten(2, (kv_heads, q_per_kv)), q_packed, dk, k_packed, dv, v_packed


def _qkv_launch_tensors(qkv, split, grads, result):
    """`_qkv_views`' six tensors as a launch needs them, for where they start (the plan holds
    the views' strides): the packed tensor's parts from `_packed_starts`, q's result and
    gradient as they are."""
    if grads is None:
        q, k, v = _packed_starts(qkv, split)
        return q, result[0], k, result[1], v, result[2]
    q, k, v = _packed_starts(result, split)
    dq, dk, dv = grads
    return dq, q, dk, k, dv, v


def qkv_outputs(qkv, split, grads=None):
    if grads is not None:
        return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    lead, kv_heads = qkv.shape[:2], qkv.shape[2]
    q_dim, k_dim, v_dim = split
    dtype, device = qkv.dtype, qkv.device
    return (torch.empty(*lead, kv_heads * (q_dim // k_dim), k_dim, dtype=dtype, device=device),
            torch.empty(*lead, kv_heads, k_dim, dtype=dtype, device=device),
            torch.empty(*lead, kv_heads, v_dim, dtype=dtype, device=device))


def check_norm_pair(q_norm, k_norm):
    """The norms of q and k (RMSNorms, or their weights): both or neither."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give q_norm_weight and k_norm_weight together (or neither)")
    if isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm) and (
            (q_norm.rstd is None) != (k_norm.rstd is None)):
        raise ValueError("give q_norm.rstd and k_norm.rstd together (or neither): a pair tile "
                         "writes or reads both")


def check_qkv_norms(qkv, split, q_norm, k_norm):
    """The per-head norms of q and k (RMSNorm, both or neither) fit the packed qkv."""
    check_norm_pair(q_norm, k_norm)
    if q_norm is None:
        return
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if not isinstance(norm, RMSNorm):
            raise TypeError(f"{name} must be an RMSNorm or None, got {type(norm).__name__}")
        if norm.over != "head":
            raise ValueError(f"fused QKV normalizes each head (norm_over='head'), got "
                             f"{norm.over!r}")
        if norm.rstd is not None:
            raise ValueError(f"fused QKV works each row's rstd out in its backward: {name} "
                             f"takes no rstd")
    kv_heads, head_dim = qkv.shape[2], split[1]
    check_norm(q_norm, qkv, kv_heads * (split[0] // head_dim), head_dim, prefix="q_norm_")
    check_norm(k_norm, qkv, kv_heads, head_dim, prefix="k_norm_")


def _make_qkv_plan(qkv, q_source, k_source, split, tensor_format, start_positions, interleaved,
                   cp_size, cp_rank, grads, positions, inverse, q_norm, k_norm):
    shape, split = check_qkv_args(qkv, q_source, k_source, split, tensor_format, start_positions,
                                  cp_size, cp_rank, interleaved, positions, inverse=inverse)
    check_qkv_norms(qkv, split, q_norm, k_norm)
    q_dim, k_dim, v_dim = split
    kv_heads, q_per_kv = qkv.shape[2], q_dim // k_dim
    if grads is not None:
        want = [(*qkv.shape[:2], kv_heads * q_per_kv, k_dim), (*qkv.shape[:2], kv_heads, k_dim),
                (*qkv.shape[:2], kv_heads, v_dim)]
        if len(grads) != 3 or not all(isinstance(g, torch.Tensor) for g in grads):
            raise TypeError("grads must be three tensors (dq, dk, dv)")
        for name, g, shp in zip(("dq", "dk", "dv"), grads, want):
            if tuple(g.shape) != shp or g.dtype != qkv.dtype or g.device != qkv.device:
                raise ValueError(f"{name} must have shape {shp}, dtype {qkv.dtype} and device "
                                 f"{qkv.device}, got {tuple(g.shape)} {g.dtype} {g.device}")
    if qkv.numel() == 0:
        return _QKVPlan(None, split)
    views = _qkv_views(qkv, split, grads, qkv_outputs(qkv.to("meta"), split, grads))
    widest = max(sum((n - 1) * abs(st) for n, st in zip(x.shape[2:], x.stride()[2:])) for x in views)
    # Tiles sized for the query heads; a key program takes as many kv heads (key and value)
    # as keep its tile no larger than a query tile.
    rule = launch_rule()
    norm_backward = q_norm is not None and grads is not None
    tile_bytes = (_norm_backward_tile_bytes(rule, q_source, k_dim, qkv.element_size())
                  if norm_backward else rule.qkv_tile_bytes)
    grid, tile = launch_config(
        shape._replace(nheads=kv_heads * q_per_kv), qkv.device, copy_pass=True,
        element_size=qkv.element_size(), tile_bytes=tile_bytes, rule=rule)
    num_warps = tile.pop("num_warps")        # the rest: the Variant's tile fields, by name
    if q_norm is not None:
        num_warps = _norm_warps(rule, tile, grads is not None, q_source.from_positions)
    row = 2 * tile["BLOCK_HALF"] + tile["BLOCK_PASS"]
    block_v = triton.next_power_of_2(v_dim)
    block_kv = min(tile["BLOCK_H"], triton.next_power_of_2(kv_heads))
    while block_kv > 1 and block_kv * (row + block_v) > tile["BLOCK_H"] * row:
        block_kv //= 2
    q_programs = triton.cdiv(kv_heads * q_per_kv, tile["BLOCK_H"])
    k_programs = triton.cdiv(kv_heads, block_kv)
    token_blocks = grid[0]
    if norm_backward:
        token_blocks = norm_programs(token_blocks, q_programs + k_programs, qkv.device, rule,
                                     num_warps)
    grid, flat_grid = _program_grid(token_blocks, q_programs + k_programs, "qkv")
    cfg = Variant(**tile, INTERLEAVED=interleaved, BACKWARD=grads is not None,
                  SEQ_MAJOR=tensor_format == "sbhd", HAS_START=start_positions is not None,
                  WIDE_INNER=widest > _INT32_MAX,
                  ANGLES_FROM_POSITIONS=q_source.from_positions,
                  POSITIONS_FROM=_positions_mode(q_source, positions), FLAT_GRID=flat_grid,
                  BLOCK_KV=block_kv, BLOCK_V=block_v, INVERSE=inverse,
                  NORM=NO_NORM.value if q_norm is None else NORM_OVER_HEAD.value,
                  PIPELINE_STAGES=_pipeline_stages(rule.norm_pipeline_stages, q_source,
                                                   norm_backward, False),
                  BATCH_OF_ONE=shape.batch == 1, CONTEXT_PARALLEL=cp_size > 1)
    input_strides = ()
    if norm_backward:
        input_strides = tuple((*_seq_batch_strides(x, tensor_format), *x.stride()[2:])
                              for x in _packed_views(qkv, split)[:2])
    return _QKVPlan(
        _Launch(rotary_qkv_kernel,
                (InOut, InOut, InOut, Angles, Angles, Positions, QKVShape, Norm, Norm),
                grid, cfg, num_warps, _max_registers(rule, cfg)),
        split,
        # (seq, batch, then the remaining dims) strides of each view
        view_strides=tuple((*_seq_batch_strides(x, tensor_format), *x.stride()[2:]) for x in views),
        q_table=_table_layout(q_source), k_table=_table_layout(k_source),
        position_strides=_position_strides(positions, q_source, tensor_format),
        shape=(kv_heads, q_per_kv, k_dim, shape.rotary_dim, v_dim, q_programs),  # QKVShape
        tokens=Tokens(shape.num_tokens, shape.seq_len, shape.batch, cp_size, cp_rank),
        input_strides=input_strides,
        weight_gradients=_weight_gradient_plans(token_blocks * q_programs,
                                                token_blocks * k_programs, q_norm, k_norm)
        if norm_backward else ())


def set_rotary_qkv_kernel(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                          start_positions=None, interleaved=False, cp_size=1, cp_rank=0,
                          grads=None, positions=None, inverse=False, q_norm=None, k_norm=None):
    """Fused QKV RoPE in one launch. Forward (grads=None): qkv [s, b, h_kv, q+k+v] (or bshd)
    -> (q [.., h_kv*q/d, d], k [.., h_kv, d], v [.., h_kv, v]), contiguous. Backward
    (grads=(dq, dk, dv), any strides): -> the packed gradient of qkv, contiguous.
    `inverse=True`: q and k rotated by the negated angles (backward: that map's gradient).
    q_norm, k_norm (RMSNorm over each head, both or neither) normalize q and k before the
    rotation; their backward reads the forward's qkv (pass it as `qkv`) and returns (the packed
    gradient, the gradient of q_norm.weight, that of k_norm.weight)."""
    if isinstance(qkv, torch.Tensor):
        qkv = qkv.resolve_neg()
    if grads is not None:
        grads = tuple(g.resolve_neg() if isinstance(g, torch.Tensor) else g for g in grads)
    sources = [_as_source(q_freqs, "q_freqs"), _as_source(k_freqs, "k_freqs")]
    start_positions, _, positions = _index_tensors(start_positions, None, positions)
    split = qkv_split_arg_list
    tensors = (qkv, *[getattr(s, "angles", s) for s in sources],
               *[getattr(s, "pair_axis", None) for s in sources], start_positions, positions,
               *(grads or ()))
    values = ("qkv", _typed(split), tensor_format, interleaved, cp_size, cp_rank, grads is None,
              inverse, *_source_key(sources[0]), *_source_key(sources[1]))
    if q_norm is not None or k_norm is not None:
        values += (*_norm_key(q_norm), *_norm_key(k_norm))
    key = _metadata_key(tensors, values)
    plan = _cached_plan(key)
    if plan is None:
        plan = _keep_plan(key, _make_qkv_plan(
            qkv, *sources, split, tensor_format, start_positions, interleaved, cp_size, cp_rank,
            grads, positions, inverse, q_norm, k_norm))
    result = qkv_outputs(qkv, plan.split, grads)
    norms = (None, None)
    partials = None
    if q_norm is not None and plan.launch is not None:
        inputs = (None, None)
        q_partial = k_partial = None
        if grads is not None:
            q_in, k_in, _ = _packed_starts(qkv, plan.split)
            inputs = ((q_in, plan.input_strides[0]), (k_in, plan.input_strides[1]))
            partials = _pair_partial_sums(plan.weight_gradients, qkv)
            q_partial, k_partial, _ = partials
        norms = [_norm_group(norm, x, partial)
                 for norm, x, partial in zip((q_norm, k_norm), inputs, (q_partial, k_partial))]
    if plan.launch is not None:
        q_source, k_source = sources
        q_src, q_dst, k_src, k_dst, v_src, v_dst = _qkv_launch_tensors(qkv, plan.split, grads,
                                                                        result)
        strides = plan.view_strides
        # The kernel's groups as plain tuples, field by field (`_Launch` says why).
        plan.launch(
            ((q_src, strides[0]), (q_dst, strides[1])),                         # q: InOut
            ((k_src, strides[2]), (k_dst, strides[3])),                         # k: InOut
            ((v_src, strides[4]), (v_dst, strides[5])),                         # v: InOut
            _angles(q_source, plan.q_table),                                    # q: Angles
            _angles(k_source, plan.k_table),                                    # k: Angles
            (positions, plan.position_strides, start_positions, None),          # Positions
            plan.shape,                                                         # QKVShape
            *norms,                                                             # q, k: Norm
            *plan.tokens)             # num_tokens, seq_len, batch, cp_size, cp_rank
    if q_norm is not None and grads is not None:
        if partials is None:           # nothing launched: zeros
            return result, torch.zeros_like(q_norm.weight), torch.zeros_like(k_norm.weight)
        return (result, *_pair_weight_gradients(plan.weight_gradients, partials, q_norm, k_norm))
    return result
