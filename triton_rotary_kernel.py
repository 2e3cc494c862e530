"""Fused rotary position embedding (RoPE) in Triton: the kernel and its launcher.

One kernel serves forward and backward. With x1/x2 the two halves of each rotated pair
(first/second half of the rotary channels, or even/odd channels when interleaved) and
f1/f2 their frequencies, the forward is

    out1 = x1 * cos(f1) - x2 * sin(f1)
    out2 = x2 * cos(f2) + x1 * sin(f2)

and the backward is its exact transpose,

    dx1 = g1 * cos(f1) + g2 * sin(f2)
    dx2 = g2 * cos(f2) - g1 * sin(f1)

i.e. the same code with the sines negated and swapped between the halves (`BACKWARD`).
For frequencies built as TE's `RotaryPositionEmbedding` builds them (f1 == f2) this is the
familiar "rotate by -theta"; for arbitrary frequencies it is still the true gradient, which
is what Transformer Engine's CUDA kernel computes too.

Channels `rotary_dim..head_dim` are copied through. Arithmetic is float32 (float64 for
float64 inputs, so that `gradcheck` can run through the kernel).
"""

import triton
import triton.language as tl

# Quiet NaN as float32 bits (a NaN constant cannot be a global: NaN != NaN trips Triton's
# check that globals did not change since compilation).
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "num_seqs", "search_steps",
                               "cp_size", "cp_rank", "freqs_len"])
def rotary_kernel(
    OUT, X, FREQS, START_POSITIONS, CU_SEQLENS,
    num_tokens, seq_len, batch, nheads, rotary_dim, head_dim, freqs_len,
    num_seqs, search_steps, cp_size, cp_rank,
    stride_x_seq, stride_x_batch, stride_x_head, stride_x_dim,
    stride_out_seq, stride_out_batch, stride_out_head, stride_out_dim,
    stride_freqs_seq, stride_freqs_dim,
    BLOCK_T: tl.constexpr,       # tokens per program
    BLOCK_H: tl.constexpr,       # heads per program
    BLOCK_HALF: tl.constexpr,    # power of two >= rotary_dim // 2
    BLOCK_PASS: tl.constexpr,    # power of two >= head_dim - rotary_dim; 0: leave them (in place)
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr,
    SEQ_MAJOR: tl.constexpr,     # token index is seq-major (sbhd) or batch-major (bshd)
    HAS_START: tl.constexpr,
    WIDE_INNER: tl.constexpr,    # offsets inside one token may exceed int32 (exotic strides)
):
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _rope_tile(OUT, X, FREQS, START_POSITIONS, CU_SEQLENS, heads, nheads, 1,
               stride_x_seq, stride_x_batch, stride_x_head, stride_x_head, stride_x_dim,
               stride_out_seq, stride_out_batch, stride_out_head, stride_out_head, stride_out_dim,
               stride_freqs_seq, stride_freqs_dim, freqs_len, rotary_dim, head_dim, num_tokens,
               seq_len, batch, num_seqs, search_steps, cp_size, cp_rank, BLOCK_T, BLOCK_H,
               BLOCK_HALF, BLOCK_PASS, INTERLEAVED, BACKWARD, IS_THD, SEQ_MAJOR, HAS_START,
               WIDE_INNER)


@triton.jit
def _rope_tile(OUT, X, FREQS, START_POSITIONS, CU_SEQLENS, heads, nheads, heads_per_group,
               stride_x_seq, stride_x_batch, stride_x_group, stride_x_head, stride_x_dim,
               stride_out_seq, stride_out_batch, stride_out_group, stride_out_head, stride_out_dim,
               stride_freqs_seq, stride_freqs_dim, freqs_len, rotary_dim, head_dim, num_tokens,
               seq_len, batch, num_seqs, search_steps, cp_size, cp_rank,
               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
               IS_THD: tl.constexpr, SEQ_MAJOR: tl.constexpr, HAS_START: tl.constexpr,
               WIDE_INNER: tl.constexpr):
    """Rotate one tile: the program's BLOCK_T tokens times the given BLOCK_H heads.

    All loads of the tile are issued first, and positions and cos/sin are worked out while
    they are in flight: RoPE is a copy with a little arithmetic, so its speed is how well
    the load latency is hidden. Head j sits at (j // heads_per_group) * stride_group +
    (j % heads_per_group) * stride_head: j * stride_head for ordinary tensors
    (heads_per_group = 1); the query heads of a packed [.., kv_heads, q|k|v] tensor otherwise.
    """
    tok, tok_ok, seq_idx, batch_idx = _program_tokens(num_tokens, seq_len, batch, BLOCK_T, IS_THD,
                                                      SEQ_MAJOR)
    mask_th = tok_ok[:, None, None] & (heads < nheads)[None, :, None]      # [T, H, 1]
    if WIDE_INNER:
        heads = heads.to(tl.int64)
    group, sub = heads // heads_per_group, heads % heads_per_group
    x_base = _tile_base(X, seq_idx, batch_idx, stride_x_seq, stride_x_batch,
                        group * stride_x_group + sub * stride_x_head)
    out_base = _tile_base(OUT, seq_idx, batch_idx, stride_out_seq, stride_out_batch,
                          group * stride_out_group + sub * stride_out_head)
    compute_dtype = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32

    # Loads. Interleaved tiles are loaded contiguously (vectorisable) and split even/odd in
    # registers rather than gathered with stride 2.
    half = rotary_dim // 2
    offs_k = tl.arange(0, BLOCK_HALF)
    offs_d = tl.arange(0, 2 * BLOCK_HALF)
    if WIDE_INNER:
        offs_k = offs_k.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
    if INTERLEAVED:
        mask = mask_th & (offs_d < rotary_dim)[None, None, :]
        x = tl.load(x_base + offs_d[None, None, :] * stride_x_dim, mask=mask, other=0.0)
        x1, x2 = tl.split(tl.reshape(x.to(compute_dtype), [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
    else:
        mask = mask_th & (offs_k < half)[None, None, :]
        x1_ptrs = x_base + offs_k[None, None, :] * stride_x_dim
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(compute_dtype)
        x2 = tl.load(x1_ptrs + half * stride_x_dim, mask=mask, other=0.0).to(compute_dtype)
    if BLOCK_PASS > 0:
        # Channels rotary_dim..head_dim are copied through.
        offs_p = rotary_dim + tl.arange(0, BLOCK_PASS)
        if WIDE_INNER:
            offs_p = offs_p.to(tl.int64)
        mask_p = mask_th & (offs_p < head_dim)[None, None, :]
        x_pass = tl.load(x_base + offs_p[None, None, :] * stride_x_dim, mask=mask_p)

    # Positions and cos/sin, shared by all heads of the tile.
    in_seq, pos = _positions(START_POSITIONS, CU_SEQLENS, tok, seq_idx, batch_idx, seq_len,
                             num_seqs, search_steps, cp_size, cp_rank, IS_THD, HAS_START)
    cos1, cos2, sin_a, sin_b = _rotation(FREQS, pos, freqs_len, rotary_dim, stride_freqs_seq,
                                         stride_freqs_dim, compute_dtype, BLOCK_T, BLOCK_HALF,
                                         INTERLEAVED, BACKWARD)
    # Explicit fused multiply-adds: left to the compiler, the contraction of a*b - c*d varies
    # with the tile shape, and so would the last bit of a token's result with the batch size.
    out1 = tl.fma(x1, cos1, -(x2 * sin_a))
    out2 = tl.fma(x2, cos2, x1 * sin_b)
    if IS_THD:
        # Tokens outside every sequence pass through unchanged.
        out1 = tl.where(in_seq[:, None, None], out1, x1)
        out2 = tl.where(in_seq[:, None, None], out2, x2)

    out_ty = OUT.dtype.element_ty
    if INTERLEAVED:
        out = tl.reshape(tl.join(out1, out2), [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        tl.store(out_base + offs_d[None, None, :] * stride_out_dim, out.to(out_ty), mask=mask)
    else:
        out1_ptrs = out_base + offs_k[None, None, :] * stride_out_dim
        tl.store(out1_ptrs, out1.to(out_ty), mask=mask)
        tl.store(out1_ptrs + half * stride_out_dim, out2.to(out_ty), mask=mask)
    if BLOCK_PASS > 0:
        tl.store(out_base + offs_p[None, None, :] * stride_out_dim, x_pass, mask=mask_p)


@triton.jit
def _program_tokens(num_tokens, seq_len, batch, BLOCK_T: tl.constexpr, IS_THD: tl.constexpr,
                    SEQ_MAJOR: tl.constexpr):
    """The program's BLOCK_T token indices (clamped into range), which of them are real, and
    their (sequence, batch) indices."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok = tl.minimum(tok, num_tokens - 1)
    seq_idx, batch_idx = _token_coords(tok, seq_len, batch, IS_THD, SEQ_MAJOR)
    return tok, tok_ok, seq_idx, batch_idx


@triton.jit
def _tile_base(PTR, seq_idx, batch_idx, stride_seq, stride_batch, head_offset):
    """Pointers [T, H, 1] to channel 0 of each (token, head) of a tile; head_offset [H] holds
    the heads' element offsets inside a token."""
    row = seq_idx.to(tl.int64) * stride_seq + batch_idx.to(tl.int64) * stride_batch
    return PTR + row[:, None, None] + head_offset[None, :, None]


@triton.jit
def _token_coords(tok, seq_len, batch, IS_THD: tl.constexpr, SEQ_MAJOR: tl.constexpr):
    """(sequence, batch) index of each token; thd rows are addressed by the token alone."""
    if IS_THD:
        return tok, tok * 0
    if SEQ_MAJOR:
        return tok // batch, tok % batch
    return tok % seq_len, tok // seq_len


@triton.jit
def _positions(START_POSITIONS, CU_SEQLENS, tok, seq_idx, batch_idx, seq_len, num_seqs,
               search_steps, cp_size, cp_rank, IS_THD: tl.constexpr, HAS_START: tl.constexpr):
    """(in_seq, pos): whether each token lies inside a thd sequence (always, otherwise) and
    its position, i.e. its row of freqs."""
    in_seq = tok >= 0
    local_len = seq_len
    if IS_THD:
        # cu_seqlens holds global (padded) offsets; a context-parallel rank holds 1/cp_size of
        # each sequence. Binary search for the last sequence starting at or before the token.
        lo = tok * 0
        hi = lo + num_seqs
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            go_right = tl.load(CU_SEQLENS + mid) // cp_size <= tok
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        batch_idx = lo
        seq_start = tl.load(CU_SEQLENS + batch_idx) // cp_size
        seq_end = tl.load(CU_SEQLENS + tl.minimum(batch_idx + 1, num_seqs)) // cp_size
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
    if HAS_START:
        pos = pos + tl.load(START_POSITIONS + tl.minimum(batch_idx, num_seqs - 1))
    return in_seq, pos


@triton.jit
def _rotation(FREQS, pos, freqs_len, rotary_dim, stride_freqs_seq, stride_freqs_dim,
              compute_dtype: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_HALF: tl.constexpr,
              INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr):
    """cos/sin factors [P, 1, K] of both pair members for the P positions `pos`:
    (cos1, cos2, sin_a, sin_b) such that out1 = x1*cos1 - x2*sin_a and
    out2 = x2*cos2 + x1*sin_b (the forward, or its transpose)."""
    half = rotary_dim // 2
    # A position outside freqs has no defined rotation: NaN, rather than an out-of-bounds read
    # or a silently clamped angle.
    pos_ok = (pos >= 0) & (pos < freqs_len)
    f_base = FREQS + tl.where(pos_ok, pos, 0).to(tl.int64)[:, None] * stride_freqs_seq
    # Angles of the two members of each pair: channels (k, k + half) for rotate-half,
    # (2k, 2k + 1) interleaved.
    if INTERLEAVED:
        offs_d = tl.arange(0, 2 * BLOCK_HALF)
        f = tl.load(f_base + offs_d[None, :] * stride_freqs_dim, mask=offs_d[None, :] < rotary_dim, other=0.0)
        f1, f2 = tl.split(tl.reshape(f.to(compute_dtype), [BLOCK_P, BLOCK_HALF, 2]))
    else:
        offs_k = tl.arange(0, BLOCK_HALF)
        mask_k = offs_k[None, :] < half
        f1 = tl.load(f_base + offs_k[None, :] * stride_freqs_dim, mask=mask_k, other=0.0).to(compute_dtype)
        f2 = tl.load(f_base + (offs_k + half)[None, :] * stride_freqs_dim, mask=mask_k, other=0.0).to(compute_dtype)
    # Precise sin/cos (libdevice, like TE's sincosf) cost tens of instructions each: computed
    # once per (position, channel) of the tile and reused for all its heads.
    sin1, cos1 = tl.sin(f1), tl.cos(f1)
    sin2, cos2 = tl.sin(f2), tl.cos(f2)
    nan = tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    cos1 = tl.where(pos_ok[:, None], cos1, nan)[:, None, :]
    cos2 = tl.where(pos_ok[:, None], cos2, nan)[:, None, :]
    if BACKWARD:
        return cos1, cos2, -sin2[:, None, :], -sin1[:, None, :]
    return cos1, cos2, sin1[:, None, :], sin2[:, None, :]


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "cp_size", "cp_rank",
                               "q_freqs_len", "k_freqs_len"])
def rotary_qkv_kernel(
    Q_OUT, K_OUT, V_OUT, Q_IN, K_IN, V_IN, Q_FREQS, K_FREQS, START_POSITIONS,
    num_tokens, seq_len, batch, kv_heads, q_per_kv, rotary_dim, head_dim, v_dim,
    q_freqs_len, k_freqs_len, cp_size, cp_rank, q_programs,
    # (seq, batch, kv group, head in group, channel) strides of q; (seq, batch, head, channel)
    # of k and v. Forward reads the packed tensor and writes three; backward the reverse.
    sqi_s, sqi_b, sqi_g, sqi_h, sqi_d, sqo_s, sqo_b, sqo_g, sqo_h, sqo_d,
    ski_s, ski_b, ski_h, ski_d, sko_s, sko_b, sko_h, sko_d,
    svi_s, svi_b, svi_h, svi_d, svo_s, svo_b, svo_h, svo_d,
    stride_qf_seq, stride_qf_dim, stride_kf_seq, stride_kf_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,       # query heads per program
    BLOCK_KV: tl.constexpr,      # key (and value) heads per program
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_V: tl.constexpr,       # power of two >= v_dim
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, SEQ_MAJOR: tl.constexpr,
    HAS_START: tl.constexpr, WIDE_INNER: tl.constexpr,
):
    """Fused QKV: one launch for q, k and v. Programs along axis 1 first cover the query
    heads (kv_heads * q_per_kv, rotated with Q_FREQS), then the key heads (K_FREQS), each
    with its value heads copied through."""
    pid_h = tl.program_id(1)
    if pid_h < q_programs:
        q_heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        _rope_tile(Q_OUT, Q_IN, Q_FREQS, START_POSITIONS, START_POSITIONS, q_heads,
                   kv_heads * q_per_kv, q_per_kv, sqi_s, sqi_b, sqi_g, sqi_h, sqi_d, sqo_s, sqo_b,
                   sqo_g, sqo_h, sqo_d, stride_qf_seq, stride_qf_dim, q_freqs_len, rotary_dim,
                   head_dim, num_tokens, seq_len, batch, batch, 0, cp_size, cp_rank, BLOCK_T,
                   BLOCK_H, BLOCK_HALF, BLOCK_PASS, INTERLEAVED, BACKWARD, False, SEQ_MAJOR,
                   HAS_START, WIDE_INNER)
    else:
        # Key heads, with the value heads of the same kv heads copied alongside: a key tile
        # alone would be a small program (a quarter of a query tile under 4:1 GQA). The values
        # are loaded first and stored last, so that their loads overlap the key tile's.
        k_heads = (pid_h - q_programs) * BLOCK_KV + tl.arange(0, BLOCK_KV)
        tok, tok_ok, seq_idx, batch_idx = _program_tokens(num_tokens, seq_len, batch, BLOCK_T,
                                                          False, SEQ_MAJOR)
        v_heads = k_heads
        dims = tl.arange(0, BLOCK_V)
        if WIDE_INNER:
            v_heads = v_heads.to(tl.int64)
            dims = dims.to(tl.int64)
        mask_v = (tok_ok[:, None, None] & (v_heads < kv_heads)[None, :, None]
                  & (dims < v_dim)[None, None, :])
        v_in = _tile_base(V_IN, seq_idx, batch_idx, svi_s, svi_b, v_heads * svi_h)
        v = tl.load(v_in + (dims * svi_d)[None, None, :], mask=mask_v)
        _rope_tile(K_OUT, K_IN, K_FREQS, START_POSITIONS, START_POSITIONS, k_heads, kv_heads, 1,
                   ski_s, ski_b, ski_h, ski_h, ski_d, sko_s, sko_b, sko_h, sko_h, sko_d,
                   stride_kf_seq, stride_kf_dim, k_freqs_len, rotary_dim, head_dim, num_tokens,
                   seq_len, batch, batch, 0, cp_size, cp_rank, BLOCK_T, BLOCK_KV, BLOCK_HALF,
                   BLOCK_PASS, INTERLEAVED, BACKWARD, False, SEQ_MAJOR, HAS_START, WIDE_INNER)
        v_out = _tile_base(V_OUT, seq_idx, batch_idx, svo_s, svo_b, v_heads * svo_h)
        tl.store(v_out + (dims * svo_d)[None, None, :], v, mask=mask_v)


# --------------------------------------------------------------------------------------------
# Host side: argument checks (the one place they live) and the launcher.
# --------------------------------------------------------------------------------------------

import functools  # noqa: E402
import os  # noqa: E402
from typing import NamedTuple, Optional  # noqa: E402

import torch  # noqa: E402

TENSOR_FORMATS = ("sbhd", "bshd", "thd")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1
# Launch rule, from timing variants on an H100 (README, "Results and analysis"). A program
# rotates one tile: all heads of one token up to MAX_TILE_ELEMENTS channels (else a
# power-of-two group of them), widened to several tokens while it holds fewer than
# MIN_TILE_ELEMENTS, with NUM_WARPS warps. Tiles shrink (tokens first, then heads) while fewer
# than MIN_PROGRAMS_PER_SM programs per SM would remain.
MIN_TILE_ELEMENTS = 2048
MAX_TILE_ELEMENTS = 8192
NUM_WARPS = 2
MIN_PROGRAMS_PER_SM = 4
# The interpreter runs each program in Python: fewer, larger programs run much faster there.
INTERPRETER_TILE_ELEMENTS = 1 << 16
INTERPRETER_MIN_PROGRAMS = 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class RopeShape(NamedTuple):
    """Sizes of one RoPE call, as `check_rope_args` read them."""
    seq_len: int       # s (sbhd/bshd) or total tokens t (thd)
    batch: int         # b (sbhd/bshd) or number of sequences (thd)
    nheads: int
    head_dim: int      # d
    rotary_dim: int    # d2
    num_tokens: int    # rows of [h, d] to process


def _check_index_tensor(name, value, device, length=None):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    if value.device != device:
        raise TypeError(f"{name} is on {value.device} but t is on {device}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if length is not None and value.numel() != length:
        raise ValueError(f"{name} must have {length} entries (one per sequence), "
                         f"got {value.numel()}")


def check_rope_args(t, freqs, tensor_format="sbhd", start_positions=None, cu_seqlens=None,
                    cp_size=1, cp_rank=0, interleaved=False, need_kernel=True) -> RopeShape:
    """Validate one call's arguments (TE's semantics) and return its sizes.

    Raises TypeError for wrong types, dtypes or devices and ValueError for wrong shapes,
    formats or values, each naming the argument. Reads only metadata: no device sync, so it
    is safe under CUDA graph capture and on fake tensors. Checks that need the *values* of
    `start_positions` / `cu_seqlens` are made by the kernel itself (see `rotary_kernel`).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"t must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if not isinstance(tensor_format, str) or tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    want_rank = 3 if tensor_format == "thd" else 4
    if t.dim() != want_rank:
        raise ValueError(f"t must be {want_rank}-D for tensor_format={tensor_format!r} "
                         f"([{', '.join(tensor_format)}]), got shape {tuple(t.shape)}")
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"freqs must be a torch.Tensor, got {type(freqs).__name__}")
    if not freqs.is_floating_point():
        raise TypeError(f"freqs must be a floating-point tensor (used as float32), got {freqs.dtype}")
    if freqs.device != t.device:
        raise TypeError(f"freqs is on {freqs.device} but t is on {t.device}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    if start_positions is not None and cp_size > 1:
        raise ValueError("start_positions is not supported with cp_size > 1 (as in TE)")

    head_dim = t.shape[-1]
    rotary_dim = freqs.shape[-1]
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"freqs' last dimension (rotary dim d2) must be even and > 0, "
                         f"got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"freqs' last dimension d2={rotary_dim} exceeds t's head dim d={head_dim}")

    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required when tensor_format='thd'")
        _check_index_tensor("cu_seqlens", cu_seqlens, t.device)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have at least 2 entries ([b + 1]), "
                             f"got {cu_seqlens.numel()}")
        num_tokens, nheads = t.shape[0], t.shape[1]
        seq_len, batch = num_tokens, cu_seqlens.numel() - 1
    else:
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens is only valid with tensor_format='thd', "
                             f"got tensor_format={tensor_format!r}")
        seq_len, batch = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        nheads = t.shape[2]
        num_tokens = seq_len * batch
        if seq_len * cp_size > freqs.shape[0]:
            raise ValueError(f"freqs has {freqs.shape[0]} positions but the sequence needs "
                             f"s * cp_size = {seq_len} * {cp_size}")
        if cp_size > 1 and seq_len % 2:
            raise ValueError(f"with cp_size > 1 the local sequence length must be even "
                             f"(two chunks per rank), got {seq_len}")
    if start_positions is not None:
        _check_index_tensor("start_positions", start_positions, t.device, length=batch)
    if need_kernel and t.device.type != "cuda" and not _interpreting():
        raise TypeError(f"t is on {t.device}: the Triton kernel needs a CUDA tensor "
                        f"(or TRITON_INTERPRET=1 for CPU tensors)")
    if num_tokens > _INT32_MAX:
        raise ValueError(f"t has {num_tokens} tokens; at most {_INT32_MAX} are supported")
    return RopeShape(seq_len, batch, nheads, head_dim, rotary_dim, num_tokens)


def _overlaps_itself(x: torch.Tensor) -> bool:
    """True if two elements of x share memory (e.g. an expanded tensor): walking the dims
    from the smallest stride up, each stride must step past everything spanned so far."""
    span = 0
    for stride, size in sorted((st, s) for s, st in zip(x.shape, x.stride()) if s > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _token_strides(x: torch.Tensor, tensor_format: str):
    """(seq, batch, head, dim) strides of x in the given format; thd has no batch stride."""
    if tensor_format == "sbhd":
        return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
    if tensor_format == "bshd":
        return x.stride(1), x.stride(0), x.stride(2), x.stride(3)
    return x.stride(0), 0, x.stride(1), x.stride(2)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(shape: RopeShape, device: torch.device, copy_pass: bool):
    """Tile sizes, grid and warps for one call: a pure function of the sizes (no autotuning).
    Large inputs get one tile shape whatever their length; only inputs too small to give every
    SM MIN_PROGRAMS_PER_SM programs get smaller tiles (a bounded set of compiled variants)."""
    block_half = triton.next_power_of_2(shape.rotary_dim // 2)
    pass_dims = shape.head_dim - shape.rotary_dim if copy_pass else 0
    block_pass = triton.next_power_of_2(pass_dims) if pass_dims else 0
    row = 2 * block_half + block_pass                   # channels of one (token, head) in a tile
    if _interpreting():
        min_tile = max_tile = INTERPRETER_TILE_ELEMENTS
        min_programs = INTERPRETER_MIN_PROGRAMS
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        min_tile, max_tile = MIN_TILE_ELEMENTS, MAX_TILE_ELEMENTS
        min_programs = MIN_PROGRAMS_PER_SM * _num_sms(index)
    block_h = min(triton.next_power_of_2(shape.nheads), _pow2_floor(max_tile // row))
    max_block_t = triton.next_power_of_2(shape.num_tokens)
    block_t = min(max_block_t, _pow2_floor(min_tile // (row * block_h)))
    # Triton keeps the tile's [BLOCK_T, BLOCK_HALF] angles one per thread only when there
    # are at least as many as threads; with fewer, every thread reloads freqs and recomputes
    # sin/cos for its own channels (4x the instructions in the SASS). A tile of up to
    # 2 * MIN_TILE_ELEMENTS cannot hide that (h 32 d 64 bf16: 0.82 of copy speed on an H100,
    # 0.99 with one more token), so it gets more tokens.
    while (block_t * block_half < 32 * NUM_WARPS and block_t * block_h * row < 2 * min_tile
           and block_t < max_block_t):
        block_t *= 2

    def programs():
        return triton.cdiv(shape.num_tokens, block_t) * triton.cdiv(shape.nheads, block_h)

    while block_t > 1 and programs() < min_programs:
        block_t //= 2
    while block_h > 1 and programs() < min_programs:
        block_h //= 2
    grid = (triton.cdiv(shape.num_tokens, block_t), triton.cdiv(shape.nheads, block_h))
    meta = dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
                num_warps=NUM_WARPS)
    return grid, meta


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _triton_version():
    return tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())


# Triton versions whose compiled-kernel launch interface `_Launch` calls directly (checked on
# 3.6 on a GPU, read in 3.9's source); any other version launches through Triton's JIT only.
_DIRECT_LAUNCH = (3, 6) <= _triton_version() <= (3, 9)


def _hook(hook):
    """A launch hook, or None for Triton's hook chain with nothing in it: the launch then
    skips building the metadata that hooks receive (a few microseconds per call)."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


class _Launch:
    """One planned launch of a Triton kernel (grid, scalar arguments and constexprs fixed).

    The first call per pointer alignment and device goes through Triton's JIT, which compiles
    or finds the kernel; later calls hand the compiled kernel its arguments directly. Triton's
    per-call binding and specialization of ~40 arguments costs ~22 us of CPU (measured on an
    H100 host), far more than the ~9 us of the launch itself and than a small RoPE takes on
    the GPU. The direct call passes exactly what Triton's JIT passes, launch hooks
    (profilers) included.
    """

    def __init__(self, fn, grid, scalars, constexprs):
        self.fn, self.grid, self.scalars, self.constexprs = fn, grid, scalars, constexprs
        # Values of the constexpr parameters in signature order (they come last).
        self.constexpr_values = tuple(constexprs[n] for n in fn.arg_names if n in constexprs)
        self.compiled = {}
        self.direct = _DIRECT_LAUNCH and not _interpreting()

    def __call__(self, *tensors):
        global _DIRECT_LAUNCH
        if not (self.direct and _DIRECT_LAUNCH):
            self.fn[self.grid](*tensors, *self.scalars, **self.constexprs)
            return
        active = triton.runtime.driver.active
        device = active.get_current_device()
        # Triton specializes pointer arguments on 16-byte alignment.
        key = (device, *[x is not None and x.data_ptr() % 16 == 0 for x in tensors])
        kernel = self.compiled.get(key)
        if kernel is not None:
            stream = active.get_current_stream(device)
            args = (*tensors, *self.scalars, *self.constexpr_values)
            runtime = triton.knobs.runtime
            enter, leave = _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)
            metadata = (None if enter is None and leave is None
                        else kernel.launch_metadata(self.grid, stream, *args))
            try:
                kernel.run(self.grid[0], self.grid[1], 1, stream, kernel.function,
                           kernel.packed_metadata, metadata, enter, leave, *args)
                return
            except TypeError:      # an interface this code does not know: use the JIT from now on
                _DIRECT_LAUNCH = False
        kernel = self.fn[self.grid](*tensors, *self.scalars, **self.constexprs)
        if all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata")):
            self.compiled[key] = kernel


# Launch plans (validated sizes and a ready `_Launch`), keyed by the metadata
# that the checks and the launch rule read. A repeated call skips both: small RoPE calls take
# a few microseconds on the GPU, so host time per call decides their speed.
_PLANS = {}
_MAX_PLANS = 4096


def _metadata_key(tensors, *values):
    """Everything a plan depends on: tensors' metadata (never their values) and the other
    arguments with their types; None where an argument is not a tensor (the checks will say)."""
    meta = []
    for x in tensors:
        if x is None:
            meta.append(None)
        elif isinstance(x, torch.Tensor):
            meta.append((x.shape, x.stride(), x.dtype, x.device))
        else:
            return None
    return (*meta, *[(v, type(v)) for v in values], _interpreting())


def _cached_plan(key, make):
    """The plan stored under `key`, made (and so validated) on first use."""
    try:
        plan = _PLANS.get(key) if key is not None else None
    except TypeError:        # an unhashable argument: not cacheable, the checks will name it
        key = plan = None
    if plan is None:
        plan = make()
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _make_plan(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
               interleaved, backward, out):
    shape = check_rope_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size,
                            cp_rank, interleaved)
    in_place = out is t
    if in_place and _overlaps_itself(t):
        raise ValueError("in-place RoPE needs t without overlapping memory (e.g. not an "
                         "expanded tensor)")
    x_strides = _token_strides(t, tensor_format)
    out_strides = x_strides if in_place else (
        _token_strides(out, tensor_format) if out is not None else
        _token_strides(torch.empty(t.shape, device="meta"), tensor_format))
    widest = max((shape.nheads - 1) * abs(s_h) + (shape.head_dim - 1) * abs(s_d)
                 for _, _, s_h, s_d in (x_strides, out_strides))
    is_thd = tensor_format == "thd"
    grid, meta = launch_config(shape, t.device, copy_pass=not in_place)
    scalars = (shape.num_tokens, shape.seq_len, shape.batch, shape.nheads, shape.rotary_dim, shape.head_dim, freqs.shape[0], shape.batch,
               max(shape.batch, 1).bit_length() if is_thd else 0, cp_size, cp_rank,
               *x_strides, *out_strides, freqs.stride(0), freqs.stride(3))
    constexprs = dict(INTERLEAVED=interleaved, BACKWARD=backward, IS_THD=is_thd,
                      SEQ_MAJOR=tensor_format == "sbhd", HAS_START=start_positions is not None,
                      WIDE_INNER=widest > _INT32_MAX, **meta)
    return t.numel() == 0, _Launch(rotary_kernel, grid, scalars, constexprs)



def set_rotary_kernel(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                      cu_seqlens=None, cp_size=1, cp_rank=0, backward=False, out=None):
    """Check the arguments, allocate the output, set up the grid and launch `rotary_kernel`.

    `t` may have any strides; the result is contiguous in `t`'s format and dtype. With
    `backward=True`, `t` is the gradient of the output and the result the gradient of the
    input. `out=t` rotates in place (channels past d2 are not touched); `t` must then not
    overlap itself in memory.
    """
    # freqs is used as float32 (cast, as TE does); the index tensors are read with unit stride.
    if isinstance(freqs, torch.Tensor) and freqs.is_floating_point() and freqs.dtype != torch.float32:
        freqs = freqs.float()
    if isinstance(start_positions, torch.Tensor):
        start_positions = start_positions.contiguous()
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.contiguous()
    key = _metadata_key((t, freqs, start_positions, cu_seqlens, None if out is t else out), "rope",
                        tensor_format, interleaved, cp_size, cp_rank, backward, out is t)
    plan = _cached_plan(key, lambda: _make_plan(t, freqs, tensor_format, start_positions,
                                                cu_seqlens, cp_size, cp_rank, interleaved,
                                                backward, out))
    empty, launch = plan
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if not empty:
        launch(out, t, freqs, start_positions, cu_seqlens)
    return out


def check_qkv_args(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                   cp_size, cp_rank, interleaved, need_kernel=True):
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
    shape = None
    for name, freqs in (("q_freqs", q_freqs), ("k_freqs", k_freqs)):
        try:
            shape = check_rope_args(key_part, freqs, tensor_format, start_positions, None,
                                    cp_size, cp_rank, interleaved, need_kernel)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("freqs", name, 1)) from None
    if q_freqs.shape[-1] != k_freqs.shape[-1]:
        raise ValueError(f"q_freqs and k_freqs must rotate the same number of channels, got "
                         f"{q_freqs.shape[-1]} and {k_freqs.shape[-1]}")
    return shape, tuple(split)


def _seq_batch_strides(x: torch.Tensor, tensor_format: str):
    return (x.stride(0), x.stride(1)) if tensor_format == "sbhd" else (x.stride(1), x.stride(0))


def _qkv_views(qkv, split, grads, result):
    """(q, k, v) in and out views for the kernel: q as [.., kv heads, q heads per kv, d]."""
    q_dim, k_dim, _ = split
    q_per_kv, kv_heads = q_dim // k_dim, qkv.shape[2]
    packed = qkv if grads is None else result
    q_packed = packed[..., :q_dim].unflatten(-1, (q_per_kv, k_dim))
    k_packed, v_packed = packed[..., q_dim:q_dim + k_dim], packed[..., q_dim + k_dim:]
    if grads is None:
        return (q_packed, result[0].unflatten(2, (kv_heads, q_per_kv)), k_packed, result[1],
                v_packed, result[2])
    dq, dk, dv = grads
    return dq.unflatten(2, (kv_heads, q_per_kv)), q_packed, dk, k_packed, dv, v_packed


def _qkv_outputs(qkv, split, grads):
    lead, kv_heads = qkv.shape[:2], qkv.shape[2]
    new = functools.partial(torch.empty, dtype=qkv.dtype, device=qkv.device)
    if grads is not None:
        return new(qkv.shape)
    q_dim, k_dim, v_dim = split
    return (new(*lead, kv_heads * (q_dim // k_dim), k_dim), new(*lead, kv_heads, k_dim),
            new(*lead, kv_heads, v_dim))


def _make_qkv_plan(qkv, q_freqs, k_freqs, split, tensor_format, start_positions, interleaved,
                   cp_size, cp_rank, grads):
    shape, split = check_qkv_args(qkv, q_freqs, k_freqs, split, tensor_format, start_positions,
                                  cp_size, cp_rank, interleaved)
    q_dim, k_dim, v_dim = split
    kv_heads, q_per_kv = qkv.shape[2], q_dim // k_dim
    if grads is not None:
        want = [(*qkv.shape[:2], kv_heads * q_per_kv, k_dim), (*qkv.shape[:2], kv_heads, k_dim),
                (*qkv.shape[:2], kv_heads, v_dim)]
        for name, g, shp in zip(("dq", "dk", "dv"), grads, want):
            if tuple(g.shape) != shp or g.dtype != qkv.dtype or g.device != qkv.device:
                raise ValueError(f"{name} must have shape {shp}, dtype {qkv.dtype} and device "
                                 f"{qkv.device}, got {tuple(g.shape)} {g.dtype} {g.device}")
    views = _qkv_views(qkv, split, grads, _qkv_outputs(qkv.to("meta"), split, grads))
    widest = max(sum((n - 1) * abs(st) for n, st in zip(x.shape[2:], x.stride()[2:])) for x in views)
    # Tiles sized for the query heads; a key program takes as many kv heads (key and value)
    # as keep its tile no larger than a query tile.
    grid, meta = launch_config(shape._replace(nheads=kv_heads * q_per_kv), qkv.device,
                               copy_pass=True)
    row = 2 * meta["BLOCK_HALF"] + meta["BLOCK_PASS"]
    block_v = triton.next_power_of_2(v_dim)
    block_kv = min(meta["BLOCK_H"], triton.next_power_of_2(kv_heads))
    while block_kv > 1 and block_kv * (row + block_v) > meta["BLOCK_H"] * row:
        block_kv //= 2
    q_programs = triton.cdiv(kv_heads * q_per_kv, meta["BLOCK_H"])
    k_programs = triton.cdiv(kv_heads, block_kv)
    # (seq, batch, then the remaining dims) strides of each view, in the kernel's order.
    strides = [s for x in views for s in (*_seq_batch_strides(x, tensor_format), *x.stride()[2:])]
    scalars = (shape.num_tokens, shape.seq_len, shape.batch, kv_heads, q_per_kv, shape.rotary_dim,
               k_dim, v_dim, q_freqs.shape[0], k_freqs.shape[0], cp_size, cp_rank, q_programs,
               *strides, q_freqs.stride(0), q_freqs.stride(3), k_freqs.stride(0),
               k_freqs.stride(3))
    constexprs = dict(BLOCK_KV=block_kv, BLOCK_V=block_v,
                      BACKWARD=grads is not None, SEQ_MAJOR=tensor_format == "sbhd",
                      HAS_START=start_positions is not None, INTERLEAVED=interleaved,
                      WIDE_INNER=widest > _INT32_MAX, **meta)
    return split, qkv.numel() == 0, _Launch(rotary_qkv_kernel, (grid[0], q_programs + k_programs),
                                            scalars, constexprs)


def set_rotary_qkv_kernel(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                          start_positions=None, interleaved=False, cp_size=1, cp_rank=0,
                          grads=None):
    """Fused QKV RoPE in one launch. Forward (grads=None): qkv [s, b, h_kv, q+k+v] (or bshd)
    -> (q [.., h_kv*q/d, d], k [.., h_kv, d], v [.., h_kv, v]), contiguous. Backward
    (grads=(dq, dk, dv), any strides): -> the packed gradient of qkv, contiguous."""
    if isinstance(q_freqs, torch.Tensor) and q_freqs.is_floating_point():
        q_freqs = q_freqs.float()
    if isinstance(k_freqs, torch.Tensor) and k_freqs.is_floating_point():
        k_freqs = k_freqs.float()
    if isinstance(start_positions, torch.Tensor):
        start_positions = start_positions.contiguous()
    split = tuple(qkv_split_arg_list) if isinstance(qkv_split_arg_list, (list, tuple)) else qkv_split_arg_list
    key = _metadata_key((qkv, q_freqs, k_freqs, start_positions, *(grads or ())), "qkv", split,
                        tensor_format, interleaved, cp_size, cp_rank, grads is None)
    split, empty, launch = _cached_plan(key, lambda: _make_qkv_plan(
        qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
        cp_size, cp_rank, grads))
    result = _qkv_outputs(qkv, split, grads)
    if not empty:
        q_in, q_out, k_in, k_out, v_in, v_out = _qkv_views(qkv, split, grads, result)
        launch(q_out, k_out, v_out, q_in, k_in, v_in, q_freqs, k_freqs, start_positions)
    return result
