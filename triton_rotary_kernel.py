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


# float32 sin and cos sharing one argument reduction, as CUDA's own sincosf does: x = j*pi/2 + r
# with |r| <= pi/4 by a three-part Cody-Waite reduction (exact products inside the FMAs), then
# minimax polynomials on r and a quadrant swap. Accurate to a couple of ulp for
# |x| <= _SINCOS_FAST_LIMIT; a program with any larger angle takes libdevice's sin/cos instead.
_SINCOS_FAST_LIMIT = tl.constexpr(105615.0)
_TWO_OVER_PI = tl.constexpr(0.636619772367581343)
_PIO2_1 = tl.constexpr(1.5707962513e+00)
_PIO2_2 = tl.constexpr(7.5497894159e-08)
_PIO2_3 = tl.constexpr(5.3903029534e-15)


@triton.jit
def _sincos(x):
    if tl.max(tl.max(tl.abs(x), axis=1), axis=0) > _SINCOS_FAST_LIMIT:
        s = tl.sin(x)
        c = tl.cos(x)
    else:
        j = tl.floor(x * _TWO_OVER_PI + 0.5)
        r = tl.fma(-j, _PIO2_1, x)
        r = tl.fma(-j, _PIO2_2, r)
        r = tl.fma(-j, _PIO2_3, r)
        r2 = r * r
        sin_r = tl.fma(tl.fma(tl.fma(-1.9515295891e-4, r2, 8.3321608736e-3), r2, -1.6666654611e-1), r2 * r, r)
        cos_r = tl.fma(tl.fma(tl.fma(tl.fma(2.443315711809948e-5, r2, -1.388731625493765e-3), r2,
                                     4.166664568298827e-2), r2, -0.5), r2, 1.0)
        q = j.to(tl.int32) & 3
        swap = (q & 1) != 0
        s = tl.where(swap, cos_r, sin_r)
        c = tl.where(swap, sin_r, cos_r)
        s = tl.where(q >= 2, -s, s)
        c = tl.where((q == 1) | (q == 2), -c, c)
    return s, c


@triton.jit(do_not_specialize=["num_tokens", "seq_len", "batch", "num_seqs", "search_steps",
                               "cp_size", "cp_rank", "freqs_len"])
def rotary_kernel(
    OUT, X, FREQS, START_POSITIONS, CU_SEQLENS,
    num_tokens, seq_len, batch, nheads, heads_per_program, rotary_dim, head_dim,
    freqs_len,
    num_seqs, search_steps, cp_size, cp_rank,
    stride_x_seq, stride_x_batch, stride_x_head, stride_x_dim,
    stride_out_seq, stride_out_batch, stride_out_head, stride_out_dim,
    stride_freqs_seq, stride_freqs_dim,
    BLOCK_T: tl.constexpr,       # tokens per program
    BLOCK_H: tl.constexpr,       # heads per step of the loop over a program's heads
    BLOCK_HALF: tl.constexpr,    # power of two >= rotary_dim // 2
    BLOCK_PASS: tl.constexpr,    # chunk of the pass-through channels (past rotary_dim)
    PASS_STEPS: tl.constexpr,    # chunks to copy; 0 in place (those channels stay put)
    HEAD_STEPS: tl.constexpr,    # > 0: unroll the head loop that many steps; 0: runtime loop
    FAST_SINCOS: tl.constexpr,   # float32 sincos with a shared reduction (else libdevice)
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr,
    SEQ_MAJOR: tl.constexpr,     # token index is seq-major (sbhd) or batch-major (bshd)
    HAS_START: tl.constexpr,
    WIDE_INNER: tl.constexpr,    # offsets inside one token may exceed int32 (exotic strides)
):
    # A program owns BLOCK_T tokens and `heads_per_program` of their heads, and walks the heads
    # in tiles [BLOCK_T, BLOCK_H, channels]. cos/sin depend on (token, channel) only: they are
    # computed once per program and shared by all its heads.
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    half = rotary_dim // 2
    compute_dtype = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32

    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)                       # [T]
    tok_ok = tok < num_tokens
    tok = tl.minimum(tok, num_tokens - 1)

    # Sequence index of each token within its sequence (`seq_idx`), the sequence (`batch_idx`)
    # and that sequence's local length.
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
        # Tokens outside every sequence (before cu_seqlens[0] or from cu_seqlens[-1] on) are
        # copied through unchanged.
        in_seq = (tok >= seq_start) & (tok < seq_end)
        seq_idx = tok - seq_start
        local_len = seq_end - seq_start
        x_row = tok.to(tl.int64) * stride_x_seq
        out_row = tok.to(tl.int64) * stride_out_seq
    else:
        if SEQ_MAJOR:
            seq_idx = tok // batch
            batch_idx = tok % batch
        else:
            batch_idx = tok // seq_len
            seq_idx = tok % seq_len
        local_len = seq_len
        in_seq = tok_ok  # unused outside thd
        x_row = seq_idx.to(tl.int64) * stride_x_seq + batch_idx.to(tl.int64) * stride_x_batch
        out_row = seq_idx.to(tl.int64) * stride_out_seq + batch_idx.to(tl.int64) * stride_out_batch

    # Position of each token in the full sequence. Context parallelism (TE's load-balanced
    # split): the global sequence is cut into 2*cp_size chunks and rank r holds chunks r and
    # 2*cp_size-1-r, so the second half of the local tokens jumps ahead.
    pos = seq_idx
    if cp_size > 1:
        half_len = local_len // 2
        pos = tl.where(seq_idx < half_len, seq_idx + cp_rank * half_len,
                       seq_idx + cp_size * local_len - (cp_rank + 2) * half_len)
    if HAS_START:
        pos = pos + tl.load(START_POSITIONS + tl.minimum(batch_idx, num_seqs - 1))
    pos_ok = (pos >= 0) & (pos < freqs_len)
    freqs_row = tl.where(pos_ok, pos, 0).to(tl.int64) * stride_freqs_seq    # [T]

    offs_k = tl.arange(0, BLOCK_HALF)
    offs_d = tl.arange(0, 2 * BLOCK_HALF)
    offs_p = tl.arange(0, BLOCK_PASS)
    mask_k = (offs_k < half)[None, :]                                       # [1, K]
    mask_d = (offs_d < rotary_dim)[None, :]                                 # [1, 2K]
    if WIDE_INNER:
        offs_k = offs_k.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
        offs_p = offs_p.to(tl.int64)

    # Angles of the two members of each pair: channels (k, k + half) for rotate-half,
    # (2k, 2k + 1) interleaved. Interleaved tiles are loaded contiguously (vectorisable) and
    # split even/odd in registers rather than gathered with stride 2.
    f_base = FREQS + freqs_row[:, None]
    if INTERLEAVED:
        f = tl.load(f_base + offs_d[None, :] * stride_freqs_dim, mask=mask_d, other=0.0)
        f1, f2 = tl.split(tl.reshape(f.to(compute_dtype), [BLOCK_T, BLOCK_HALF, 2]))
    else:
        f1 = tl.load(f_base + offs_k[None, :] * stride_freqs_dim, mask=mask_k, other=0.0)
        f2 = tl.load(f_base + (offs_k + half)[None, :] * stride_freqs_dim, mask=mask_k, other=0.0)
        f1 = f1.to(compute_dtype)
        f2 = f2.to(compute_dtype)
    # sin/cos cost tens of instructions each: they are computed once per (token, channel)
    # here and reused for every head below. A position outside freqs has no defined rotation:
    # NaN, rather than an out-of-bounds read or a silently clamped angle.
    if FAST_SINCOS:
        sin1, cos1 = _sincos(f1)
        sin2, cos2 = _sincos(f2)
    else:
        sin1, cos1 = tl.sin(f1), tl.cos(f1)
        sin2, cos2 = tl.sin(f2), tl.cos(f2)
    nan = tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    cos1 = tl.where(pos_ok[:, None], cos1, nan)[:, None, :]                  # [T, 1, K]
    cos2 = tl.where(pos_ok[:, None], cos2, nan)[:, None, :]
    if BACKWARD:
        sin_a = -sin2[:, None, :]
        sin_b = -sin1[:, None, :]
    else:
        sin_a = sin1[:, None, :]
        sin_b = sin2[:, None, :]

    head_start = pid_h * heads_per_program
    head_end = tl.minimum(head_start + heads_per_program, nheads)
    if HEAD_STEPS > 0:
        # Unrolled: the loads of every step can be issued before the sin/cos are ready.
        for i in tl.static_range(HEAD_STEPS):
            _rotate_heads(OUT, X, x_row, out_row, head_start + i * BLOCK_H, head_end, tok_ok,
                          in_seq, cos1, cos2, sin_a, sin_b, half, rotary_dim, head_dim,
                          stride_x_head, stride_x_dim, stride_out_head, stride_out_dim,
                          offs_k, offs_d, offs_p, mask_k, mask_d, compute_dtype, BLOCK_T,
                          BLOCK_H, BLOCK_HALF, BLOCK_PASS, PASS_STEPS, INTERLEAVED, IS_THD,
                          WIDE_INNER)
    else:
        for h0 in range(head_start, head_end, BLOCK_H):
            _rotate_heads(OUT, X, x_row, out_row, h0, head_end, tok_ok,
                          in_seq, cos1, cos2, sin_a, sin_b, half, rotary_dim, head_dim,
                          stride_x_head, stride_x_dim, stride_out_head, stride_out_dim,
                          offs_k, offs_d, offs_p, mask_k, mask_d, compute_dtype, BLOCK_T,
                          BLOCK_H, BLOCK_HALF, BLOCK_PASS, PASS_STEPS, INTERLEAVED, IS_THD,
                          WIDE_INNER)


@triton.jit
def _rotate_heads(OUT, X, x_row, out_row, h0, head_end, tok_ok, in_seq, cos1, cos2, sin_a, sin_b,
                  half, rotary_dim, head_dim, stride_x_head, stride_x_dim, stride_out_head,
                  stride_out_dim, offs_k, offs_d, offs_p, mask_k, mask_d,
                  compute_dtype: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, PASS_STEPS: tl.constexpr,
                  INTERLEAVED: tl.constexpr, IS_THD: tl.constexpr, WIDE_INNER: tl.constexpr):
    """One step: rotate heads h0 .. h0 + BLOCK_H of the program's BLOCK_T tokens."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_th = tok_ok[:, None, None] & (offs_h < head_end)[None, :, None]      # [T, H, 1]
    if WIDE_INNER:
        offs_h = offs_h.to(tl.int64)
    x_base = X + x_row[:, None, None] + offs_h[None, :, None] * stride_x_head     # [T, H, 1]
    out_base = OUT + out_row[:, None, None] + offs_h[None, :, None] * stride_out_head
    out_ty = OUT.dtype.element_ty

    for i in tl.static_range(PASS_STEPS):
        dims = rotary_dim + i * BLOCK_PASS + offs_p
        mp = mask_th & (dims < head_dim)[None, None, :]
        xp = tl.load(x_base + dims[None, None, :] * stride_x_dim, mask=mp)
        tl.store(out_base + dims[None, None, :] * stride_out_dim, xp, mask=mp)

    if INTERLEAVED:
        m = mask_th & mask_d[None, :, :]
        x = tl.load(x_base + offs_d[None, None, :] * stride_x_dim, mask=m, other=0.0)
        x1, x2 = tl.split(tl.reshape(x.to(compute_dtype), [BLOCK_T, BLOCK_H, BLOCK_HALF, 2]))
    else:
        m = mask_th & mask_k[None, :, :]
        x1_ptrs = x_base + offs_k[None, None, :] * stride_x_dim
        x1 = tl.load(x1_ptrs, mask=m, other=0.0).to(compute_dtype)
        x2 = tl.load(x1_ptrs + half * stride_x_dim, mask=m, other=0.0).to(compute_dtype)
    out1 = x1 * cos1 - x2 * sin_a
    out2 = x2 * cos2 + x1 * sin_b
    if IS_THD:
        out1 = tl.where(in_seq[:, None, None], out1, x1)
        out2 = tl.where(in_seq[:, None, None], out2, x2)
    if INTERLEAVED:
        out = tl.reshape(tl.join(out1, out2), [BLOCK_T, BLOCK_H, 2 * BLOCK_HALF])
        tl.store(out_base + offs_d[None, None, :] * stride_out_dim, out.to(out_ty), mask=m)
    else:
        out1_ptrs = out_base + offs_k[None, None, :] * stride_out_dim
        tl.store(out1_ptrs, out1.to(out_ty), mask=m)
        tl.store(out1_ptrs + half * stride_out_dim, out2.to(out_ty), mask=m)


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
# Launch knobs (measured on H100/H200, see README): tokens per program, elements of one
# step of the head loop (enough 16-byte accesses in flight per thread, few registers), and
# the fewest programs per SM before a token block's heads are split over programs.
TOKENS_PER_PROGRAM = 8
STEP_ELEMENTS = 4096
MIN_PROGRAMS_PER_SM = 4
UNROLL_HEADS = False
FAST_SINCOS = True
# The interpreter runs each program in Python: fewer, larger programs run much faster there.
INTERPRETER_TILE_ELEMENTS = 1 << 16
INTERPRETER_MIN_PROGRAMS = 0
NUM_WARPS = 4


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


def launch_config(shape: RopeShape, device: torch.device, dtype: torch.dtype, copy_pass: bool):
    """Tile sizes, grid and warps for one call: a pure function of the sizes (no autotuning,
    so nothing recompiles when the sequence length changes)."""
    block_half = triton.next_power_of_2(shape.rotary_dim // 2)
    row = 2 * block_half                                 # rotary channels of one (token, head)
    if _interpreting():
        # Every program runs in Python: few, large programs.
        tokens_per_program, step = INTERPRETER_TILE_ELEMENTS // row, INTERPRETER_TILE_ELEMENTS
        min_programs = INTERPRETER_MIN_PROGRAMS
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        tokens_per_program, step = TOKENS_PER_PROGRAM, STEP_ELEMENTS
        min_programs = MIN_PROGRAMS_PER_SM * _num_sms(index)
    block_t = min(triton.next_power_of_2(shape.num_tokens), 1 << (max(1, tokens_per_program).bit_length() - 1))
    block_h = min(triton.next_power_of_2(shape.nheads), 1 << (max(1, step // (row * block_t)).bit_length() - 1))
    # Split a token block's heads over several programs only when there are too few token
    # blocks to fill the GPU.
    token_blocks = triton.cdiv(shape.num_tokens, block_t)
    head_steps = triton.cdiv(shape.nheads, block_h)
    splits = max(1, min(head_steps, triton.cdiv(min_programs, token_blocks)))
    heads_per_program = block_h * triton.cdiv(head_steps, splits)
    # Channels past rotary_dim are copied in an unrolled loop of PASS_STEPS chunks, so that
    # their loads are in flight together with the rotary ones.
    pass_dims = shape.head_dim - shape.rotary_dim if copy_pass else 0
    block_pass = min(triton.next_power_of_2(max(pass_dims, 1)), 256)
    pass_steps = triton.cdiv(pass_dims, block_pass)
    grid = (token_blocks, triton.cdiv(shape.nheads, heads_per_program))
    head_steps_unrolled = triton.cdiv(heads_per_program, block_h) if UNROLL_HEADS else 0
    meta = dict(BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
                PASS_STEPS=pass_steps,
                HEAD_STEPS=head_steps_unrolled, FAST_SINCOS=FAST_SINCOS and dtype != torch.float64,
                num_warps=NUM_WARPS)
    return grid, heads_per_program, meta


def set_rotary_kernel(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                      cu_seqlens=None, cp_size=1, cp_rank=0, backward=False, out=None):
    """Check the arguments, allocate the output, set up the grid and launch `rotary_kernel`.

    `t` may have any strides; the result is contiguous in `t`'s format and dtype. With
    `backward=True`, `t` is the gradient of the output and the result the gradient of the
    input. `out=t` rotates in place (channels past d2 are not touched); `t` must then not
    overlap itself in memory.
    """
    shape = check_rope_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size,
                            cp_rank, interleaved)
    in_place = out is t
    if in_place:
        if _overlaps_itself(t):
            raise ValueError("in-place RoPE needs t without overlapping memory (e.g. not an "
                             "expanded tensor)")
    elif out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.numel() == 0:
        return out
    if freqs.dtype != torch.float32:
        freqs = freqs.float()
    # The kernel indexes these with unit stride (freqs, with any strides, it reads as strided).
    if start_positions is not None:
        start_positions = start_positions.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()

    x_strides = _token_strides(t, tensor_format)
    out_strides = _token_strides(out, tensor_format)
    widest = max(
        (shape.nheads - 1) * abs(s_h) + (shape.head_dim - 1) * abs(s_d)
        for _, _, s_h, s_d in (x_strides, out_strides))
    is_thd = tensor_format == "thd"
    num_seqs = shape.batch
    grid, heads_per_program, meta = launch_config(shape, t.device, t.dtype, copy_pass=not in_place)
    rotary_kernel[grid](
        out, t, freqs, start_positions, cu_seqlens,
        shape.num_tokens, shape.seq_len, shape.batch, shape.nheads, heads_per_program,
        shape.rotary_dim, shape.head_dim, freqs.shape[0],
        num_seqs, max(num_seqs, 1).bit_length() if is_thd else 0, cp_size, cp_rank,
        *x_strides, *out_strides, freqs.stride(0), freqs.stride(3),
        INTERLEAVED=interleaved, BACKWARD=backward, IS_THD=is_thd,
        SEQ_MAJOR=tensor_format == "sbhd", HAS_START=start_positions is not None,
        WIDE_INNER=widest > _INT32_MAX, **meta)
    return out
