"""Shared test helpers: the test device and sizes, references and oracles (the unfused
formula, the rotation in float64, transformers' modules), comparisons, and the accuracy study.

Used by pytest_benchmark_cuda_triton_comparison.py and rope_bench.py.
"""

import functools
import os

import pytest
import torch

import rope_bench_report as report
from te_comparator import load_te_qkv_rope, load_te_rope
from triton_rotary_main import (
    RotaryPositionEmbedding,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
)

ON_GPU = torch.cuda.is_available()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gradcheck(fn, inputs, order=1):
    """torch.autograd.gradcheck of fn at float64 inputs (gradgradcheck with order=2). On a GPU
    the whole Jacobian against finite differences; under Triton's interpreter in fast mode, a
    random projection v^T J u of it, which a wrong gradient formula fails as well: the whole
    Jacobian takes two kernel calls per input element and one per output element, about 500
    interpreted launches for a QK-norm case, minutes of `make test` on 2 cores."""
    check = torch.autograd.gradcheck if order == 1 else torch.autograd.gradgradcheck
    return check(fn, inputs, fast_mode=not ON_GPU)


def te(loader=load_te_rope, what="fused RoPE"):
    """TE's fused RoPE (or another of its functions, by loader), else skip saying why."""
    fn, reason = loader()
    if fn is None:
        pytest.skip(f"Transformer Engine's {what} unavailable: {reason}")
    return fn


# Gradient is a broadcast scalar: every stride of the incoming gradient is 0.
def overlapping_grad(output):
    return output.sum() * 2


# Gradient is a full tensor.
def non_overlapping_grad(output):
    return torch.sum(output * torch.ones_like(output))


# Gradient with distinct small-integer weights per element: exact in every dtype.
def distinct_weights_grad(output):
    weights = torch.arange(output.numel(), device=output.device) % 7 - 3
    return torch.sum(output * weights.view(output.shape))


def run_rope(fn, t, loss_func, **kwargs):
    """Forward output and input gradient of fn(t, ...)."""
    t = t.detach().requires_grad_(True)
    out = fn(t, **kwargs)
    loss_func(out).backward()
    return out.detach(), t.grad


def unfused_reference(t, **kwargs):
    """TE's unfused formula in float32 (the comparison TE's own tests make)."""
    return apply_rotary_pos_emb(t.float(), fused=False, **kwargs).to(t.dtype)


def compare(fn, t, loss_func, reference, **kwargs):
    out, grad = run_rope(fn, t, loss_func, **kwargs)
    if reference == "te":
        ref_out, ref_grad = run_rope(te(), t, loss_func, **kwargs)
    else:
        ref_out, ref_grad = run_rope(unfused_reference, t, loss_func, **kwargs)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    assert out.is_contiguous() and out.dtype == t.dtype and out.shape == t.shape


def compare_qkv(qkv, q_freqs, k_freqs, split, loss_func=distinct_weights_grad,
                 reference="unfused", check_grad=True, **kwargs):
    """Fused QKV outputs (contiguous) and packed gradient against the unfused formula in
    float32, or against TE's kernel."""
    ref_fn = (te(load_te_qkv_rope, "fused QKV RoPE") if reference == "te"
              else functools.partial(apply_fused_qkv_rotary_pos_emb, fused=False))
    results = []
    for fn, x in ((apply_fused_qkv_rotary_pos_emb, qkv), (ref_fn, qkv if reference == "te" else qkv.float())):
        x = x.detach().requires_grad_(True)
        outs = fn(x, q_freqs, k_freqs, split, **kwargs)
        loss_func(torch.cat([o.flatten() for o in outs])).backward()
        results.append(([o.detach().to(qkv.dtype) for o in outs], x.grad.to(qkv.dtype)))
    (outs, grad), (ref_outs, ref_grad) = results
    for out, ref_out in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref_out)
        assert out.is_contiguous()
    if check_grad:
        torch.testing.assert_close(grad, ref_grad)


def independent_positions(seq_len, cp_size, cp_rank):
    """Positions of a rank's local tokens, written the way TE's unfused code slices freqs."""
    half = seq_len // 2
    if cp_size == 1:
        return list(range(seq_len))
    full = cp_size * seq_len
    return (list(range(cp_rank * half, (cp_rank + 1) * half))
            + list(range(full - (cp_rank + 1) * half, full - cp_rank * half)))


def tokens_in_sequences(cu_seqlens, num_tokens, cp_size=1):
    """[num_tokens] bool: which of a rank's thd tokens lie inside a sequence of the global
    offsets `cu_seqlens` (a list), each sequence holding 1 / cp_size of its tokens on the rank."""
    in_seq = torch.zeros(num_tokens, dtype=torch.bool, device=DEVICE)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        in_seq[start // cp_size:end // cp_size] = True
    return in_seq


def int_tensor(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def fused_and_unfused(t, freqs, grad=None, **kwargs):
    """(out, dt) of the kernel and of the unfused formula, for the same input and gradient."""
    results = []
    for fused in (True, False):
        x = t.detach().clone().requires_grad_(True)
        out = apply_rotary_pos_emb(x, freqs, fused=fused, **kwargs)
        (dx,) = torch.autograd.grad(out, x, torch.ones_like(out) if grad is None else grad)
        results.append((out.detach(), dx))
    return results


EXACT_REL_TOL = 2e-6


# The exact path takes angles below 2^24; at inv_freq = 1 (the first pair, any base) that is
# every position below 2^24.
MAX_EXACT_POSITION = 2**24 - 1


# YaRN with factor 4: attention_scaling = 0.1 * ln(4) + 1 = 1.139 multiplies cos and sin, so a
# scale forgotten (or applied twice) in either direction fails the comparison.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


def rel_error(out, ref):
    """||out - ref|| / ||ref|| (Frobenius, ref in float64): the error measure of this section."""
    return ((out.detach().double().cpu() - ref).norm() / ref.norm()).item()


def pair_positions(pos, n_pairs, pair_axis=None):
    """Each pair's position, [..., n_pairs]: pos [...] (one per token), or, for M-RoPE,
    pos [n_axes, ...] read on axis pair_axis[k] for pair k."""
    if pair_axis is None:
        return pos[..., None].expand(*pos.shape, n_pairs)
    return pos.movedim(0, -1)[..., pair_axis]


def rotate64(x, pair_pos, inv_freq, interleaved, scale=1.0, transpose=False):
    """RoPE from its definition, in float64: pair k of x [..., h, d] (channels k and k + d2/2,
    or 2k and 2k + 1 interleaved) as a complex number times scale * e^{i theta}, theta =
    pair_pos[..., k] * inv_freq[k] (pair_pos has no head dim: shared by the heads). With
    transpose, e^{-i theta}: the transposed rotation, i.e. the gradient of the forward.
    Channels past d2 are copied."""
    n = inv_freq.numel()
    x = x.detach().double().cpu()
    theta = pair_pos.double().cpu()[..., None, :] * inv_freq.double().cpu()     # [..., 1, n]
    rot = scale * torch.polar(torch.ones_like(theta), -theta if transpose else theta)
    if interleaved:
        z = torch.complex(x[..., 0:2 * n:2], x[..., 1:2 * n:2]) * rot
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(x[..., :n], x[..., n:2 * n]) * rot
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, x[..., 2 * n:]), dim=-1)


def mrope_axis_rule(section, interleaved):
    """Position axis of each pair, written from the papers' description (independently of the
    module's pair_axis): Qwen2-VL gives consecutive blocks of section[i] pairs to axis i;
    Qwen3-VL gives axis a in (1, 2) every third pair from a among the first 3 * section[a]."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    k = torch.arange(sum(section))
    a = k % 3
    return torch.where((a > 0) & (k < 3 * torch.tensor(section)[a]), a, 0)


def mrope_module(interleaved, dim=32, section=None):
    if section is None:
        section = [8, 4, 4] if interleaved else [4, 6, 6]
    return RotaryPositionEmbedding(dim, device=DEVICE, mrope_section=section,
                                   mrope_interleaved=interleaved)


ACCURACY_PATH = os.path.join(report.ARTIFACTS_ROOT, "accuracy_vs_position.png")

ACCURACY_INPUTS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformers_rope(x, pos, inv_freq):
    """x [tokens, 1, heads, d] rotated as transformers' Llama does it (LlamaRotaryEmbedding.forward
    and apply_rotary_pos_emb in transformers/models/llama/modeling_llama.py): angles position *
    inv_freq in float32 (4.x: inv_freq @ positions with autocast off; 5.x: a product; one
    rounding either way), cos/sin in float32, cast to x's dtype, then x * cos + rotate_half(x) *
    sin in x's dtype, each operation rounded to it. Liger's rope (liger_kernel/ops/rope.py,
    _triton_rope) takes these cos/sin and casts x to their dtype before the same products, so
    it computes this too (on a GPU its Triton code may fuse a product into an fma)."""
    angles = pos.float()[:, None] * inv_freq.float()
    emb = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def flash_attn_rope(x, pos, inv_freq):
    """x [tokens, 1, heads, d] rotated as flash-attn does it: its RotaryEmbedding's cache
    (flash_attn/layers/rotary.py, _update_cos_sin_cache: torch.outer(positions in float32,
    inv_freq), cos/sin in float32, cast to x's dtype) and its Triton kernel
    (flash_attn/ops/triton/rotary.py, rotary_kernel: x, cos and sin loaded as float32,
    x0 * cos - x1 * sin and x0 * sin + x1 * cos in float32, stored in x's dtype)."""
    angles = torch.outer(pos.float(), inv_freq.float())[:, None, None, :]
    cos, sin = angles.cos().to(x.dtype).float(), angles.sin().to(x.dtype).float()
    x0, x1 = x.float().chunk(2, dim=-1)
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).to(x.dtype)


def accuracy_positions(k, tokens, gen):
    """`tokens` positions in (2^(k-1), 2^k], the largest 2^k itself (2^24 - 1 for k = 24, the
    exact path's last position). Powers of two alone would flatter the tables:
    float32(2^k * inv_freq) is exact."""
    top = min(2**k, MAX_EXACT_POSITION)
    low = 2 ** (k - 1) + 1 if k > 0 else top
    return torch.cat([torch.tensor([top]), torch.randint(low, top + 1, (tokens - 1,), generator=gen)])


def rounded(ref, dtype, truncate=False):
    """The float64 `ref` stored in `dtype`: rounded to nearest even, as a GPU stores, or with
    `truncate` (bfloat16 only) toward zero, as Triton's interpreter casts float32 to bfloat16."""
    if truncate and dtype == torch.bfloat16:
        return (ref.float().view(torch.int32) & -65536).view(torch.float32)     # the top 16 bits
    return ref.to(dtype)


def accuracy_errors(t, pos, table, emb):
    """{method: relative error} of one input t [tokens, 1, heads, d] at positions pos, against
    its rotation in float64; "rounding" is that rotation rounded to t's dtype (the least error
    any output in that dtype has), "store_rounding" the same as this backend's stores round."""
    ref = rotate64(t, pair_positions(pos[:, None], t.shape[-1] // 2), emb.inv_freq, False)
    outputs = dict(table=apply_rotary_pos_emb(t.to(DEVICE), table),
                   exact=apply_rotary_pos_emb(t.to(DEVICE), emb, positions=pos.to(DEVICE)),
                   transformers=transformers_rope(t, pos, emb.inv_freq.cpu()),
                   flash_attn=flash_attn_rope(t, pos, emb.inv_freq.cpu()),
                   rounding=rounded(ref, t.dtype),
                   store_rounding=rounded(ref, t.dtype, truncate=not ON_GPU))
    return {method: rel_error(out, ref) for method, out in outputs.items()}


def accuracy_vs_position(head_dim=128, tokens=4, heads=4, seed=50):
    """Relative error ||out - ref|| / ||ref|| against the rotation in float64 of the same
    input, float32 and bfloat16 input, at positions up to 2^k for k = 0..24
    (accuracy_positions), of: our table path (TE's float32 angle table), our exact path (the
    module), transformers' Llama (and Liger) and flash-attn as transformers_rope and
    flash_attn_rope compute them, and the float64 rotation rounded to the input dtype. All
    take the module's inv_freq, the float32 1 / base^(2i/d) that TE, transformers and
    flash-attn compute alike, so that the angle and rotation arithmetic are what differ. Runs
    one position per call so that the table can be TE's row itself (`emb(1, offset=p)`, equal
    to row p of the full table). Returns one dict per k: k, max_position and
    report.accuracy_column(dtype, method) for every dtype and method (and "store_rounding":
    see accuracy_errors)."""
    gen = torch.Generator().manual_seed(seed)
    emb = RotaryPositionEmbedding(head_dim, device=DEVICE)
    rows = []
    for k in range(25):
        pos = accuracy_positions(k, tokens, gen)
        t32 = torch.randn(tokens, 1, heads, head_dim, generator=gen)
        table = torch.cat([emb(1, offset=int(p)) for p in pos])                 # TE's rows p
        row = dict(k=k, max_position=int(pos[0]))
        for dtype_name, dtype in ACCURACY_INPUTS.items():
            errors = accuracy_errors(t32.to(dtype), pos, table, emb)
            row.update({report.accuracy_column(dtype_name, m): e for m, e in errors.items()})
        rows.append(row)
    return rows


def plot_accuracy(path=ACCURACY_PATH, rows=None):
    """The accuracy study (`rows`, else computed now) as a plot at `path` and a CSV next to it
    (same name, .csv); returns the rows. The committed artifacts come from a GPU (the hardware
    sin/cos of the positions path, bfloat16 stores rounded to nearest); the interpreter takes
    numpy's sin/cos and truncates bfloat16 stores, and its plot says so."""
    if rows is None:
        rows = accuracy_vs_position()
    where = "" if ON_GPU else " [Triton interpreter: numpy sin/cos, bfloat16 stores truncated]"
    report.write_accuracy_plot(path, rows, EXACT_REL_TOL, "RoPE error vs position: head dim 128, base "
                               f"10000, 4 tokens x 4 heads per point{where}")
    return rows

