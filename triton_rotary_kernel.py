"""Fused rotary position embedding (RoPE) in Triton: the kernels (device code only; the
checks, launch rule, plan cache and launch are in triton_rotary_launch.py).

One kernel serves forward and backward. With x1/x2 the two members of each rotated pair
(first/second half of the rotary channels, or even/odd channels when interleaved) and
f1/f2 their angles, the forward is

    out1 = x1 * cos(f1) - x2 * sin(f1)
    out2 = x2 * cos(f2) + x1 * sin(f2)

and the backward is its exact transpose,

    dx1 = g1 * cos(f1) + g2 * sin(f2)
    dx2 = g2 * cos(f2) - g1 * sin(f1)

i.e. the same code with the sines negated and swapped between the members (`BACKWARD`).
For frequencies built as TE's `RotaryPositionEmbedding` builds them (f1 == f2) this is the
familiar "rotate by -theta"; for arbitrary frequencies it is still the true gradient, which
is what Transformer Engine's CUDA kernel computes too.

`INVERSE` rotates by the negated angles, -f1 and -f2 (the sines negated, not swapped), for any
frequencies; with `BACKWARD` too, that map's transpose (the sines swapped, not negated):

    forward      sin_a, sin_b =  sin(f1),  sin(f2)     out1 = x1 cos(f1) - x2 sin_a
    BACKWARD     sin_a, sin_b = -sin(f2), -sin(f1)     out2 = x2 cos(f2) + x1 sin_b
    INVERSE      sin_a, sin_b = -sin(f1), -sin(f2)
    both         sin_a, sin_b =  sin(f2),  sin(f1)

The angles come from one of two sources (`Variant.ANGLES_FROM_POSITIONS`):
- a table, TE's interface: f = freqs[position, channel], float32 angles;
- integer positions and inverse frequencies: f = position * inv_freq[pair], the exact real
  product (never rounded to float32), optionally scaled (YaRN's attention factor) and, for
  M-RoPE, with each pair taking its position from its own axis (`Angles.pair_axis`).
Positions are implicit (TE: the token's index in its sequence, with start_positions, thd and
context parallelism) or read from a `positions` tensor.

Channels `rotary_dim..head_dim` are copied through. Arithmetic is float32 (float64 for
float64 inputs, so that `gradcheck` can run through the kernel).

QK-norm (`Variant.NORM`): an RMSNorm before the rotation, over each head's d channels or over
all heads of a token (n channels in all), with w the weight plus `Norm.offset`:

    xhat = x * rstd,  rstd = 1 / sqrt(sum(x^2) / n + eps),  y = RoPE(xhat * w)

Its backward takes g = dL/dy, rotates it back (gn = RoPE^T(g), the gradient of xhat * w) and
applies the norm's own transpose,

    dx = rstd * (gn * w - xhat * sum(gn * w * xhat) / n),   dw = sum over tokens of gn * xhat

(for a per-head norm, the tokens' heads too; rstd the forward's where it saved it,
`Variant.SAVED_RSTD`, else worked out again). dw is reduced deterministically: each program
loops over its share of the token blocks and writes one row of partial sums, which a second
kernel, `weight_gradient_kernel`, adds up in one fixed order.

Reading order: the argument groups (View, Angles, Positions, the shapes, Norm, Variant), the
kernels, `_rope_tile` (one tile: `_tile_inputs` loads it and applies the forward's norm,
`_tile_rotation` works out its angles, `_rotate_and_store` rotates (after the forward's norm
where `Variant.NORM_AFTER_ANGLES` puts it there), takes the backward's norm and stores;
`_rope_pair_tile` shares one rotation between a query and a key tile), the norm's arithmetic
(`_rms_norm`, `_rstd`, `_rms_norm_backward`), the tokens' positions (`_positions`, the thd search of
cu_seqlens), the angles (`_tile_angles`, from a table or from positions), and last the
arithmetic: fma, sin and cos.
"""

import os
from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# TRITON_INTERPRET must be set before this module is imported (Triton itself reads it at
# import too).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Where the positions of the tokens come from (Variant.POSITIONS_FROM).
IMPLICIT_POSITIONS = tl.constexpr(0)     # index in the sequence: start_positions, thd, CP
POSITIONS_TENSOR = tl.constexpr(1)       # one position per token, from `positions`
AXIS_POSITIONS_TENSOR = tl.constexpr(2)  # M-RoPE: positions[axis, token], axis chosen per pair
SEQUENCE_POSITIONS = tl.constexpr(3)     # thd: implicit positions that sequence_positions_kernel
                                         # stored, OUTSIDE_SEQUENCES for tokens in none
# Far outside what any position rotates by (a table's rows, the exact angles' |position| < 2^24).
OUTSIDE_SEQUENCES = tl.constexpr(-(2**62))

# Programmatic dependent launch (Hopper's grid dependency control, PTX griddepcontrol) runs on the
# GPU only: the interpreter runs no inline PTX, and its launches are sequential anyway.
_GRID_DEPENDENCY_CONTROL = tl.constexpr(not _INTERPRETING)

# Which RMSNorm comes before the rotation (Variant.NORM).
NO_NORM = tl.constexpr(0)
NORM_OVER_HEAD = tl.constexpr(1)         # over each head's d channels (Qwen3, Gemma 3); weight [d]
NORM_OVER_TOKEN = tl.constexpr(2)        # over all heads of a token (OLMo 2); weight [h * d]



# The kernels' arguments, grouped. Triton passes tuples (NamedTuples too) into a kernel and
# specializes every element as it does a plain parameter: a pointer on its 16-byte alignment,
# an integer on == 1 and on divisibility by 16 (a stride of 1 becomes a constant, which makes
# channel access contiguous). `do_not_specialize` reaches only plain parameters, so the sizes
# that change with every input (token counts, batch, context-parallel rank) stay plain
# parameters: a new length then never compiles a new kernel. Only a batch of one compiles a
# variant of its own, once (`Variant.BATCH_OF_ONE`).


class View(NamedTuple):
    """A tensor as the kernels address it: data pointer and element strides, (seq, batch,
    head, channel); the query heads of packed QKV have (seq, batch, kv group, head in group,
    channel)."""
    ptr: object
    strides: tuple


class InOut(NamedTuple):
    """What a fused-QKV tile reads and where it writes: the packed tensor's part and the
    separate tensor (forward), or the other way round (backward)."""
    src: View
    dst: View


class Angles(NamedTuple):
    """Where the angles come from (which of the two: Variant.ANGLES_FROM_POSITIONS)."""
    freqs: object      # the table [rows, 1, 1, d2] (float32), or inv_freq [d2/2] (float32)
    strides: tuple     # the table's (row, channel) element strides; (0, 0) for inv_freq
    rows: int          # the table's positions (0 for inv_freq); outside them a rotation is NaN
    pair_axis: object  # M-RoPE: int32 [d2/2], the position axis of each pair; else None
    n_axes: int        # position axes: 1, or M-RoPE's sections
    scale: float       # multiplies cos and sin (YaRN's attention factor)


class Positions(NamedTuple):
    """Where the tokens' positions come from (which: Variant.POSITIONS_FROM)."""
    positions: object        # int [s], [b, s] or [t] (M-RoPE: [n_axes, ...]), or None
    strides: tuple           # positions' (axis, seq, batch) element strides
    start_positions: object  # int [b] or None
    cu_seqlens: object       # int [b + 1] (thd) or None


class HeadShape(NamedTuple):
    nheads: int
    head_dim: int      # d
    rotary_dim: int    # d2: channels 0..d2 are rotated, d2..d copied


class QKVShape(NamedTuple):
    kv_heads: int
    q_per_kv: int      # query heads per kv head
    head_dim: int      # d, of q and k
    rotary_dim: int
    v_dim: int
    q_programs: int    # head programs of a token block that rotate query heads


class QKShape(NamedTuple):
    q_heads: int
    k_heads: int
    head_dim: int      # d, of q and k
    rotary_dim: int
    head_programs: int  # without norms: programs per token block, each BLOCK_H query and
    #                     BLOCK_KV key heads
    q_programs: int     # with norms: the grid's first q_programs programs are q's, the rest k's


class Tokens(NamedTuple):
    """The token layout, built in the kernel from its unspecialized parameters."""
    num_tokens: int    # rows of [h, d]
    seq_len: int       # s (sbhd/bshd); t (thd)
    batch: int         # b (sbhd/bshd); sequences in cu_seqlens (thd)
    cp_size: int       # context parallelism (TE's load-balanced split)
    cp_rank: int


class Norm(NamedTuple):
    """The RMSNorm before the rotation (which: Variant.NORM); None in its place without one."""
    weight: object     # [d] or [h * d], any floating dtype, read in the compute dtype
    eps: float
    offset: float      # added to the weight: 1.0 for Gemma's (1 + weight)
    x: View            # backward: the norm's input (the forward's t); forward: None
    partial: object    # backward: [programs, weight size] partial sums of dL/dweight; forward: None
    rstd: object       # each row's 1 / sqrt(mean(x^2) + eps), in the compute dtype, [num_tokens,
    #                    nheads] (over each head) or [num_tokens] (over the token), where
    #                    Variant.SAVED_RSTD, else None


class Variant(NamedTuple):
    """The compile-time choices of a kernel (one `tl.constexpr` argument): each field
    changes the generated code."""
    BLOCK_T: int                # tokens per program
    BLOCK_H: int                # heads per program (fused QKV: query heads)
    BLOCK_HALF: int             # power of two >= rotary_dim // 2
    BLOCK_PASS: int             # power of two >= head_dim - rotary_dim; 0: leave them (in place)
    INTERLEAVED: bool           # pairs are (2k, 2k + 1), else (k, k + d2/2)
    BACKWARD: bool              # rotate by the transpose (the gradient)
    SEQ_MAJOR: bool             # token index is seq-major (sbhd) or batch-major (bshd)
    HAS_START: bool             # start_positions moves each sequence
    WIDE_INNER: bool            # offsets inside one token may exceed int32 (exotic strides)
    ANGLES_FROM_POSITIONS: bool  # angles = position * inv_freq, else read from the table
    POSITIONS_FROM: int         # IMPLICIT_POSITIONS, POSITIONS_TENSOR, AXIS_POSITIONS_TENSOR
    FLAT_GRID: bool             # head and token blocks share grid axis 0 (launcher: _program_grid)
    IS_THD: bool = False        # tokens [t, h, d]; sequences from cu_seqlens or positions
    SEARCH_LEVELS: int = 0      # thd: steps of the search over cu_seqlens (launcher: _search_levels)
    SEARCH_GUESS: bool = False  # thd: read a window of cu_seqlens where lengths would put the
    #                             tile before searching it (`_guessed_sequences`)
    BLOCK_KV: int = 0           # fused QKV, q and k together: key (and value) heads per program
    BLOCK_V: int = 0            # fused QKV: power of two >= v_dim
    INVERSE: bool = False       # rotate by the negated angles (see the module docstring)
    NORM: int = 0               # NO_NORM, NORM_OVER_HEAD, NORM_OVER_TOKEN
    PIPELINE_STAGES: int = 0    # norm backward: token loop software-pipelined this deep
    NORM_AFTER_ANGLES: bool = False  # norm forward: normalize after the angles are worked out
    SAVED_RSTD: bool = False    # norm: the forward writes each row's rstd to Norm.rstd, the
    #                             backward reads it there instead of working it out again
    LAUNCH_DEPENDENTS: bool = False  # the next launch may start once every program has begun
    WAITS_FOR_PREVIOUS: bool = False  # launched early (PDL): its programs end after the launch
    #                                   before it (launcher: _overlapped)
    BATCH_OF_ONE: bool = False  # sbhd or bshd of batch 1: a token's index is its sequence index
    CONTEXT_PARALLEL: bool = False  # cp_size > 1: positions of TE's load-balanced split
    SEARCH_ONE_SEQUENCE: bool = False  # thd: a tile inside its first token's sequence takes it
    #                                    without a search (`_tile_in_one_sequence`)
    SEARCH_WINDOW_FIRST: bool = False  # thd, with both above: that sequence from the guessed
    #                                    window, not from the checked guess (`_tile_sequences`)


class TileInputs(NamedTuple):
    """What a tile loaded (`_tile_inputs`), for its rotation and stores (`_rotate_and_store`):
    in the compute dtype, [T, H, K]; 0 in place of what the Variant does without."""
    x1: object         # the pairs' members (the forward's normalized and weighted, with a norm
    #                    normalized first; as loaded, in t's dtype, with NORM_AFTER_ANGLES)
    x2: object
    x_pass: object     # the channels past rotary_dim (with a norm, or BLOCK_PASS > 0)
    n1: object         # the backward of a norm: the norm's input, the same channels
    n2: object
    n_pass: object
    w1: object         # with a norm: its weights plus offset, broadcast against the channels
    #                    (as stored, without the offset, with NORM_AFTER_ANGLES)
    w2: object
    w_pass: object
    width: object      # with a norm: the channels it covers (`_norm_width`)
    rstd_rows: object  # with SAVED_RSTD: pointers to the tile's rows in Norm.rstd (`_rstd_rows`)
    rstd_ok: object    # and which of them are real
    rstd: object       # the backward of a norm with SAVED_RSTD: the forward's rstd, as loaded
    mask: object       # the pairs' lanes that are real
    mask_p: object     # the pass channels' lanes that are real
    offs: object       # the pairs' channels (`_pair_channels`)
    offs_p: object     # the pass channels (`_pass_channels`)
    out_base: object   # pointers [T, H, 1] to channel 0 of each output row
    out_dim: object    # the output's channel stride
    half: object       # rotary_dim // 2


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "cp_size", "cp_rank"])
def rotary_kernel(x, out, angles, positions, shape, norm, num_tokens, seq_len, batch, cp_size,
                  cp_rank, cfg: tl.constexpr):
    """RoPE of x (View) into out (View; out == x in place), angles from `angles` (Angles) at
    the positions `positions` (Positions) gives, `shape` a HeadShape, `norm` a Norm (or None),
    `cfg` a Variant. A program rotates a tile of BLOCK_T tokens x BLOCK_H heads; the backward
    of a norm, every token_programs-th tile from its own on (`_norm_backward_tiles`)."""
    if cfg.LAUNCH_DEPENDENTS and _GRID_DEPENDENCY_CONTROL:
        gdc_launch_dependents()
    x, out = _typed_view(x), _typed_view(out)
    if cfg.NORM != NO_NORM and cfg.BACKWARD:
        norm = _typed_norm(norm, cfg)
    head_programs = tl.cdiv(shape.nheads, cfg.BLOCK_H)
    tok_block, head_block = _program_block(head_programs, cfg.FLAT_GRID)
    _tensor_program(tok_block, head_block, head_programs, _token_programs(head_programs, cfg), x,
                    out, angles, positions, shape, norm,
                    Tokens(num_tokens, seq_len, batch, cp_size, cp_rank), cfg)
    if cfg.WAITS_FOR_PREVIOUS and _GRID_DEPENDENCY_CONTROL:
        # It reads nothing the launch before it writes: it waits only to end after it, so that
        # what the stream runs next finds both done.
        gdc_wait()


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "cp_size", "cp_rank"])
def rotary_qkv_kernel(q, k, v, q_angles, k_angles, positions, shape, q_norm, k_norm, num_tokens,
                      seq_len, batch, cp_size, cp_rank, cfg: tl.constexpr):
    """Fused QKV: one launch for q, k and v (each an InOut), `shape` a QKVShape, q_norm and
    k_norm the per-head norms of q and k (Norm, or None). The head programs of a token block
    first cover the query heads (kv_heads * q_per_kv, rotated with q_angles), then the key
    heads (k_angles), each with its value heads copied through."""
    NORM_BACKWARD: tl.constexpr = cfg.NORM != NO_NORM and cfg.BACKWARD
    q, k, v = _typed_in_out(q), _typed_in_out(k), _typed_in_out(v)
    if NORM_BACKWARD:
        q_norm, k_norm = _typed_norm(q_norm, cfg), _typed_norm(k_norm, cfg)
    k_programs = tl.cdiv(shape.kv_heads, cfg.BLOCK_KV)
    tok_block, pid_h = _program_block(shape.q_programs + k_programs, cfg.FLAT_GRID)
    tokens = Tokens(num_tokens, seq_len, batch, cp_size, cp_rank)
    if pid_h < shape.q_programs:
        q_heads = pid_h * cfg.BLOCK_H + tl.arange(0, cfg.BLOCK_H)
        q_shape = HeadShape(shape.kv_heads * shape.q_per_kv, shape.head_dim, shape.rotary_dim)
        if NORM_BACKWARD:
            dwq1, dwq2, dwq_pass = _norm_backward_tiles(
                tok_block, _token_programs(shape.q_programs + k_programs, cfg), q.src, q.dst,
                None, q_heads, shape.q_per_kv, q_shape, 0, tokens, q_angles, positions, q_norm,
                cfg)
            _store_dw(q_norm, tok_block * shape.q_programs + pid_h, q_heads, q_shape, dwq1, dwq2,
                      dwq_pass, cfg)
        else:
            _rope_tile(tok_block, q.src, q.dst, q_heads, shape.q_per_kv, q_shape, tokens,
                       q_angles, positions, q_norm, cfg)
    else:
        k_program = pid_h - shape.q_programs
        k_heads = k_program * cfg.BLOCK_KV + tl.arange(0, cfg.BLOCK_KV)
        k_shape = HeadShape(shape.kv_heads, shape.head_dim, shape.rotary_dim)
        if NORM_BACKWARD:
            dwk1, dwk2, dwk_pass = _norm_backward_tiles(
                tok_block, _token_programs(shape.q_programs + k_programs, cfg), k.src, k.dst, v,
                k_heads, 1, k_shape, shape.v_dim, tokens, k_angles, positions, k_norm, cfg)
            _store_dw(k_norm, tok_block * k_programs + k_program, k_heads, k_shape, dwk1, dwk2,
                      dwk_pass, cfg)
        else:
            _kv_tile(tok_block, k.src, k.dst, v, k_heads, k_shape, shape.v_dim, tokens, k_angles,
                     positions, k_norm, cfg)


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "cp_size", "cp_rank"])
def rotary_qk_kernel(q, k, angles, positions, shape, q_norm, k_norm, num_tokens, seq_len, batch,
                     cp_size, cp_rank, cfg: tl.constexpr, k_cfg: tl.constexpr):
    """RoPE of q and k (InOuts) by the same angles, in one launch; `shape` a QKShape; q_norm
    and k_norm the norms of q and k (Norms, or both None).

    Pair tiles (k_cfg None): a program takes BLOCK_H query heads and BLOCK_KV key heads of a
    token block and works their angles out once for both (`_rope_pair_tile`): a token's key
    heads are few (one per 4-8 query heads under GQA, one per rank under tensor parallelism),
    and a tile of key heads alone works out about as many angles as it rotates pairs. Without
    norms always; with them, a forward whose key has one head (the launcher's
    `_norm_pair_tiles` says why).

    Otherwise (norms), the launch is q's rotary_kernel launch (tiles of `cfg`) and k's (tiles
    of `k_cfg`) on one flat grid, q's programs first: each tensor keeps the tiles of its own
    call (a key tile sized to share the query's tokens would be a quarter of one), and the
    launch saves one launch and its tail per step."""
    q, k = _typed_in_out(q), _typed_in_out(k)
    tokens = Tokens(num_tokens, seq_len, batch, cp_size, cp_rank)
    q_shape = HeadShape(shape.q_heads, shape.head_dim, shape.rotary_dim)
    k_shape = HeadShape(shape.k_heads, shape.head_dim, shape.rotary_dim)
    if k_cfg is None:
        tok_block, head_program = _program_block(shape.head_programs, cfg.FLAT_GRID)
        q_heads = head_program * cfg.BLOCK_H + tl.arange(0, cfg.BLOCK_H)
        k_heads = head_program * cfg.BLOCK_KV + tl.arange(0, cfg.BLOCK_KV)
        _rope_pair_tile(tok_block, q, k, q_heads, k_heads, q_shape, k_shape, tokens, angles,
                        positions, q_norm, k_norm, cfg)
    else:
        if cfg.BACKWARD:
            q_norm, k_norm = _typed_norm(q_norm, cfg), _typed_norm(k_norm, k_cfg)
        pid = tl.program_id(0)
        if pid < shape.q_programs:
            _flat_program(pid, shape.q_programs, q.src, q.dst, angles, positions, q_shape, q_norm,
                          tokens, cfg)
        else:
            _flat_program(pid - shape.q_programs, tl.num_programs(0) - shape.q_programs, k.src,
                          k.dst, angles, positions, k_shape, k_norm, tokens, k_cfg)


@triton.jit
def _tensor_program(tok_block, head_block, head_programs, token_programs, x, out, angles,
                    positions, shape, norm, tokens, cfg: tl.constexpr):
    """A program of a rotary_kernel launch of head_programs programs per token block: the
    tile of token block tok_block and head block head_block; the backward of a norm, that of
    every token_programs-th token block from tok_block on (`_norm_backward_tiles`), and its
    row of dL/dweight's partial sums."""
    heads = head_block * cfg.BLOCK_H + tl.arange(0, cfg.BLOCK_H)
    if cfg.NORM != NO_NORM and cfg.BACKWARD:
        dw1, dw2, dw_pass = _norm_backward_tiles(
            tok_block, token_programs, x, out, None, heads, 1, shape, 0, tokens, angles,
            positions, norm, cfg)
        _store_dw(norm, tok_block * head_programs + head_block, heads, shape, dw1, dw2, dw_pass,
                  cfg)
    else:
        _rope_tile(tok_block, x, out, heads, 1, shape, tokens, angles, positions, norm, cfg)


@triton.jit
def _flat_program(pid, programs, x, out, angles, positions, shape, norm, tokens,
                  cfg: tl.constexpr):
    """Program `pid` of a rotary_kernel launch of `programs` programs on a flat grid (a token
    block's head programs adjacent, as `_program_block` numbers them)."""
    head_programs = tl.cdiv(shape.nheads, cfg.BLOCK_H)
    tok_block = pid // head_programs
    _tensor_program(tok_block, pid - tok_block * head_programs, head_programs,
                    programs // head_programs, x, out, angles, positions, shape, norm, tokens, cfg)


# WORKAROUND(Triton 3.5.1, the NVIDIA container 25.12's; 3.6 and later need none): a kernel's
# tuple arguments keep types from before Triton put in the constants it specializes (strides
# of 1), and a tuple is copied from its type at every runtime `if` and loop; the strides of a
# View inside another tuple (k.src.strides[3]), or two strides of 1 in one View, then come out
# None. A tuple built in the kernel takes its type from its values, so the kernels rebuild
# every View they are given (a forward's Norm holds none). Under 3.5.1,
# test_every_planned_launch_compiles_for_sm90 fails without it.
@triton.jit
def _typed_in_out(io):
    return InOut(_typed_view(io.src), _typed_view(io.dst))


@triton.jit
def _typed_norm(norm, cfg: tl.constexpr):
    rstd = 0                  # unread without SAVED_RSTD (a tuple built here holds no None)
    if cfg.SAVED_RSTD:
        rstd = norm.rstd
    return Norm(norm.weight, norm.eps, norm.offset, _typed_view(norm.x), norm.partial, rstd)


@triton.jit
def _typed_view(view):
    return View(view.ptr, view.strides)


@triton.constexpr_function
def _compute_dtype(dtype):
    """The arithmetic's dtype for data of `dtype`: float64 for float64 (so that `gradcheck`
    can run through the kernel), else float32."""
    return tl.float64 if dtype == tl.float64 else tl.float32


class PositionsTile(NamedTuple):
    """The compile-time choices of sequence_positions_kernel (its `cfg`), as Variant names
    them."""
    BLOCK_T: int
    HAS_START: bool
    SEARCH_LEVELS: int
    IS_THD: bool = True
    SEARCH_GUESS: bool = False  # off: the pre-pass never reads the guessed window (not measured there)
    CONTEXT_PARALLEL: bool = False  # as Variant's
    SEARCH_ONE_SEQUENCE: bool = False  # off: its tiles of SEQUENCE_POSITIONS_BLOCK tokens
    #                                    would seldom lie inside one sequence (neither counted
    #                                    nor measured)
    SEARCH_WINDOW_FIRST: bool = False  # off, with SEARCH_ONE_SEQUENCE


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "cp_size", "cp_rank"])
def sequence_positions_kernel(positions, out, num_tokens, seq_len, batch, cp_size, cp_rank,
                              cfg: tl.constexpr):
    """The implicit position of each thd token (`_implicit_positions`: its index in its
    sequence of cu_seqlens, moved by context parallelism and start_positions) into out (int64
    [num_tokens]), OUTSIDE_SEQUENCES for a token in no sequence: a pre-pass that lets a
    rotary_kernel launch read positions (SEQUENCE_POSITIONS) instead of searching cu_seqlens
    in every tile. A program does BLOCK_T tokens."""
    first_tok = tl.program_id(0) * cfg.BLOCK_T
    tok = first_tok + tl.arange(0, cfg.BLOCK_T)
    tok_ok = tok < num_tokens
    tok = tl.minimum(tok, num_tokens - 1)
    tokens = Tokens(num_tokens, seq_len, batch, cp_size, cp_rank)
    in_seq, pos = _implicit_positions(positions, tok, first_tok, tok, tok * 0, tokens, cfg)
    tl.store(out + tok, tl.where(in_seq, pos, OUTSIDE_SEQUENCES), mask=tok_ok)


class WeightGradientTile(NamedTuple):
    """The compile-time tile of weight_gradient_kernel (its `cfg`)."""
    BLOCK_ROWS: int    # rows of partial sums added per step
    BLOCK_W: int       # weight elements (columns) per program


@triton.jit
def weight_gradient_kernel(partial, dw, second_dw, rows, width, second_rows, cfg: tl.constexpr):
    """dL/dweight, the second pass: dw[j] = sum over i of partial[i, j] (partial [rows,
    width], contiguous, one row per program of the backward), its rows added in the same
    order whatever order the backward's programs ran in, then rounded once to dw's dtype.
    A program sums BLOCK_W columns. With a second weight of the same width (grid axis 1 of
    2: q's and k's norms), its second_rows partial sums follow the first's rows and its
    gradient goes to second_dw (a tensor of its own: the gradients must not alias)."""
    BLOCK_ROWS: tl.constexpr = cfg.BLOCK_ROWS
    BLOCK_W: tl.constexpr = cfg.BLOCK_W
    weight = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    cols_ok = cols < width
    sums = tl.zeros([BLOCK_ROWS, BLOCK_W], partial.dtype.element_ty)
    start = weight * rows
    count = rows + weight * (second_rows - rows)
    # The loop's bound is a plain argument: the interpreters of Triton 3.5.1 and 3.6 take no
    # bound that depends on the program id. A step past this weight's rows loads nothing.
    first = 0
    while first < rows + second_rows:
        row = first + tl.arange(0, BLOCK_ROWS)
        sums += tl.load(partial + (start + row).to(tl.int64)[:, None] * width + cols[None, :],
                        mask=(row < count)[:, None] & cols_ok[None, :], other=0.0)
        first += BLOCK_ROWS
    total = tl.sum(sums, axis=0).to(dw.dtype.element_ty)
    weights = cols * 0 + weight           # a block, for a mask of the block's dtype
    tl.store(dw + cols, total, mask=cols_ok & (weights == 0))
    tl.store(second_dw + cols, total, mask=cols_ok & (weights == 1))


@triton.jit
def _norm_backward_tiles(tok_block, token_programs, x, out, v, heads, heads_per_group, shape,
                         v_dim, tokens, angles, positions, norm, cfg: tl.constexpr):
    """The backward of a norm: the tiles of every token_programs-th token block from tok_block
    on (`_rope_tile`'s arguments; with `v` an InOut, key tiles with their values, `_kv_tile`),
    and their dL/dweight summed ([H, K] per member of the pairs and past them).

    With cfg.PIPELINE_STAGES, the loop is software-pipelined: Triton copies the next tiles'
    gradient and norm input into shared memory (cp.async) while this one is worked on, so
    that the loads in flight hold no registers (the registers of the norm's sums leave room
    for two programs of 8 warps per SM, too few to hide the load latency by themselves).
    Triton pipelines only innermost `for` loops, so the tile's angles are shared across its
    threads another way there (`_tile_angles`). Otherwise (and in the interpreter: those of
    Triton 3.5.1 and 3.6 fail on a `range` over tensor bounds) a plain `while` loop."""
    compute_dtype: tl.constexpr = _compute_dtype(x.ptr.dtype.element_ty)
    offs, channels_ok = _pair_channels(shape.rotary_dim, shape.rotary_dim // 2, cfg)
    offs_p = _pass_channels(shape.rotary_dim, cfg)
    # The sums of dL/dweight per token of the tile, as `_rope_tile` returns them, summed over
    # the tokens once, after the loop. Summed over a tile's tokens in every trip, they cross
    # warps wherever the tokens are spread over them (one head per tile): shared memory and
    # barriers in every trip, for no fewer registers. Kernels alone, one head of d 128, 64K
    # tokens, exact angles, in copies of the tensor (artifacts/qknorm/norm_backward_ab_*):
    # H100 2.47 -> 1.85, H200 3.25 -> 2.08 (test_norm_backward_loop_keeps_out_of_shared_memory).
    BLOCK_T: tl.constexpr = cfg.BLOCK_T
    BLOCK_H: tl.constexpr = heads.shape[0]
    BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
    BLOCK_PASS: tl.constexpr = offs_p.shape[0]
    dw1 = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_HALF], compute_dtype)
    dw2 = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_HALF], compute_dtype)
    dw_pass = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_PASS], compute_dtype)
    # Loaded once: inside the loop, the tiles' stores (which might alias the weight or the
    # frequencies, for all the compiler knows) would have every tile load them again.
    weights = _norm_weight(norm, heads, shape, offs, channels_ok, offs_p, compute_dtype, cfg)
    freqs = None
    if cfg.ANGLES_FROM_POSITIONS:
        freqs = _pair_frequencies(angles, positions, shape.rotary_dim, cfg)
    num_blocks = tl.cdiv(tokens.num_tokens, cfg.BLOCK_T)
    if cfg.PIPELINE_STAGES > 0:
        for block in tl.range(tok_block, num_blocks, token_programs,
                              num_stages=cfg.PIPELINE_STAGES):
            d1, d2, d_pass = _tile(block, x, out, v, heads, heads_per_group, shape, v_dim,
                                   tokens, angles, positions, norm, weights, freqs, cfg)
            dw1, dw2, dw_pass = dw1 + d1, dw2 + d2, dw_pass + d_pass
    else:
        block = tok_block
        while block < num_blocks:
            d1, d2, d_pass = _tile(block, x, out, v, heads, heads_per_group, shape, v_dim,
                                   tokens, angles, positions, norm, weights, freqs, cfg)
            dw1, dw2, dw_pass = dw1 + d1, dw2 + d2, dw_pass + d_pass
            block += token_programs
    return tl.sum(dw1, axis=0), tl.sum(dw2, axis=0), tl.sum(dw_pass, axis=0)


@triton.jit
def _tile(tok_block, x, out, v, heads, heads_per_group, shape, v_dim, tokens, angles, positions,
          norm, weights, freqs, cfg: tl.constexpr):
    """`_rope_tile`, or `_kv_tile` where there are values to copy (v an InOut, not None)."""
    if v is None:
        dw = _rope_tile(tok_block, x, out, heads, heads_per_group, shape, tokens, angles,
                        positions, norm, cfg, weights, freqs)
    else:
        dw = _kv_tile(tok_block, x, out, v, heads, shape, v_dim, tokens, angles, positions, norm,
                      cfg, weights, freqs)
    return dw


@triton.jit
def _kv_tile(tok_block, k, k_out, v, k_heads, k_shape, v_dim, tokens, k_angles, positions, k_norm,
             cfg: tl.constexpr, weights=None, freqs=None):
    """Key heads (k into k_out, Views), with the value heads of the same kv heads copied
    alongside (v an InOut): a key tile alone would be a small program (a quarter of a query
    tile under 4:1 GQA). The values are loaded first and stored last, so that their loads
    overlap the key tile's. Returns what `_rope_tile` returns."""
    tok, tok_ok, seq_idx, batch_idx = _program_tokens(tok_block, tokens, cfg)
    v_heads = k_heads
    dims = tl.arange(0, cfg.BLOCK_V)
    if cfg.WIDE_INNER:
        v_heads = v_heads.to(tl.int64)
        dims = dims.to(tl.int64)
    mask_v = (tok_ok[:, None, None] & (v_heads < k_shape.nheads)[None, :, None]
              & (dims < v_dim)[None, None, :])
    v_src = _tile_base(v.src, seq_idx, batch_idx, v_heads * v.src.strides[2])
    values = tl.load(v_src + (dims * v.src.strides[3])[None, None, :], mask=mask_v)
    dw = _rope_tile(tok_block, k, k_out, k_heads, 1, k_shape, tokens, k_angles, positions,
                    k_norm, cfg, weights, freqs)
    v_dst = _tile_base(v.dst, seq_idx, batch_idx, v_heads * v.dst.strides[2])
    tl.store(v_dst + (dims * v.dst.strides[3])[None, None, :], values, mask=mask_v)
    return dw


@triton.jit
def _program_block(head_programs, FLAT_GRID: tl.constexpr):
    """(token block, head program) of this program, `head_programs` per token block: one
    grid axis each, or both on axis 0 with a token block's head programs adjacent
    (`_program_grid`)."""
    if FLAT_GRID:
        tok_block = tl.program_id(0) // head_programs
        head_program = tl.program_id(0) - tok_block * head_programs
    else:
        tok_block = tl.program_id(0)
        head_program = tl.program_id(1)
    return tok_block, head_program


@triton.jit
def _rope_tile(tok_block, x, out, heads, heads_per_group, shape, tokens, angles, positions, norm,
               cfg: tl.constexpr, weights=None, freqs=None):
    """Rotate one tile: the program's BLOCK_T tokens times the given heads.

    All loads of the tile are issued first (`_tile_inputs`), and positions and cos/sin are
    worked out while they are in flight (`_tile_rotation`): RoPE is a copy with a little
    arithmetic, so its speed is how well the load latency is hidden. Head j of a view with 4
    strides sits at j * stride_head; with 5 (the query heads of packed QKV) at
    (j // heads_per_group) * stride_group + (j % heads_per_group) * stride_head.

    With a norm (`cfg.NORM`), the forward normalizes x before rotating it; the backward
    rotates the gradient x back, then takes it through the norm's transpose, reading the
    norm's input from norm.x; `weights` and `freqs`, if given, are the norm's weights as
    `_norm_weight` gives them and the frequencies as `_pair_frequencies` does (else loaded
    here). Returns the tile's dL/dweight per token ([T, H, BLOCK_HALF] for each member of the
    pairs, [T, H, BLOCK_PASS] for the channels past rotary_dim) in the backward of a norm.
    """
    tok, tok_ok, seq_idx, batch_idx = _program_tokens(tok_block, tokens, cfg)
    inputs = _tile_inputs(x, out, heads, heads_per_group, shape, tok, tok_ok, seq_idx,
                          batch_idx, norm, weights, cfg)
    BLOCK_H: tl.constexpr = heads.shape[0]
    rotation = _tile_rotation(angles, positions, tok, tok_block, seq_idx, batch_idx, tokens,
                              shape.rotary_dim, freqs, x.ptr.dtype.element_ty, BLOCK_H > 1, cfg)
    return _rotate_and_store(inputs, rotation, norm, cfg)


@triton.jit
def _rope_pair_tile(tok_block, q, k, q_heads, k_heads, q_shape, k_shape, tokens, angles,
                    positions, q_norm, k_norm, cfg: tl.constexpr):
    """`_rope_tile` (forward only with norms) for a tile of query heads and one of key heads
    (q and k InOuts) of the same tokens, both loaded before the angles, which are worked out
    once for the two."""
    tl.static_assert(cfg.NORM == NO_NORM or not cfg.BACKWARD,
                     "the backward of a norm takes q's and k's own tiles")
    tok, tok_ok, seq_idx, batch_idx = _program_tokens(tok_block, tokens, cfg)
    q_inputs = _tile_inputs(q.src, q.dst, q_heads, 1, q_shape, tok, tok_ok, seq_idx, batch_idx,
                            q_norm, None, cfg)
    k_inputs = _tile_inputs(k.src, k.dst, k_heads, 1, k_shape, tok, tok_ok, seq_idx, batch_idx,
                            k_norm, None, cfg)
    rotation = _tile_rotation(angles, positions, tok, tok_block, seq_idx, batch_idx, tokens,
                              q_shape.rotary_dim, None, q.src.ptr.dtype.element_ty, True, cfg)
    _rotate_and_store(q_inputs, rotation, q_norm, cfg)
    _rotate_and_store(k_inputs, rotation, k_norm, cfg)


@triton.jit
def _tile_inputs(x, out, heads, heads_per_group, shape, tok, tok_ok, seq_idx, batch_idx, norm,
                 weights, cfg: tl.constexpr):
    """A tile's loads, and the forward's norm unless it comes after the angles: a TileInputs."""
    mask_th = tok_ok[:, None, None] & (heads < shape.nheads)[None, :, None]      # [T, H, 1]
    if cfg.WIDE_INNER:
        heads = heads.to(tl.int64)
    x_base = _tile_base(x, seq_idx, batch_idx, _head_offsets(x, heads, heads_per_group))
    out_base = _tile_base(out, seq_idx, batch_idx, _head_offsets(out, heads, heads_per_group))
    x_dim = x.strides[-1]
    compute_dtype: tl.constexpr = _compute_dtype(x.ptr.dtype.element_ty)
    BLOCK_T: tl.constexpr = tok_ok.shape[0]
    BLOCK_H: tl.constexpr = heads.shape[0]
    NORM_BACKWARD: tl.constexpr = cfg.NORM != NO_NORM and cfg.BACKWARD
    NORM_FORWARD: tl.constexpr = cfg.NORM != NO_NORM and not cfg.BACKWARD
    NORM_LATE: tl.constexpr = NORM_FORWARD and cfg.NORM_AFTER_ANGLES
    load_dtype = compute_dtype
    if NORM_LATE:
        # Kept in t's dtype until the norm converts them, after the angles (`_rotate_and_store`).
        load_dtype = x.ptr.dtype.element_ty

    # Loads. Interleaved tiles are loaded contiguously (vectorisable) and split even/odd in
    # registers rather than gathered with stride 2.
    rotary_dim = shape.rotary_dim
    half = rotary_dim // 2
    offs, channels_ok = _pair_channels(rotary_dim, half, cfg)
    mask = mask_th & channels_ok
    if cfg.WIDE_INNER:
        offs = offs.to(tl.int64)
    x1, x2 = _load_pairs(x_base, x_dim, offs, half, mask, load_dtype, cfg)
    x_pass, offs_p, mask_p = 0, 0, 0
    if cfg.BLOCK_PASS > 0:
        # Channels rotary_dim..head_dim are copied through (normalized, with a norm).
        offs_p = _pass_channels(rotary_dim, cfg)
        if cfg.WIDE_INNER:
            offs_p = offs_p.to(tl.int64)
        mask_p = mask_th & (offs_p < shape.head_dim)[None, None, :]
        if cfg.NORM != NO_NORM:
            # The norm's sums need zeros where masked; a plain copy leaves those lanes unset.
            x_pass = tl.load(x_base + offs_p[None, None, :] * x_dim, mask=mask_p, other=0.0)
        else:
            x_pass = tl.load(x_base + offs_p[None, None, :] * x_dim, mask=mask_p)
    elif cfg.NORM != NO_NORM:
        # No channels past rotary_dim: the norm's sums over them see one masked-off channel.
        offs_p = _pass_channels(rotary_dim, cfg)
        mask_p = mask_th & (offs_p < rotary_dim)[None, None, :]
        x_pass = tl.zeros([BLOCK_T, BLOCK_H, 1], load_dtype)
    n1, n2, n_pass = 0, 0, 0
    if NORM_BACKWARD:
        # The norm's input, loaded with the tile so that its loads are in flight together.
        n_base = _tile_base(norm.x, seq_idx, batch_idx,
                            _head_offsets(norm.x, heads, heads_per_group))
        n_dim = norm.x.strides[-1]
        n1, n2 = _load_pairs(n_base, n_dim, offs, half, mask, compute_dtype, cfg)
        n_pass = tl.load(n_base + offs_p[None, None, :] * n_dim, mask=mask_p,
                         other=0.0).to(compute_dtype)
    w1, w2, w_pass, width = 0, 0, 0, 0
    rstd_rows, rstd_ok, rstd = 0, 0, 0
    if cfg.SAVED_RSTD:
        rstd_rows, rstd_ok = _rstd_rows(norm, tok, tok_ok, heads, shape, cfg)
        if NORM_BACKWARD:
            rstd = tl.load(rstd_rows, mask=rstd_ok, other=1.0)
    if cfg.NORM != NO_NORM:
        if weights is not None:
            w1, w2, w_pass = weights
        elif NORM_LATE:
            w1, w2, w_pass = _norm_weight_loads(norm, heads, shape, offs, channels_ok, offs_p,
                                                norm.weight.dtype.element_ty, cfg)
        else:
            w1, w2, w_pass = _norm_weight(norm, heads, shape, offs, channels_ok, offs_p,
                                          compute_dtype, cfg)
        width = _norm_width(shape, cfg)
        if NORM_FORWARD and not NORM_LATE:
            x1, x2, x_pass = _rms_norm(x1, x2, x_pass.to(compute_dtype), w1, w2, w_pass, width,
                                       norm, rstd_rows, rstd_ok, cfg)
    return TileInputs(x1, x2, x_pass, n1, n2, n_pass, w1, w2, w_pass, width, rstd_rows, rstd_ok,
                      rstd, mask, mask_p, offs, offs_p, out_base, out.strides[-1], half)


@triton.jit
def _tile_rotation(angles, positions, tok, tok_block, seq_idx, batch_idx, tokens, rotary_dim,
                   freqs, data_dtype: tl.constexpr, SHARED: tl.constexpr, cfg: tl.constexpr):
    """(in_seq, cos1, cos2, sin_a, sin_b) of a tile's tokens, cos and sin [T, 1, K] as the
    rotation takes them (`_rotate_and_store`), after its loads are issued; data_dtype (the
    tile's) and SHARED as `_tile_angles` has them.

    Where ptxas would move the tile's loads behind what the angles load or wait for, a
    `tl.debug_barrier()` here keeps them ahead (it waits for no load's data); in the other
    tiles it costs time or was not measured, so it goes only where a case below says
    (docs/design.md)."""
    if (cfg.NORM == NORM_OVER_HEAD and cfg.BACKWARD and not cfg.ANGLES_FROM_POSITIONS
            and cfg.PIPELINE_STAGES == 0 and cfg.BLOCK_T == 1):
        # In the token loop of a norm's backward with TE's table, ptxas may schedule a
        # one-token tile's table loads first and their sin/cos before the tile's own loads
        # (Triton 3.6, sm_90, Qwen3's and Gemma 3's tiles of 8 heads with BATCH_OF_ONE; the
        # table loads first under 3.5.1 and 3.9 too): every trip then waits out two load
        # latencies, one after the other. The barrier keeps the tile's loads ahead of the
        # table's. Kernels alone, bf16, 16K tokens, q and k in
        # one call, in copies of q and k, H200 (artifacts/qknorm/norm_backward_load_order_ab_
        # h200.log): Qwen3-8B 1.92 -> 1.78, Qwen3-32B 1.92 -> 1.78, Gemma 3 2.08 -> 1.88.
        # Only here: in every table norm backward it cost TP 8's key (one head, 8 tokens a
        # tile) 35% and OLMo 2's norm over the token 4%, tiles ptxas had ordered well.
        # Not run on the H100.
        tl.debug_barrier()
    elif ((cfg.ANGLES_FROM_POSITIONS or (cfg.INTERLEAVED and cfg.BLOCK_H == 1))
          and cfg.POSITIONS_FROM == IMPLICIT_POSITIONS
          and not cfg.IS_THD and not cfg.CONTEXT_PARALLEL and cfg.NORM == NO_NORM
          and cfg.BLOCK_KV == 0):
        # With positions worked out from the token's index and no context parallelism,
        # nothing but the tile's own index comes before the loads, and ptxas issues the
        # frequencies' load and the tile's first load at once, then the sin/cos that wait for
        # the frequencies, and only then the tile's other loads (Triton 3.6, sm_90: MLA's key
        # in a 4 KiB tile loads at SASS instructions 20, 40 and 74, its first sin at 71; with
        # the barrier its three loads are at 52-55). H200, kernels alone, 16-bit, against the
        # same code without it (artifacts/tiles/context_parallel_ab_h200.log, run 3, GCB -
        # GC): MLA's key +0.012 to +0.016 of copy speed, Llama 3 8B's +0.010 to +0.013, the
        # TP 8 keys +0.005 to +0.011 (all in 4 KiB tiles), quarter rotary's backward +0.024;
        # one row of 72 down by more than 0.005 (-0.007). The one-head keys' 2 KiB tiles
        # (ONE_HEAD_TILE_BYTES) were timed with the barrier only; their loads come before the
        # first sin/cos with or without it (SASS, Triton 3.6). Fused QKV goes without (it
        # costs its tiles 0.003-0.012), and so do q+k pair tiles (BLOCK_KV marks both) and
        # tiles with context parallelism, a norm or given positions (not measured). With TE's
        # table it goes only into interleaved tiles of one head, of which MLA's key is the one
        # measured: +0.004 to +0.014 there in 16 bits, in four runs
        # (one_head_tile_ab_h200.log run 3; artifacts/thd/narrow_tokens_ab_h200.log runs 1-3);
        # in all table tiles it was mixed (down at TP 8's keys, 8 heads and d 256). Not run on
        # the H100.
        tl.debug_barrier()
    if cfg.IS_THD and cfg.POSITIONS_FROM == IMPLICIT_POSITIONS:
        # ptxas issues the loads of the search for the tokens' sequences (a chain of
        # dependent loads) first and the tile's loads only after the whole chain.
        tl.debug_barrier()
    # Positions and cos/sin depend on the token (and pair) only: worked out once for the
    # tile's tokens and shared by its heads.
    in_seq, cos1, cos2, sin1, sin2 = _tile_angles(
        angles, positions, tok, tok_block * cfg.BLOCK_T, seq_idx, batch_idx, tokens, rotary_dim,
        freqs, data_dtype, SHARED, cfg)
    cos1, cos2 = cos1[:, None, :], cos2[:, None, :]
    # out1 = x1*cos1 - x2*sin_a, out2 = x2*cos2 + x1*sin_b (the table in the module docstring).
    if cfg.BACKWARD:
        sin_a, sin_b = sin2[:, None, :], sin1[:, None, :]
    else:
        sin_a, sin_b = sin1[:, None, :], sin2[:, None, :]
    if cfg.BACKWARD != cfg.INVERSE:
        sin_a, sin_b = -sin_a, -sin_b
    return in_seq, cos1, cos2, sin_a, sin_b


@triton.jit
def _rotate_and_store(inputs, rotation, norm, cfg: tl.constexpr):
    """The rest of a tile: the rotation (`_tile_rotation`'s) of `_tile_inputs`' pairs, the
    backward's norm transpose, and the stores. Returns what `_rope_tile` returns."""
    x1, x2, x_pass, mask, mask_p = inputs.x1, inputs.x2, inputs.x_pass, inputs.mask, inputs.mask_p
    out_base, out_dim, offs = inputs.out_base, inputs.out_dim, inputs.offs
    in_seq, cos1, cos2, sin_a, sin_b = rotation
    compute_dtype = cos1.dtype
    NORM_BACKWARD: tl.constexpr = cfg.NORM != NO_NORM and cfg.BACKWARD
    if cfg.NORM != NO_NORM and not cfg.BACKWARD and cfg.NORM_AFTER_ANGLES:
        # The forward's norm, after the angles: its sums wait for the tile's loads, and the
        # angles, worked out first, fill that wait (the launcher's `_norm_after_angles` says
        # where this wins).
        x1, x2, x_pass = x1.to(compute_dtype), x2.to(compute_dtype), x_pass.to(compute_dtype)
        w1 = inputs.w1.to(compute_dtype) + norm.offset
        w2 = inputs.w2.to(compute_dtype) + norm.offset
        w_pass = inputs.w_pass.to(compute_dtype) + norm.offset
        x1, x2, x_pass = _rms_norm(x1, x2, x_pass, w1, w2, w_pass, inputs.width, norm,
                                   inputs.rstd_rows, inputs.rstd_ok, cfg)
    # Explicit fused multiply-adds: left to the compiler, the contraction of a*b - c*d varies
    # with the tile shape, and so would the last bit of a token's result with the batch size.
    out1 = tl.fma(x1, cos1, -(x2 * sin_a))
    out2 = tl.fma(x2, cos2, x1 * sin_b)
    if cfg.IS_THD:
        # Tokens outside every sequence pass through unchanged.
        out1 = tl.where(in_seq[:, None, None], out1, x1)
        out2 = tl.where(in_seq[:, None, None], out2, x2)
    if NORM_BACKWARD:
        # out1, out2 and x_pass: the gradient of the normalized, weighted x.
        out1, out2, x_pass, dw1, dw2, dw_pass = _rms_norm_backward(
            out1, out2, x_pass.to(compute_dtype), inputs.n1, inputs.n2, inputs.n_pass, inputs.w1,
            inputs.w2, inputs.w_pass, inputs.width, norm, inputs.rstd, cfg)
    else:
        dw1, dw2, dw_pass = 0, 0, 0                # nothing to return (one return statement:
                                                   # Triton types every return of a function)

    # `_store_pairs`' layout, written out: as a call, the same instructions come out in another
    # order for some tiles (thd backward), and the benchmarks measured this order.
    out_ty = out_base.dtype.element_ty
    BLOCK_T: tl.constexpr = x1.shape[0]
    BLOCK_H: tl.constexpr = x1.shape[1]
    if cfg.INTERLEAVED:
        result = tl.reshape(tl.join(out1, out2), [BLOCK_T, BLOCK_H, 2 * cfg.BLOCK_HALF])
        tl.store(out_base + offs[None, None, :] * out_dim, result.to(out_ty), mask=mask)
    else:
        out1_ptrs = out_base + offs[None, None, :] * out_dim
        tl.store(out1_ptrs, out1.to(out_ty), mask=mask)
        tl.store(out1_ptrs + inputs.half * out_dim, out2.to(out_ty), mask=mask)
    if cfg.BLOCK_PASS > 0:
        tl.store(out_base + inputs.offs_p[None, None, :] * out_dim, x_pass.to(out_ty),
                 mask=mask_p)
    return dw1, dw2, dw_pass


@triton.jit
def _pair_channels(rotary_dim, half, cfg: tl.constexpr):
    """(offs, channels_ok [1, 1, K]): the channels a tile's pairs are read at (all 2 *
    BLOCK_HALF in order when interleaved; else the first members, the second at + half) and
    which of them are rotated."""
    BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
    if cfg.INTERLEAVED:
        offs = tl.arange(0, 2 * BLOCK_HALF)
        channels_ok = (offs < rotary_dim)[None, None, :]
    else:
        offs = tl.arange(0, BLOCK_HALF)
        channels_ok = (offs < half)[None, None, :]
    return offs, channels_ok


@triton.jit
def _load_pairs(base, dim_stride, offs, half, mask, compute_dtype: tl.constexpr,
                cfg: tl.constexpr):
    """(x1, x2): the two members of each rotated pair of the rows at `base` [A, B, 1], as
    [A, B, BLOCK_HALF] in compute_dtype; `offs` their channels (`_rope_tile`)."""
    if cfg.INTERLEAVED:
        A: tl.constexpr = base.shape[0]
        B: tl.constexpr = base.shape[1]
        BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
        xs = tl.load(base + offs[None, None, :] * dim_stride, mask=mask, other=0.0)
        x1, x2 = tl.split(tl.reshape(xs.to(compute_dtype), [A, B, BLOCK_HALF, 2]))
    else:
        x1_ptrs = base + offs[None, None, :] * dim_stride
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(compute_dtype)
        x2 = tl.load(x1_ptrs + half * dim_stride, mask=mask, other=0.0).to(compute_dtype)
    return x1, x2


@triton.jit
def _store_pairs(base, dim_stride, offs, half, mask, x1, x2, dtype: tl.constexpr,
                 cfg: tl.constexpr):
    """Store both members of each rotated pair [A, B, BLOCK_HALF], as `dtype`, at the rows
    `base` [A, B, 1]: `_load_pairs`' layout (interleaved pairs joined back into one contiguous
    store)."""
    if cfg.INTERLEAVED:
        A: tl.constexpr = x1.shape[0]
        B: tl.constexpr = x1.shape[1]
        BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
        result = tl.reshape(tl.join(x1, x2), [A, B, 2 * BLOCK_HALF])
        tl.store(base + offs[None, None, :] * dim_stride, result.to(dtype), mask=mask)
    else:
        x1_ptrs = base + offs[None, None, :] * dim_stride
        tl.store(x1_ptrs, x1.to(dtype), mask=mask)
        tl.store(x1_ptrs + half * dim_stride, x2.to(dtype), mask=mask)


@triton.jit
def _pass_channels(rotary_dim, cfg: tl.constexpr):
    """The channels past rotary_dim a tile covers: BLOCK_PASS of them, or where there are none,
    one (always masked off) for the sums of a norm."""
    # Not max(): Triton 3.5.1 makes the max of two constants a tensor, which no shape takes.
    # (`_norm_backward_tiles` sizes its sums of dL/dweight by this.)
    BLOCK: tl.constexpr = cfg.BLOCK_PASS if cfg.BLOCK_PASS > 0 else 1
    return rotary_dim + tl.arange(0, BLOCK)


@triton.jit
def _norm_weight(norm, heads, shape, offs, channels_ok, offs_p, compute_dtype: tl.constexpr,
                 cfg: tl.constexpr):
    """(w1, w2, w_pass): the norm's weight plus its offset for the tile's channels, in
    compute_dtype, shaped to broadcast against them (`_norm_weight_loads`)."""
    w1, w2, w_pass = _norm_weight_loads(norm, heads, shape, offs, channels_ok, offs_p,
                                        compute_dtype, cfg)
    return w1 + norm.offset, w2 + norm.offset, w_pass + norm.offset


@triton.jit
def _norm_weight_loads(norm, heads, shape, offs, channels_ok, offs_p, dtype: tl.constexpr,
                       cfg: tl.constexpr):
    """(w1, w2, w_pass): the norm's weight for the tile's channels, read as `dtype`, shaped
    to broadcast against them ([1, 1, K] per head; [1, H, K] per token, where head j's
    weights start at j * head_dim)."""
    base, rows_ok = _weight_rows(norm.weight, heads, shape, cfg)
    w1, w2 = _load_pairs(base, 1, offs, shape.rotary_dim // 2, rows_ok & channels_ok, dtype, cfg)
    w_pass = tl.load(base + offs_p[None, None, :],
                     mask=rows_ok & (offs_p < shape.head_dim)[None, None, :], other=0.0)
    return w1, w2, w_pass.to(dtype)


@triton.jit
def _norm_width(shape, cfg: tl.constexpr):
    """Channels one norm covers (and the weight's size): a head's, or all heads' of a token."""
    width = shape.head_dim
    if cfg.NORM == NORM_OVER_TOKEN:
        width = shape.nheads * shape.head_dim
    return width


@triton.jit
def _weight_rows(ptr, heads, shape, cfg: tl.constexpr):
    """(pointers, which are real) of the weight rows a tile's heads use, in a weight-shaped
    vector at `ptr`: [1, H, 1], head j at j * head_dim, for a per-token norm; [1, 1, 1], the
    one row its heads share, for a per-head norm."""
    if cfg.NORM == NORM_OVER_TOKEN:
        rows, rows_ok = ptr + (heads * shape.head_dim)[None, :, None], (heads < shape.nheads)[None, :, None]
    else:
        rows, rows_ok = ptr + tl.zeros([1, 1, 1], tl.int32), tl.full([1, 1, 1], 1, tl.int1)
    return rows, rows_ok


@triton.jit
def _rms_norm(x1, x2, x_pass, w1, w2, w_pass, width, norm, rstd_rows, rstd_ok,
              cfg: tl.constexpr):
    """The forward's norm: x * rstd * w for both members of the pairs and the channels past
    them (w the weight plus its offset); with SAVED_RSTD, rstd stored to norm.rstd too."""
    rstd = _rstd(x1, x2, x_pass, width, norm.eps, cfg)
    if cfg.SAVED_RSTD:
        tl.store(rstd_rows, rstd, mask=rstd_ok)
    return x1 * rstd * w1, x2 * rstd * w2, x_pass * rstd * w_pass


@triton.jit
def _rstd_rows(norm, tok, tok_ok, heads, shape, cfg: tl.constexpr):
    """(pointers, which are real) of a tile's rows in norm.rstd, shaped as `_rstd`'s result:
    [T, H, 1] for a norm over each head, [T, 1, 1] over the token (a tile holds all of its
    heads)."""
    if cfg.NORM == NORM_OVER_TOKEN:
        rows, rows_ok = norm.rstd + tok.to(tl.int64)[:, None, None], tok_ok[:, None, None]
    else:
        rows = norm.rstd + (tok.to(tl.int64) * shape.nheads)[:, None, None] + heads[None, :, None]
        rows_ok = tok_ok[:, None, None] & (heads < shape.nheads)[None, :, None]
    return rows, rows_ok


@triton.jit
def _rstd(x1, x2, x_pass, width, eps, cfg: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over each head's channels ([T, H, 1]) or each token's
    ([T, 1, 1]); masked-off channels hold 0.

    float32 takes the hardware's reciprocal square root (within 2 ulps), as torch.rsqrt does
    on CUDA and so transformers' RMSNorms there; a correctly rounded sqrt and a division cost
    TP 8's forward tile of q and k (4 + 1 heads of d 128) 112 of its 984 SASS instructions and
    16 of its 96 registers (Triton 3.6, sm_90): the sqrt's slow-path branch and both divisions'
    range checks, for each row a thread holds."""
    squares = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2) + tl.sum(x_pass * x_pass, axis=2)
    if cfg.NORM == NORM_OVER_TOKEN:
        squares = tl.sum(squares, axis=1, keep_dims=True)
    if squares.dtype == tl.float64:
        return (1.0 / tl.sqrt(squares / width + eps))[:, :, None]
    # One fma, not a product and a sum that the compiler contracts or not, kernel by kernel.
    return tl.math.rsqrt(tl.fma(squares, 1.0 / width, eps))[:, :, None]


@triton.jit
def _rms_norm_backward(g1, g2, g_pass, x1, x2, x_pass, w1, w2, w_pass, width, norm, rstd,
                       cfg: tl.constexpr):
    """The norm's transpose: g the gradient of its output (xhat * w), x its input. Returns
    dx (both members of the pairs and the channels past them) and the tile's dL/dweight per
    token: dx = rstd * (g * w - xhat * mean(g * w * xhat)), dw = g * xhat. `rstd` is the
    forward's where it saved it (Variant.SAVED_RSTD), else worked out here again."""
    if not cfg.SAVED_RSTD:
        rstd = _rstd(x1, x2, x_pass, width, norm.eps, cfg)
    xhat1, xhat2, xhat_pass = x1 * rstd, x2 * rstd, x_pass * rstd
    gw1, gw2, gw_pass = g1 * w1, g2 * w2, g_pass * w_pass
    dot = (tl.sum(gw1 * xhat1, axis=2) + tl.sum(gw2 * xhat2, axis=2)
           + tl.sum(gw_pass * xhat_pass, axis=2))
    if cfg.NORM == NORM_OVER_TOKEN:
        dot = tl.sum(dot, axis=1, keep_dims=True)
    mean = (dot / width)[:, :, None]
    dx1 = rstd * (gw1 - xhat1 * mean)
    dx2 = rstd * (gw2 - xhat2 * mean)
    dx_pass = rstd * (gw_pass - xhat_pass * mean)
    return dx1, dx2, dx_pass, g1 * xhat1, g2 * xhat2, g_pass * xhat_pass


@triton.jit
def _token_programs(head_programs, cfg: tl.constexpr):
    """Programs along the tokens: the backward of a norm launches fewer than there are token
    blocks, each looping over every token_programs-th block from its own."""
    if cfg.FLAT_GRID:
        return tl.num_programs(0) // head_programs
    return tl.num_programs(0)


@triton.jit
def _store_dw(norm, row, heads, shape, dw1, dw2, dw_pass, cfg: tl.constexpr):
    """Write a program's dL/dweight ([H, K] per member of the pairs and past them) as row
    `row` of norm.partial: summed over the heads for a per-head norm ([d]), head j at
    j * head_dim for a per-token one ([h * d])."""
    base, rows_ok = _weight_rows(norm.partial + row.to(tl.int64) * _norm_width(shape, cfg), heads,
                                 shape, cfg)
    if cfg.NORM == NORM_OVER_HEAD:
        dw1 = tl.sum(dw1, axis=0, keep_dims=True)
        dw2 = tl.sum(dw2, axis=0, keep_dims=True)
        dw_pass = tl.sum(dw_pass, axis=0, keep_dims=True)
    half = shape.rotary_dim // 2
    offs, channels_ok = _pair_channels(shape.rotary_dim, half, cfg)
    _store_pairs(base, 1, offs, half, rows_ok & channels_ok, dw1[None, :, :], dw2[None, :, :],
                 norm.partial.dtype.element_ty, cfg)
    if cfg.BLOCK_PASS > 0:
        offs_p = _pass_channels(shape.rotary_dim, cfg)
        tl.store(base + offs_p[None, None, :], dw_pass[None, :, :],
                 mask=rows_ok & (offs_p < shape.head_dim)[None, None, :])


@triton.jit
def _head_offsets(view, heads, heads_per_group):
    """Element offsets [H] of the heads inside a token."""
    if len(view.strides) == 5:
        return heads // heads_per_group * view.strides[2] + heads % heads_per_group * view.strides[3]
    return heads * view.strides[2]


@triton.jit
def _program_tokens(tok_block, tokens, cfg: tl.constexpr):
    """The BLOCK_T token indices of token block `tok_block` (clamped into range), which of
    them are real, and their (sequence, batch) indices."""
    tok = tok_block * cfg.BLOCK_T + tl.arange(0, cfg.BLOCK_T)
    tok_ok = tok < tokens.num_tokens
    tok = tl.minimum(tok, tokens.num_tokens - 1)
    seq_idx, batch_idx = _token_coords(tok, tokens, cfg)
    return tok, tok_ok, seq_idx, batch_idx


@triton.jit
def _tile_base(view, seq_idx, batch_idx, head_offset):
    """Pointers [T, H, 1] to channel 0 of each (token, head) of a tile; head_offset [H] holds
    the heads' element offsets inside a token."""
    row = seq_idx.to(tl.int64) * view.strides[0] + batch_idx.to(tl.int64) * view.strides[1]
    return view.ptr + row[:, None, None] + head_offset[None, :, None]


@triton.jit
def _token_coords(tok, tokens, cfg: tl.constexpr):
    """(sequence, batch) index of each token; thd rows are addressed by the token alone."""
    # A batch of one needs no division by the runtime batch or length: it and the index
    # arithmetic after it are a sixth of the SASS instructions of a one-head tile (d 64,
    # Triton 3.6, sm_90: 432 -> 360), and at one or two heads the H200 issues a tile's
    # instructions at about the rate its memory moves the tile's bytes.
    if cfg.IS_THD or cfg.BATCH_OF_ONE:
        return tok, tok * 0
    if cfg.SEQ_MAJOR:
        return tok // tokens.batch, tok % tokens.batch
    return tok % tokens.seq_len, tok // tokens.seq_len


@triton.jit
def _positions(positions, tok, first_tok, seq_idx, batch_idx, tokens, cfg: tl.constexpr):
    """(in_seq, pos): whether each token lies inside a thd sequence (always, otherwise) and
    its position (int64). With axis positions (M-RoPE), `pos` is instead the token's element
    offset in positions, the axis still to be added per pair."""
    in_seq = tok >= 0
    if cfg.POSITIONS_FROM != IMPLICIT_POSITIONS:
        offset = (seq_idx.to(tl.int64) * positions.strides[1]
                  + batch_idx.to(tl.int64) * positions.strides[2])
        if cfg.POSITIONS_FROM == AXIS_POSITIONS_TENSOR:
            pos = offset
        else:
            pos = tl.load(positions.positions + offset).to(tl.int64)
            if cfg.POSITIONS_FROM == SEQUENCE_POSITIONS:
                in_seq = pos != OUTSIDE_SEQUENCES
    else:
        in_seq, pos = _implicit_positions(positions, tok, first_tok, seq_idx, batch_idx, tokens,
                                          cfg)
    return in_seq, pos


@triton.jit
def _implicit_positions(positions, tok, first_tok, seq_idx, batch_idx, tokens, cfg: tl.constexpr):
    """(in_seq, pos) by TE's rules: the token's index in its sequence (int64), moved by context
    parallelism and start_positions; in_seq says whether a thd token lies in a sequence."""
    in_seq = tok >= 0
    num_seqs, cp_rank = tokens.batch, tokens.cp_rank
    # Without context parallelism cp_size is the constant 1: its products, divisions and
    # branch fold away at compile time. Taken at run time they cost every tile instructions
    # even at cp_size 1, for ptxas selects between the branch's results rather than branching
    # (Triton 3.6: 37 of the 220 SASS instructions of an sbhd tile of 2 tokens x 8 heads, 126
    # of the 940 of a thd tile of 4 x 8).
    cp_size = tokens.cp_size if cfg.CONTEXT_PARALLEL else 1
    # int64 from here on: with a long (e.g. expanded) freqs table, start positions and the
    # context-parallel offsets can pass 2^31.
    seq_idx = seq_idx.to(tl.int64)
    local_len = tokens.seq_len.to(tl.int64)
    if cfg.IS_THD:
        # cu_seqlens holds global (padded) offsets; a context-parallel rank holds 1/cp_size of
        # each sequence. The token's sequence is the last i with cu[i] // cp_size <= tok, i.e.
        # cu[i] < (tok + 1) * cp_size (no integer division).
        next_start = (tok.to(tl.int64) + 1) * cp_size
        batch_idx, seq_start, seq_end = _tile_sequences(positions.cu_seqlens, first_tok,
                                                        next_start, num_seqs,
                                                        tokens.num_tokens, cp_size,
                                                        cfg.SEARCH_LEVELS, cfg.SEARCH_GUESS,
                                                        cfg.SEARCH_ONE_SEQUENCE,
                                                        cfg.SEARCH_WINDOW_FIRST)
        seq_start = (seq_start // cp_size).to(tl.int64)
        seq_end = (seq_end // cp_size).to(tl.int64)
        # Tokens outside every sequence: before cu_seqlens[0] or from cu_seqlens[-1] on.
        in_seq = (tok >= seq_start) & (tok < seq_end)
        seq_idx = tok - seq_start
        local_len = seq_end - seq_start
    # Context parallelism (TE's load-balanced split): the global sequence is cut into
    # 2*cp_size chunks and rank r holds chunks r and 2*cp_size-1-r, so the second half of the
    # local tokens jumps ahead.
    pos = seq_idx
    if cp_size > 1:
        half_len = local_len // 2
        pos = tl.where(seq_idx < half_len, seq_idx + cp_rank * half_len,
                       seq_idx + cp_size * local_len - (cp_rank + 2) * half_len)
    if cfg.HAS_START:
        start = tl.load(positions.start_positions + tl.minimum(batch_idx, num_seqs - 1))
        pos = pos + start.to(tl.int64)
    return in_seq, pos

# thd, the search of cu_seqlens for the tokens' sequences (`_tile_sequences`): the ways one
# step of a single token's search splits its range into; the same for the search of a tile's
# first token, done once by the whole program (TILE_FAN = SEARCH_FAN ** 2, so one of its
# steps does two of the other's); and the entries after the first token's sequence read for
# the tile's other tokens.
SEARCH_FAN = tl.constexpr(4)
TILE_FAN = tl.constexpr(16)
TILE_SCAN = tl.constexpr(8)
# The window `_guessed_sequences` reads: GUESS_WINDOW entries of cu_seqlens from GUESS_BEFORE
# before the guessed sequence.
GUESS_WINDOW = tl.constexpr(32)
GUESS_BEFORE = tl.constexpr(8)


@triton.jit
def _tile_sequences(cu_seqlens, first_tok, next_start, num_seqs, num_tokens, cp_size,
                    SEARCH_LEVELS: tl.constexpr, SEARCH_GUESS: tl.constexpr,
                    ONE_SEQUENCE: tl.constexpr, WINDOW_FIRST: tl.constexpr):
    """(sequence index, cu[index], cu[index + 1]) of each of a tile's consecutive tokens: the
    last i in [0, num_seqs] with cu[i] < next_start (0 when there is none).

    With ONE_SEQUENCE, a tile that lies inside its first token's sequence
    (`_tile_in_one_sequence`) takes that sequence for every token and compares none of them
    with cu_seqlens. The first token's sequence comes from the checked guess, two scalar loads
    that find it where lengths are uniform; with WINDOW_FIRST (and SEARCH_GUESS) from the
    guessed window, one vector load that finds it wherever the guess is off by fewer
    sequences than the window holds, and serves the tile's tokens on a miss. The other tiles,
    and every tile without ONE_SEQUENCE, take `_guessed_or_searched_sequences`."""
    tl.static_assert(not WINDOW_FIRST or (ONE_SEQUENCE and SEARCH_GUESS),
                     "WINDOW_FIRST takes ONE_SEQUENCE and SEARCH_GUESS")
    if ONE_SEQUENCE:
        first_next = (first_tok + 1).to(tl.int64) * cp_size
        window = None
        if WINDOW_FIRST:
            window = _guess_window(cu_seqlens, first_tok, num_seqs, num_tokens)
            hit, g, g_start, g_end = _window_first_sequence(window, first_next, num_seqs)
        else:
            hit, g, g_start, g_end = _checked_sequence_guess(cu_seqlens, first_tok, first_next,
                                                             num_seqs, num_tokens)
        seq = tl.zeros(next_start.shape, tl.int32) + g
        seq_start = tl.zeros(next_start.shape, g_start.dtype) + g_start
        seq_end = tl.zeros(next_start.shape, g_end.dtype) + g_end
        if _tile_in_one_sequence(hit, g_end, first_tok, num_tokens, cp_size,
                                 next_start.shape[0]) == 0:
            seq, seq_start, seq_end = _guessed_or_searched_sequences(
                cu_seqlens, first_tok, next_start, num_seqs, num_tokens, cp_size, SEARCH_LEVELS,
                SEARCH_GUESS, window)
    else:
        seq, seq_start, seq_end = _guessed_or_searched_sequences(
            cu_seqlens, first_tok, next_start, num_seqs, num_tokens, cp_size, SEARCH_LEVELS,
            SEARCH_GUESS)
    return seq, seq_start, seq_end


@triton.jit
def _tile_in_one_sequence(hit, g_end, first_tok, num_tokens, cp_size, BLOCK_T: tl.constexpr):
    """1 (int32) where every real token of the tile of BLOCK_T tokens from first_tok lies in
    the first token's sequence g that `_checked_sequence_guess` or `_window_first_sequence`
    found (hit, so cu[g] < (first_tok + 1) * cp_size): the tile's last real token t has
    (t + 1) * cp_size <= g_end = cu[g + 1], so that g is the last i with cu[i] < next_start
    for every token between (cu_seqlens is non-decreasing); else 0. The real tokens end before
    min(first_tok + BLOCK_T, num_tokens), and a clamped token repeats the last. Scalars only:
    no per-token work, where the guessed window (`_window_sequences`) compares every token
    with GUESS_WINDOW entries."""
    last_next = tl.minimum(first_tok + BLOCK_T, num_tokens).to(tl.int64) * cp_size
    return hit & (g_end >= last_next).to(tl.int32)


@triton.jit
def _guessed_or_searched_sequences(cu_seqlens, first_tok, next_start, num_seqs, num_tokens,
                                   cp_size, SEARCH_LEVELS: tl.constexpr,
                                   SEARCH_GUESS: tl.constexpr, window=None):
    """`_tile_sequences`' answer for any tile: with SEARCH_GUESS, from one load where
    `_window_sequences` finds them all in the guessed window (`window`, `_guess_window`'s
    result where the caller loaded it already), else (and without it) by
    `_searched_sequences`."""
    if SEARCH_GUESS:
        if window is None:
            window = _guess_window(cu_seqlens, first_tok, num_seqs, num_tokens)
        found, seq, seq_start, seq_end = _window_sequences(window, next_start, num_seqs)
        if found == 0:
            seq, seq_start, seq_end = _searched_sequences(cu_seqlens, first_tok, next_start,
                                                          num_seqs, num_tokens, cp_size,
                                                          SEARCH_LEVELS)
    else:
        seq, seq_start, seq_end = _searched_sequences(cu_seqlens, first_tok, next_start,
                                                      num_seqs, num_tokens, cp_size,
                                                      SEARCH_LEVELS)
    return seq, seq_start, seq_end


@triton.jit
def _guessed_sequences(cu_seqlens, first_tok, next_start, num_seqs, num_tokens):
    """(found, sequence index, cu[index], cu[index + 1]) of each of a tile's tokens as
    `_tile_sequences` gives them, from one vector load: `_window_sequences` of
    `_guess_window`."""
    return _window_sequences(_guess_window(cu_seqlens, first_tok, num_seqs, num_tokens),
                             next_start, num_seqs)


@triton.jit
def _guess_window(cu_seqlens, first_tok, num_seqs, num_tokens):
    """(lo, hi, entry): the GUESS_WINDOW entries entry[j] = cu[min(lo + j, num_seqs)] of
    cu_seqlens from lo, GUESS_BEFORE before first_tok * num_seqs / num_tokens (the first
    token's sequence were all sequences of one length), kept inside [0, num_seqs]; hi =
    min(lo + GUESS_WINDOW - 1, num_seqs), the last entry inside cu_seqlens. Past num_seqs the
    entries repeat cu[num_seqs], so entry j + 1 is still the end of the last sequence."""
    j = tl.arange(0, GUESS_WINDOW)
    guess = first_tok.to(tl.int64) * num_seqs // num_tokens
    lo = tl.maximum(tl.minimum(guess - GUESS_BEFORE, num_seqs - (GUESS_WINDOW - 1)), 0)
    hi = tl.minimum(lo + (GUESS_WINDOW - 1), num_seqs)
    entry = tl.load(cu_seqlens + tl.minimum(lo + j, num_seqs), eviction_policy="evict_last")
    return lo, hi, entry


@triton.jit
def _window_sequences(window, next_start, num_seqs):
    """(found, sequence index, cu[index], cu[index + 1]) of each of a tile's tokens as
    `_tile_sequences` gives them, from the guessed window (`_guess_window`). found (int32, 0
    or 1): every token's index and both its entries lie in the window, so the rest is its
    answer (always with fewer than GUESS_WINDOW sequences, and with sequences of one length
    where a tile spans at most GUESS_WINDOW - GUESS_BEFORE - 1 = 23 of them); where 0, the rest
    is not to be used. A token's index is lo + (entries of the window below next_start) - 1:
    known where the window holds an entry below it (or starts at 0) and one not below it (or
    ends at num_seqs)."""
    lo, hi, entry = window
    j = tl.arange(0, GUESS_WINDOW)
    below = tl.sum(((lo + j <= hi)[None, :] & (entry[None, :] < next_start[:, None])
                    ).to(tl.int32), axis=1)
    known = ((below > 0) | (lo == 0)) & ((lo + below <= hi) | (hi == num_seqs))
    at = tl.maximum(below - 1, 0)                    # the token's index, less lo
    seq_start = tl.sum(tl.where(j[None, :] == at[:, None], entry[None, :], 0), axis=1)
    end_at = tl.minimum(at + 1, GUESS_WINDOW - 1)
    seq_end = tl.sum(tl.where(j[None, :] == end_at[:, None], entry[None, :], 0), axis=1)
    found = tl.min(known.to(tl.int32), axis=0)
    return found, (lo + at).to(tl.int32), seq_start, seq_end


@triton.jit
def _window_first_sequence(window, first_next, num_seqs):
    """(hit, g, cu[g], cu[g + 1]) of the tile's first token (first_next: its next_start) from
    the guessed window, by `_window_sequences`' rule for that one token: scalars, where the
    per-token rule compares every token with every entry. hit (int32, 0 or 1), as the checked
    guess's: cu[g] < first_next, and g and both its entries lie in the window (a token before
    cu[0] is no hit); `_tile_in_one_sequence` then tells whether the whole tile lies in g."""
    lo, hi, entry = window
    j = tl.arange(0, GUESS_WINDOW)
    below = tl.sum(((lo + j <= hi) & (entry < first_next)).to(tl.int32), axis=0)
    known = (below > 0) & ((lo + below <= hi) | (hi == num_seqs))
    at = tl.maximum(below - 1, 0)
    g_start = tl.sum(tl.where(j == at, entry, 0), axis=0)
    g_end = tl.sum(tl.where(j == tl.minimum(at + 1, GUESS_WINDOW - 1), entry, 0), axis=0)
    return known.to(tl.int32), (lo + at).to(tl.int32), g_start, g_end


@triton.jit
def _searched_sequences(cu_seqlens, first_tok, next_start, num_seqs, num_tokens, cp_size,
                        SEARCH_LEVELS: tl.constexpr):
    """`_tile_sequences`' answer by search.

    The tile's first token's sequence is guessed and checked (`_checked_sequence_guess`), or
    where the check fails searched once for the whole program (uniform loads, one vector of
    cu_seqlens per step); the others lie in the TILE_SCAN - 1 sequences after it, read as
    one vector, unless the tile crosses TILE_SCAN - 2 sequence ends or more (many empty or
    very short sequences): then each token is searched on its own (`_token_sequences`).
    cu_seqlens is non-decreasing; were it not, every index is still in [0, num_seqs] (a
    wrong but in-bounds sequence), never a read outside it. Its entries are loaded
    evict_last: every program reads them, between streaming loads of the tile that would
    push them out."""
    first_next = (first_tok + 1).to(tl.int64) * cp_size
    # On one H200 the checked guess gains 0.004-0.011 of copy speed at packed batches of one
    # length (0.947-0.960 without it; positions path, 16-bit) and moves no other models point
    # by more than 0.006 (artifacts/tiles/context_parallel_ab_h200.log, run 2).
    hit, first, _, _ = _checked_sequence_guess(cu_seqlens, first_tok, first_next, num_seqs,
                                               num_tokens)
    if hit == 0:
        first = _first_sequence(cu_seqlens, first_next, num_seqs, SEARCH_LEVELS)
    j = tl.arange(0, TILE_SCAN)
    # cu[first + j], clamped to cu[num_seqs] past the end: entry j + 1 is then the end of
    # sequence first + j, as for the last sequence.
    entry = tl.load(cu_seqlens + tl.minimum(first + j, num_seqs), eviction_policy="evict_last")
    counted = (j > 0) & (first + j <= num_seqs)
    ahead = tl.sum((counted[None, :] & (entry[None, :] < next_start[:, None])).to(tl.int32),
                   axis=1)
    if tl.max(ahead, axis=0) < TILE_SCAN - 1:
        seq = first + ahead
        # entries ahead and ahead + 1 of the vector, picked in registers
        seq_start = tl.sum(tl.where(j[None, :] == ahead[:, None], entry[None, :], 0), axis=1)
        seq_end = tl.sum(tl.where(j[None, :] == ahead[:, None] + 1, entry[None, :], 0), axis=1)
    else:
        seq = _token_sequences(cu_seqlens, next_start, num_seqs, SEARCH_LEVELS)
        seq_start = tl.load(cu_seqlens + seq, eviction_policy="evict_last")
        seq_end = tl.load(cu_seqlens + tl.minimum(seq + 1, num_seqs),
                          eviction_policy="evict_last")
    return seq, seq_start, seq_end


@triton.jit
def _checked_sequence_guess(cu_seqlens, first_tok, first_next, num_seqs, num_tokens):
    """(hit, g, cu[g], cu[g + 1]): g is the first token's sequence were every sequence of one
    length, its index times num_seqs / num_tokens, taken at the token's middle (+ 0.5) so
    that float32 rounding cannot put a sequence's first token in the one before (below about
    2^22 tokens; past that a miss only costs the search). hit (int32, 0 or 1): cu[g] <
    first_next <= cu[g + 1], which makes g `_first_sequence`'s answer whatever the lengths.
    Two loads, both inside cu_seqlens (num_seqs >= 1)."""
    g = ((first_tok.to(tl.float32) + 0.5) * (num_seqs.to(tl.float32) / num_tokens.to(tl.float32))
         ).to(tl.int32)
    g = tl.minimum(tl.maximum(g, 0), num_seqs - 1)
    g_start = tl.load(cu_seqlens + g, eviction_policy="evict_last")
    g_end = tl.load(cu_seqlens + g + 1, eviction_policy="evict_last")
    return ((g_start < first_next) & (g_end >= first_next)).to(tl.int32), g, g_start, g_end


@triton.jit
def _first_sequence(cu_seqlens, next_start, num_seqs, SEARCH_LEVELS: tl.constexpr):
    """The last i in [0, num_seqs] with cu[i] < next_start (0 if none) for one token, by the
    whole program: each step compares one vector of TILE_FAN - 1 entries, spaced `step`
    apart (a TILE_FAN-way split), so ceil(SEARCH_LEVELS / 2) steps cover what the per-token
    search covers in SEARCH_LEVELS."""
    j = tl.arange(0, TILE_FAN)
    lo = num_seqs * 0
    step = 1
    for _ in tl.static_range((SEARCH_LEVELS + 1) // 2 - 1):
        step *= TILE_FAN
    for _ in tl.static_range((SEARCH_LEVELS + 1) // 2):
        cand = lo + j * step
        counted = (j > 0) & (cand <= num_seqs)
        entry = tl.load(cu_seqlens + cand, mask=counted, other=0, eviction_policy="evict_last")
        lo += tl.sum((counted & (entry < next_start)).to(tl.int32), axis=0) * step
        step //= TILE_FAN
    return lo


@triton.jit
def _token_sequences(cu_seqlens, next_start, num_seqs, SEARCH_LEVELS: tl.constexpr):
    """The last i in [0, num_seqs] with cu[i] < next_start (0 if none), for each token on
    its own: SEARCH_FAN-way, each step loads SEARCH_FAN - 1 entries at once (independent
    cached loads) and moves past those below, so the chain of dependent loads is
    SEARCH_LEVELS long instead of log2(num_seqs)."""
    lo = (next_start * 0).to(tl.int32)
    step = 1
    for _ in tl.static_range(SEARCH_LEVELS - 1):
        step *= SEARCH_FAN
    for _ in tl.static_range(SEARCH_LEVELS):
        below = lo * 0
        for j in tl.static_range(1, SEARCH_FAN):
            cand = lo + j * step
            valid = cand <= num_seqs
            entry = tl.load(cu_seqlens + cand, mask=valid, other=0, eviction_policy="evict_last")
            below += (valid & (entry < next_start)).to(tl.int32)
        lo += below * step
        step //= SEARCH_FAN
    return lo


@triton.jit
def _tile_angles(angles, positions, tok, first_tok, seq_idx, batch_idx, tokens, rotary_dim,
                 freqs, data_dtype: tl.constexpr, SHARED: tl.constexpr, cfg: tl.constexpr):
    """(in_seq, cos1, cos2, sin1, sin2) of the tile's tokens: whether each lies inside a
    sequence (`_positions`), and [T, K] cos and sin of the angles of both members of each pair
    (`freqs`: `_pair_frequencies`' result, or None to load them here), in the arithmetic's
    dtype for the tile's data of `data_dtype`.

    SHARED (a tile of several heads): these are worked out once per token (and pair) across
    the program's threads, then handed to the threads that hold each head. Left alone,
    Triton recomputes values in the layout of the tile that consumes them (it
    rematerializes producers that look cheap rather than move values between threads), so
    that every thread would run the thd search and sin/cos for all pairs of its own
    channels, once per head row it shares with other threads: several times the arithmetic
    of the loads and stores it has to hide behind. Triton never rematerializes the results of
    a `while` loop: worked out inside one-trip loops, positions and angles keep layouts of
    their own (one token per thread for the search, one (token, pair) for sin/cos) and reach
    the tile's through shared memory. A loop inside keeps Triton from software-pipelining the
    loop around (it pipelines innermost loops only), so tiles of a pipelined loop
    (cfg.PIPELINE_STAGES) keep the angles out of the tile's layout with `_own_layout`
    instead; their positions are one per token, cheap to repeat."""
    # Shapes are lists of constexprs: a Variant's fields are plain ints until bound so.
    BLOCK_T: tl.constexpr = cfg.BLOCK_T
    BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
    compute_dtype: tl.constexpr = _compute_dtype(data_dtype)
    ONE_HEAD_SEARCH: tl.constexpr = (not SHARED and cfg.NORM == NO_NORM
                                     and cfg.POSITIONS_FROM == IMPLICIT_POSITIONS)
    if (cfg.ANGLES_FROM_POSITIONS and cfg.IS_THD and freqs is None
            and ((SHARED and cfg.PIPELINE_STAGES == 0) or ONE_HEAD_SEARCH)):
        # Loaded before the search of cu_seqlens. Loaded inside the loop below (tiles of
        # several heads), ptxas issues it only once the search's chain of dependent loads has
        # returned (SASS instruction 473-594 of 776-957 of those tiles, Triton 3.6); loaded
        # with the angles (one-head tiles), after the search's code. Kernels alone, fraction of
        # copy speed, H200: packed batches of mixed and lognormal lengths, 16-32 heads,
        # bf16/fp16, up to +0.02 (artifacts/thd/freqs_before_search_ab_h200.log); one head of
        # d 128 in the search tile with the guessed window, bf16 0.82-0.83 -> 0.87-0.88,
        # float32 0.95 -> 0.97-0.98 (artifacts/thd/narrow_tokens_guess_ab_h200.log, run 3).
        # One-head tiles with a norm or with positions read from a tensor, not measured, load
        # it with the angles.
        freqs = _pair_frequencies(angles, positions, rotary_dim, cfg)
    if SHARED and cfg.PIPELINE_STAGES == 0:
        in_seq = tok >= 0
        pos = tok.to(tl.int64)
        trips = 0
        while trips < 1:
            in_seq, pos = _positions(positions, tok, first_tok, seq_idx, batch_idx, tokens, cfg)
            trips += 1
        cos1 = tl.zeros([BLOCK_T, BLOCK_HALF], compute_dtype)
        sin1 = tl.zeros([BLOCK_T, BLOCK_HALF], compute_dtype)
        if cfg.ANGLES_FROM_POSITIONS:
            trips = 0
            while trips < 1:
                cos1, sin1 = _rotation_from_positions(angles, positions, pos, rotary_dim, freqs,
                                                      compute_dtype, cfg)
                trips += 1
            cos2, sin2 = cos1, sin1
        else:
            cos2 = tl.zeros([BLOCK_T, BLOCK_HALF], compute_dtype)
            sin2 = tl.zeros([BLOCK_T, BLOCK_HALF], compute_dtype)
            trips = 0
            while trips < 1:
                cos1, cos2, sin1, sin2 = _rotation_from_table(angles, pos, rotary_dim,
                                                              data_dtype, False, cfg)
                trips += 1
    else:
        in_seq, pos = _positions(positions, tok, first_tok, seq_idx, batch_idx, tokens, cfg)
        if cfg.ANGLES_FROM_POSITIONS:
            cos1, sin1 = _rotation_from_positions(angles, positions, pos, rotary_dim, freqs,
                                                  compute_dtype, cfg)
            if SHARED:
                cos1, sin1 = _own_layout(cos1), _own_layout(sin1)
            cos2, sin2 = cos1, sin1
        else:
            cos1, cos2, sin1, sin2 = _rotation_from_table(angles, pos, rotary_dim, data_dtype,
                                                          not SHARED, cfg)
            if SHARED:
                cos1, cos2 = _own_layout(cos1), _own_layout(cos2)
                sin1, sin2 = _own_layout(sin1), _own_layout(sin2)
    return in_seq, cos1, cos2, sin1, sin2


@triton.jit
def _own_layout(x):
    """x ([T, K]) unchanged, in a layout of its own: Triton does not rematerialize a value's
    producers into a consumer's layout through a reduction whose layout cannot be inferred
    from the consumer's, here one over an axis of size 1 (the sum of one element is that
    element, bit for bit). test_pipelined_tiles_compute_sin_cos_once_per_program checks that it
    engaged (it did on Triton 3.5.1, 3.6, 3.7.1 and 3.9)."""
    return tl.sum(x[:, :, None], axis=2)


@triton.jit
def _rotation_from_table(angles, pos, rotary_dim, data_dtype: tl.constexpr,
                         SAME_HALVES_ONCE: tl.constexpr, cfg: tl.constexpr):
    """(cos1, cos2, sin1, sin2) [T, K] of the angles of both pair members for the T
    positions `pos`, read from the angle table, in the arithmetic's dtype for the tile's data
    of `data_dtype`.

    sin/cos of a table angle: for float32 data `_table_sincos` (polynomials, within a few
    float32 ulps); for 16-bit data the positions path's reduction modulo pi and the hardware's
    sin/cos (`_exact_angle_sincos` with no error term: within 8e-7 of the true values, far
    below a 16-bit output's rounding) at about half the instructions. Where sin/cos limit a
    tile (one or two heads per token, the table's rows cached) that is speed; kernels alone,
    fraction of copy speed, bf16, one H200: packed thd of 64-token sequences, one head of d 128
    0.59 -> 0.65, two heads of d 64 0.64 / 0.56 -> 0.73 / 0.74 (forward / backward), sbhd of
    two heads of d 64 0.66 -> 0.72; tiles of many heads within 0.004. The bf16 output then
    differs from the correctly rounded result in 1.4e-4 of its elements instead of 2.5e-5
    (fp16 8.7e-4 instead of 1.5e-4), each by one ulp, no worst case larger; in float32 the
    same change would put the error at 1.5e-7 instead of 3.9e-8, so float32 keeps the
    polynomials (artifacts/tiles/table_hardware_sincos_ab_h200.log; not run on the H100).

    SAME_HALVES_ONCE: where both members of every pair have the same angle bits (TE's tables
    repeat the frequencies, cat(freqs, freqs) or interleaved), sin/cos are worked out once for
    both, after a check over the whole tile; else for each. It pays where each thread works
    out the angles of its own channels (one head per tile), where sin/cos are most of the
    instructions and the backward, which pairs each member's cos with the other's sin, kept
    both sets live (80 registers against the forward's 61; 62 with the check). Kernels alone,
    bf16, one head of d 128, 64K-128K tokens, H100 / H200: backward 0.45-0.46 / 0.41-0.43 ->
    0.54-0.57 / 0.52-0.54 of a copy's speed, as fast as the forward; forward +1-2%. Where a
    tile's heads share the angles, the check's reduction costs more than it saves (28-64
    heads: up to 2% slower on the H200). The check comes before any sin/cos: worked out
    first, ptxas put each table vector's sin/cos between its load and the next load, so a
    warp waited for each load in turn; with the check first every load of the tile is issued
    together (SASS, Triton 3.6). MLA's key, one interleaved head of d 64, bf16/fp16, H200:
    forward 0.45-0.46 -> 0.52 of a copy's speed, backward 0.46-0.47 -> 0.49-0.51 (its own
    bound, a copy plus the table's bytes, is 0.5); other one-head tiles within 0.006. Not
    run on the H100."""
    BLOCK_T: tl.constexpr = cfg.BLOCK_T
    BLOCK_HALF: tl.constexpr = cfg.BLOCK_HALF
    compute_dtype: tl.constexpr = _compute_dtype(data_dtype)
    HARDWARE_SINCOS: tl.constexpr = data_dtype.primitive_bitwidth == 16
    half = rotary_dim // 2
    row_stride, channel_stride = angles.strides[0], angles.strides[1]
    # A position outside the table has no defined rotation: NaN, and its row is never read.
    pos_ok = (pos >= 0) & (pos < angles.rows)
    f_base = angles.freqs + tl.where(pos_ok, pos, 0)[:, None] * row_stride
    # Angles of the two members of each pair: channels (k, k + half) for rotate-half,
    # (2k, 2k + 1) interleaved.
    if cfg.INTERLEAVED:
        offs_d = tl.arange(0, 2 * BLOCK_HALF)
        f = tl.load(f_base + offs_d[None, :] * channel_stride,
                    mask=pos_ok[:, None] & (offs_d[None, :] < rotary_dim), other=0.0)
        f1, f2 = tl.split(tl.reshape(f.to(compute_dtype), [BLOCK_T, BLOCK_HALF, 2]))
    else:
        offs_k = tl.arange(0, BLOCK_HALF)
        mask_k = pos_ok[:, None] & (offs_k[None, :] < half)
        f1 = tl.load(f_base + offs_k[None, :] * channel_stride, mask=mask_k, other=0.0)
        f2 = tl.load(f_base + (offs_k + half)[None, :] * channel_stride, mask=mask_k, other=0.0)
        f1, f2 = f1.to(compute_dtype), f2.to(compute_dtype)
    if compute_dtype == tl.float64:
        sin1, cos1 = tl.sin(f1), tl.cos(f1)
        sin2, cos2 = tl.sin(f2), tl.cos(f2)
    else:
        same = False
        if SAME_HALVES_ONCE:
            same_bits = f1.to(tl.int32, bitcast=True) == f2.to(tl.int32, bitcast=True)
            same = tl.min(same_bits.to(tl.int32)) == 1
        sin1, cos1 = _table_angle_sincos(f1, HARDWARE_SINCOS)
        if same:
            sin2, cos2 = sin1, cos1
        else:
            sin2, cos2 = _table_angle_sincos(f2, HARDWARE_SINCOS)
    cos1 = tl.where(pos_ok[:, None], cos1, _nan())
    cos2 = tl.where(pos_ok[:, None], cos2, _nan())
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotation_from_positions(angles, positions, pos, rotary_dim, freqs,
                             compute_dtype: tl.constexpr, cfg: tl.constexpr):
    """(cos, sin) [T, K] of the angles pos * inv_freq[k] (both members of pair k share
    them), times angles.scale; `freqs` as `_pair_frequencies` gives them, or None to load
    them here.

    The product of the integer position and the float32 inverse frequency is kept exact as
    hi - err (an fma two-product; exact while |pos| < 2^24, where pos converts to float32
    exactly; NaN beyond) and reduced modulo pi without rounding it first
    (`_exact_angle_sincos`)."""
    if freqs is None:
        freqs = _pair_frequencies(angles, positions, rotary_dim, cfg)
    inv_freq, axis_offset = freqs
    if cfg.POSITIONS_FROM == AXIS_POSITIONS_TENSOR:
        mask_k = tl.arange(0, cfg.BLOCK_HALF) < rotary_dim // 2
        p = tl.load(positions.positions + pos[:, None] + axis_offset[None, :],
                    mask=mask_k[None, :], other=0).to(tl.int64)               # [T, K]
    else:
        p = pos[:, None]                                                       # [T, 1]
    if compute_dtype == tl.float64:
        angle = p.to(tl.float64) * inv_freq.to(tl.float64)[None, :]
        sin, cos = tl.sin(angle), tl.cos(angle)
    else:
        # Past 2^24 the position itself would be rounded to float32: NaN, never a wrong angle.
        # Tested after the conversion (exact below 2^24, at least 2^24 in magnitude above):
        # an integer test takes 64-bit arithmetic for every angle a thread works out (40 of
        # the 872 SASS instructions of TP 8's forward tile of q and k, Triton 3.6, sm_90).
        pf = p.to(tl.float32)
        pf = tl.where(tl.abs(pf) < _FAST_REDUCTION_LIMIT, pf, _nan())
        hi = pf * inv_freq[None, :]
        # hi - pf * inv_freq exactly: written so, not as fma(pf, inv_freq, -hi), because the
        # compiler turns -hi into a second product of -pf and inv_freq.
        err = _fma(-pf, inv_freq[None, :], hi)
        sin, cos = _exact_angle_sincos(hi, err)
    # Multiplied also by a scale of 1: a variant that left the two products out had fewer
    # instructions but ran its one-head d 128 tiles slower (bf16 backward, H200, Triton 3.6).
    return cos * angles.scale, sin * angles.scale


@triton.jit
def _pair_frequencies(angles, positions, rotary_dim, cfg: tl.constexpr):
    """(inv_freq, axis_offset) [K]: each pair's inverse frequency and, for M-RoPE, the offset
    of its axis in positions (0 otherwise)."""
    offs_k = tl.arange(0, cfg.BLOCK_HALF)
    mask_k = offs_k < rotary_dim // 2
    inv_freq = tl.load(angles.freqs + offs_k, mask=mask_k, other=0.0)
    axis_offset = 0
    if cfg.POSITIONS_FROM == AXIS_POSITIONS_TENSOR:
        # pair_axis is the caller's data: an axis outside [0, n_axes) gives NaN (through its
        # frequency), never a read outside positions.
        axis = tl.load(angles.pair_axis + offs_k, mask=mask_k, other=0).to(tl.int64)
        axis_ok = (axis >= 0) & (axis < angles.n_axes)
        inv_freq = tl.where(axis_ok, inv_freq, _nan())
        axis_offset = tl.where(axis_ok, axis, 0) * positions.strides[0]
    return inv_freq, axis_offset




# Angles the float32 reductions take: |angle| < 2^24 (for positions: every position below 2^24
# at the fastest frequency, 1 rad per token). Larger angles give NaN, like positions outside a
# table: a precise fallback behind a per-tile branch fences the tile's arithmetic and costs
# bandwidth at small tiles.
_FAST_REDUCTION_LIMIT = tl.constexpr(16777216.0)

# Table angles: pi/2 as the unevaluated sum of three float32 numbers (Cody-Waite). PIO2_1 has
# 24 significant bits and its last bit is worth 2^-23, so for |k| <= 2^24 the first reduction
# step x - k * PIO2_1, computed in one fma, is exact (the result is a multiple of 2^-23 below
# 2 in magnitude). The remaining terms are rounded once each (<= 2^-25 absolute).
_PIO2_1 = tl.constexpr(1.5707963705062866)
_PIO2_2 = tl.constexpr(-4.371138828673793e-08)
_PIO2_3 = tl.constexpr(-1.7151245100058819e-15)
_TWO_OVER_PI = tl.constexpr(0.6366197466850281)

# Angles from positions: pi as three float32 parts (PI_1: 24 bits, the last worth 2^-22) and
# 1/pi as two (their sum within 1e-15 relative of 1/pi).
_PI_1 = tl.constexpr(3.1415927410125732)
_PI_2 = tl.constexpr(-8.742277657347586e-08)
_PI_3 = tl.constexpr(-3.4302490200117637e-15)
_INV_PI_HI = tl.constexpr(0.31830987334251404)
_INV_PI_LO = tl.constexpr(1.2841276486597053e-08)

# On the GPU the positions path takes sin/cos of its reduced angle from the hardware (PTX
# sin.approx.f32 / cos.approx.f32); the interpreter cannot run PTX and takes numpy's sin/cos
# of the same reduced angle.
_HARDWARE_SINCOS = tl.constexpr(not _INTERPRETING)
# The angle reductions and the exact two-product below need an fma that rounds once (`_fma`):
# their results are exact, or their proofs assume one rounding. The GPU's tl.fma does; the
# interpreters of Triton 3.5.1, 3.6 and 3.7.1 compute tl.fma as a multiply and an add (two
# roundings: `TRITON_INTERPRET=1`, tl.fma(x, x, -x * x) of float32 x = 1 + 2^-12 gives 0, not
# 2^-24), which would put the exact-angle path off by up to 10% at 16M. So the interpreter gets a
# correctly rounded float32 fma of its own (`_fma_rounded_once`); the GPU keeps tl.fma. The
# sin/cos polynomials and the rotation use tl.fma directly: a second rounding there moves a
# result by at most about an ulp (in the interpreter only), and the emulation costs the
# interpreter about 25 operations per fma.
_EMULATED_FMA = tl.constexpr(_INTERPRETING)

# Quiet NaN as float32 bits (a NaN constant cannot be a global: NaN != NaN trips Triton's
# check that globals did not change since compilation).
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _nan():
    return tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _fma(a, b, c):
    """a * b + c rounded once: tl.fma on the GPU (and for float64, which only gradcheck
    runs), `_fma_rounded_once` for float32 in the interpreter."""
    if _EMULATED_FMA:
        if a.dtype == tl.float32:
            return _fma_rounded_once(a, b, c)
    return tl.fma(a, b, c)


@triton.jit
def _fma_rounded_once(a, b, c):
    """float32 a * b + c, correctly rounded, from float64 arithmetic (interpreter only).

    The product of two float32 numbers has at most 48 significant bits: exact in float64.
    The float64 sum s = fl(p + c) rounds, and its error e = (p + c) - s is exact (TwoSum).
    Rounding to odd (if e != 0 and s is even, step s one ulp towards e) keeps the sticky
    information; a float64 value rounded to odd and then to float32 (53 >= 24 + 2 bits) is the
    correctly rounded float32 result (Boldo and Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", IEEE TC 2008). Where s is not
    finite, e is NaN: a step of s's bits keeps a NaN a NaN, and an infinity rounds back to
    an infinity in float32.
    """
    p = tl.cast(a, tl.float32).to(tl.float64) * tl.cast(b, tl.float32).to(tl.float64)
    c64 = tl.cast(c, tl.float32).to(tl.float64)
    s = p + c64
    c_part = s - p
    e = (p - (s - c_part)) + (c64 - c_part)
    bits = s.to(tl.int64, bitcast=True)
    towards_e = tl.where((e > 0) == (s > 0), 1, -1).to(tl.int64)
    inexact_even = (e != 0) & ((bits & 1) == 0)
    s = tl.where(inexact_even, bits + towards_e, bits).to(tl.float64, bitcast=True)
    return s.to(tl.float32)


@triton.jit
def _table_angle_sincos(angle, HARDWARE_SINCOS: tl.constexpr):
    """sin and cos of float32 table angles as `_rotation_from_table` takes them."""
    if HARDWARE_SINCOS:
        return _exact_angle_sincos(angle, 0.0)
    return _table_sincos(angle)


@triton.jit
def _table_sincos(angle):
    """sin and cos of a float32 table angle, within a few float32 ulps; NaN for |angle| >=
    _FAST_REDUCTION_LIMIT.

    angle = k * pi/2 + r: k by rounding, r by the exact Cody-Waite steps above, |r| <= pi/4 +
    2^-22. Taylor polynomials in r to degree 11 (sin) and 12 (cos) truncate below 1e-10 on
    that range. The quadrant k mod 4 swaps and negates.
    """
    k = tl.floor(angle * _TWO_OVER_PI + 0.5)
    r = _fma(-k, _PIO2_1, angle)
    r = _fma(-k, _PIO2_2, r)
    r = _fma(-k, _PIO2_3, r)
    r2 = r * r
    s = tl.fma(r2, -2.505210838544172e-08, 2.755731922398589e-06)    # 1/11!, 1/9!
    s = tl.fma(r2, s, -1.984126984126984e-04)                        # 1/7!
    s = tl.fma(r2, s, 8.333333333333333e-03)                         # 1/5!
    s = tl.fma(r2, s, -1.6666666666666666e-01)                       # 1/3!
    s = tl.fma(r * r2, s, r)
    c = tl.fma(r2, 2.08767569878681e-09, -2.755731922398589e-07)     # 1/12!, 1/10!
    c = tl.fma(r2, c, 2.48015873015873e-05)                          # 1/8!
    c = tl.fma(r2, c, -1.388888888888889e-03)                        # 1/6!
    c = tl.fma(r2, c, 4.1666666666666664e-02)                        # 1/4!
    c = tl.fma(r2, c, -0.5)
    c = tl.fma(r2, c, 1.0)
    q = k.to(tl.int32)
    swap = (q & 1) != 0
    sin = tl.where(swap, c, s)
    cos = tl.where(swap, s, c)
    sin = tl.where((q & 2) != 0, -sin, sin)
    cos = tl.where(((q + 1) & 2) != 0, -cos, cos)
    big = tl.abs(angle) >= _FAST_REDUCTION_LIMIT
    return tl.where(big, _nan(), sin), tl.where(big, _nan(), cos)


@triton.jit
def _exact_angle_sincos(hi, err):
    """sin and cos of the angle hi - err, the exact product of a position and an inverse
    frequency (hi its float32 rounding, |err| <= ulp(hi) / 2); NaN where hi is NaN or
    |hi| >= _FAST_REDUCTION_LIMIT.

    Error bound (|hi| < 2^24, so ulp(hi) <= 1 and |err| <= 1/2):
    - k = floor(hi * (1/pi) + 1/2) from the two-part 1/pi, one rounding of at most 1/4 (the
      sum is below 2^23): |hi / pi - k| <= 3/4.
    - r = hi - k * pi - err. The first step hi - k * PI_1 is exact (fma; hi and k * PI_1 are
      multiples of 2^-22, or of 2^-23 when |hi| < 2 and |k| <= 1, and the difference is
      below 4), the next three round once each: |r| <= 3/4 * pi + 1/2 < 2.86 < pi, with an
      error below 3 * 2^-23 + 2^24 * 2^-74 < 3.6e-7.
    - sin r and cos r by the hardware: absolute error <= 2^-21.41 (sin) and 2^-21.19 (cos) on
      [-pi, pi] (CUDA C++ Programming Guide, intrinsic functions; measured over every float32
      in [-2.87, 2.87] in docs/accuracy.md); k odd negates both.
    The rotation [[cos, -sin], [sin, cos]] is then within 3.6e-7 + 3.6e-7 + 4.3e-7 < 1.2e-6 (2-
    norm) of the exact one; with the output's roundings, the relative error of a rotated pair
    stays below 1.4e-6 (the accuracy tests' bound is 2e-6).
    """
    k = tl.floor(_fma(hi, _INV_PI_HI, _fma(hi, _INV_PI_LO, 0.5)))
    # The constants carry the signs, so that no instruction negates k or err.
    r = _fma(k, -_PI_1, hi)
    r = _fma(k, -_PI_2, r)
    r = _fma(k, -_PI_3, r)
    r = tl.where(tl.abs(hi) < _FAST_REDUCTION_LIMIT, r - err, _nan())
    if _HARDWARE_SINCOS:
        sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r],
                                        dtype=tl.float32, is_pure=True, pack=1)
        cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r],
                                        dtype=tl.float32, is_pure=True, pack=1)
    else:
        sin, cos = tl.sin(r), tl.cos(r)
    # (-1)^k as the sign bit, flipped into both.
    odd = k.to(tl.int32) << 31
    sin = (sin.to(tl.int32, bitcast=True) ^ odd).to(tl.float32, bitcast=True)
    cos = (cos.to(tl.int32, bitcast=True) ^ odd).to(tl.float32, bitcast=True)
    return sin, cos

