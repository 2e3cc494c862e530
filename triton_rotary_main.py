"""Public API: a drop-in for Transformer Engine's `apply_rotary_pos_emb` and
`RotaryPositionEmbedding`, backed by the Triton kernel in `triton_rotary_kernel.py`.

    freqs = RotaryPositionEmbedding(128)(max_seq_len=4096)          # [s2, 1, 1, d2] float32
    q = apply_rotary_pos_emb(q, freqs, tensor_format="sbhd")          # Triton, autograd-aware
    q_ref = apply_rotary_pos_emb(q, freqs, fused=False)               # pure-PyTorch formula
"""

from typing import Optional

import torch

from triton_rotary_kernel import (check_qkv_args, check_rope_args, set_rotary_kernel,
                                  set_rotary_qkv_kernel)

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_inplace", "apply_fused_qkv_rotary_pos_emb",
           "RopeForwardAndBackward", "FusedQKVRopeForwardAndBackward", "RotaryPositionEmbedding",
           "token_positions"]


class RotaryPositionEmbedding(torch.nn.Module):
    """Rotary frequencies as TE's module builds them: `forward(max_seq_len, offset=0)` returns
    float32 `[max_seq_len, 1, 1, d2]` with d2 = int(dim * rotary_percent), laid out for the
    rotate-half (`interleaved=False`) or adjacent-pair (`interleaved=True`) form."""

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False,
                 device: Optional[torch.device] = None):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.rotary_base = rotary_base
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        # theta_i = base^(-2i/dim), one per rotated pair
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=self.inv_freq.device) + offset
        factor = self.seq_len_interpolation_factor
        if self.pretrained_max_position_embeddings is not None and factor is not None:
            # Position interpolation (arXiv:2306.15595): fixed linear scaling up to the trained
            # length times the factor, dynamic scaling beyond it.
            if max_seq_len > self.pretrained_max_position_embeddings * factor:
                positions *= 1 / (max_seq_len / self.pretrained_max_position_embeddings)
            else:
                positions *= 1 / factor
        angles = torch.outer(positions, self.inv_freq)
        if self.interleaved:
            emb = angles.repeat_interleave(2, dim=-1)       # theta_0, theta_0, theta_1, ...
        else:
            emb = torch.cat((angles, angles), dim=-1)       # theta_0..theta_{n-1}, twice
        return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


class RopeForwardAndBackward(torch.autograd.Function):
    """Autograd wiring: forward and backward are both one launch of `rotary_kernel`."""

    @staticmethod
    def forward(ctx, t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                cp_size, cp_rank):
        out = _rope_launch(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved,
                           False, cp_size, cp_rank)
        ctx.save_for_backward(freqs, start_positions, cu_seqlens)
        ctx.args = (tensor_format, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        freqs, start_positions, cu_seqlens = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.args
        grad_t = _rope_launch(grad_out, freqs, start_positions, cu_seqlens, tensor_format,
                              interleaved, True, cp_size, cp_rank)
        return grad_t, None, None, None, None, None, None, None


# The kernel as a torch.library op, so that torch.compile(fullgraph=True) sees one opaque,
# shape-polymorphic node instead of tracing (and specialising on) the launcher's Python.
@torch.library.custom_op("triton_rotary::rope", mutates_args=())
def _rope_op(t: torch.Tensor, freqs: torch.Tensor, start_positions: Optional[torch.Tensor],
             cu_seqlens: Optional[torch.Tensor], tensor_format: str, interleaved: bool,
             backward: bool, cp_size: int, cp_rank: int) -> torch.Tensor:
    return set_rotary_kernel(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                             cp_size, cp_rank, backward=backward)


@_rope_op.register_fake
def _(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved, backward, cp_size,
      cp_rank):
    check_rope_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
                    interleaved, need_kernel=False)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _rope_launch(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved, backward,
                 cp_size, cp_rank):
    if torch.compiler.is_compiling():
        return _rope_op(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved,
                        backward, cp_size, cp_rank)
    # Eager: call the launcher directly, sparing the dispatcher's per-call overhead.
    return set_rotary_kernel(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                             cp_size, cp_rank, backward=backward)


def token_positions(shape, tensor_format, start_positions=None, cu_seqlens=None, cp_size=1,
                    cp_rank=0, device=None):
    """Position (row of freqs) of every token, and whether the token belongs to a sequence.

    Returns `(pos, in_seq)`, int64 and bool, shaped to broadcast against t without its
    [h, d] dims: [s, b] for sbhd, [b, s] for bshd, [t] for thd. Pure PyTorch, no host sync.
    """
    if tensor_format == "thd":
        num_tokens = shape.num_tokens
        starts = cu_seqlens.long() // cp_size                               # local offsets
        tok = torch.arange(num_tokens, device=device)
        seq = torch.searchsorted(starts, tok, right=True) - 1
        seq_c = seq.clamp(0, shape.batch - 1)
        local_idx = tok - starts[seq_c]
        local_len = starts[seq_c + 1] - starts[seq_c]
        in_seq = (seq >= 0) & (seq < shape.batch) & (local_idx < local_len)
    else:
        local_idx = torch.arange(shape.seq_len, device=device)[:, None]     # [s, 1]
        local_len = shape.seq_len
        seq_c = torch.arange(shape.batch, device=device)[None, :]           # [1, b]
        in_seq = torch.ones((), dtype=torch.bool, device=device)
    pos = local_idx
    if cp_size > 1:
        # TE's load-balanced split: rank r holds chunks r and 2*cp_size-1-r of the sequence.
        half_len = local_len // 2
        pos = torch.where(local_idx < half_len, local_idx + cp_rank * half_len,
                          local_idx + cp_size * local_len - (cp_rank + 2) * half_len)
    if start_positions is not None:
        pos = pos + start_positions.long()[seq_c]
    if tensor_format != "thd":
        pos = pos.expand(shape.seq_len, shape.batch)
        if tensor_format == "bshd":
            pos = pos.t()
    return pos, in_seq


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] for the halves (x1, x2), or per adjacent pair when interleaved."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _unfused_rope(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                  cp_rank):
    """TE's unfused formula in plain PyTorch ops (autograd by PyTorch): cos/sin in float32,
    cast to t's dtype, then t * cos + rotate_half(t) * sin on the first d2 channels.
    Same conventions as the kernel off the happy path: tokens outside every thd sequence pass
    through; tokens whose position falls outside freqs get NaN in their rotated channels."""
    shape = check_rope_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size,
                            cp_rank, interleaved, need_kernel=False)
    pos, in_seq = token_positions(shape, tensor_format, start_positions, cu_seqlens, cp_size,
                                  cp_rank, device=t.device)
    table = freqs.float()[:, 0, 0, :]                                  # [s2, d2]
    pos_ok = (pos >= 0) & (pos < table.shape[0])
    angles = table[pos.clamp(0, table.shape[0] - 1)]                   # [..., d2]
    angles = torch.where(pos_ok[..., None], angles, float("nan"))
    cos = torch.cos(angles).to(t.dtype)[..., None, :]                  # broadcast over heads
    sin = torch.sin(angles).to(t.dtype)[..., None, :]
    rot, rest = t[..., :shape.rotary_dim], t[..., shape.rotary_dim:]
    rotated = rot * cos + _rotate_half(rot, interleaved) * sin
    if tensor_format == "thd":
        rotated = torch.where(in_seq[:, None, None], rotated, rot)
    return torch.cat((rotated, rest), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None,
                         interleaved: bool = False, fused: bool = True,
                         cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    """Apply rotary position embedding to `t` (Transformer Engine's signature and semantics).

    t:               [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd); float32,
                     float16, bfloat16 (float64 also works, computed in float64). Any strides.
    freqs:           [s2, 1, 1, d2] angles, d2 even and <= d, s2 >= s * cp_size. Used as
                     float32 (other floating dtypes are cast, as TE does); any strides.
    start_positions: int32/int64 [b]: token j of sequence i uses position j + start_positions[i].
    interleaved:     rotate adjacent pairs (GPT-J) instead of the two halves (GPT-NeoX).
    fused:           True runs the Triton kernel; False the PyTorch formula.
    cu_seqlens:      int32/int64 [b + 1], thd only: sequence i is tokens cu[i]..cu[i+1]
                     (padded global offsets under context parallelism: a rank holds
                     cu // cp_size).
    cp_size/cp_rank: context parallelism with TE's load-balanced split.

    Returns a new contiguous tensor of t's shape and dtype; channels d2..d are copied.
    Off the happy path (defined here, unlike TE): thd tokens outside every sequence (before
    cu_seqlens[0] or from cu_seqlens[-1] on) are returned unchanged; a token whose position
    falls outside [0, s2) (too large start_positions, inconsistent cu_seqlens) gets NaN in
    its rotated channels rather than reading out of bounds.
    """
    if not fused:
        return _unfused_rope(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                             cp_size, cp_rank)
    return RopeForwardAndBackward.apply(t, freqs, tensor_format, start_positions, interleaved,
                                        cu_seqlens, cp_size, cp_rank)


def apply_rotary_pos_emb_inplace(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                                 start_positions: Optional[torch.Tensor] = None,
                                 interleaved: bool = False,
                                 cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                                 cp_rank: int = 0) -> torch.Tensor:
    """Inference path: rotate `t` in its own storage and return it. Only the first d2 channels
    of each head are read and written; `t` may be a strided view (e.g. q inside a packed qkv
    buffer) but must not overlap itself. Same arguments and semantics as
    `apply_rotary_pos_emb`; no autograd (use it under torch.no_grad() / inference_mode())."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError("apply_rotary_pos_emb_inplace is for inference: t requires grad; use "
                         "apply_rotary_pos_emb, or call it under torch.no_grad()")
    return set_rotary_kernel(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                             cp_size, cp_rank, out=t)


class FusedQKVRopeForwardAndBackward(torch.autograd.Function):
    """Fused QKV: one launch forward (packed qkv -> q, k, v), one launch backward."""

    @staticmethod
    def forward(ctx, qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                interleaved, cp_size, cp_rank):
        args = (tensor_format, start_positions, interleaved, cp_size, cp_rank)
        ctx.save_for_backward(qkv, q_freqs, k_freqs, start_positions)
        ctx.args = (list(qkv_split_arg_list), tensor_format, interleaved, cp_size, cp_rank)
        return set_rotary_qkv_kernel(qkv, q_freqs, k_freqs, list(qkv_split_arg_list), *args)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, q_freqs, k_freqs, start_positions = ctx.saved_tensors
        split, tensor_format, interleaved, cp_size, cp_rank = ctx.args
        dqkv = set_rotary_qkv_kernel(qkv, q_freqs, k_freqs, split, tensor_format, start_positions,
                                     interleaved, cp_size, cp_rank, grads=(dq, dk, dv))
        return dqkv, None, None, None, None, None, None, None, None


def _unfused_qkv(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                 interleaved, cp_size, cp_rank):
    check_qkv_args(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                   cp_size, cp_rank, interleaved, need_kernel=False)
    q, k, v = torch.split(qkv, list(qkv_split_arg_list), dim=-1)
    q = q.reshape(*q.shape[:2], -1, qkv_split_arg_list[1])
    rope = lambda x, f: _unfused_rope(x, f, tensor_format, start_positions, interleaved, None,  # noqa: E731
                                      cp_size, cp_rank)
    return rope(q, q_freqs), rope(k, k_freqs), v.contiguous()


def apply_fused_qkv_rotary_pos_emb(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                                   qkv_split_arg_list, tensor_format: str = "sbhd",
                                   start_positions: Optional[torch.Tensor] = None,
                                   interleaved: bool = False, cp_size: int = 1, cp_rank: int = 0,
                                   fused: bool = True):
    """RoPE on a fused QKV projection (TE's `apply_fused_qkv_rotary_pos_emb`).

    qkv: [s, b, h_kv, q + k + v] (sbhd) or [b, s, h_kv, q + k + v] (bshd), split along the last
    dim by `qkv_split_arg_list` = [q, k, v] with k the head dim d and q a multiple of it.
    Returns contiguous q [.., h_kv * q / d, d] rotated with q_freqs, k [.., h_kv, d] rotated with
    k_freqs, and v [.., h_kv, v] unchanged: one kernel launch forward and one backward (which
    writes the packed gradient of qkv). Other arguments as in `apply_rotary_pos_emb`.
    """
    fn = FusedQKVRopeForwardAndBackward.apply if fused else _unfused_qkv
    return fn(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
              interleaved, cp_size, cp_rank)
