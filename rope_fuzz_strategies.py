"""Hypothesis strategies for the fuzz tests: random layouts and strides, dtypes, angle sources
(tables, modules with and without scaling, M-RoPE), positions and packed sequences, and the
unfused float64 reference each drawn call is checked against.

Hypothesis draws the calls deterministically (derandomize=True, no example database); each is
checked against the unfused formula on float64 copies of the same values, NaN where the contract
says NaN. ROPE_FUZZ_EXAMPLES sets the examples per fuzz test (100 by default).
"""

import math
import os

import pytest
import torch

from rope_test_support import DEVICE, tokens_in_sequences
from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:       # the fuzz tests skip, saying so
    st = None


FUZZ_EXAMPLES = int(os.environ.get("ROPE_FUZZ_EXAMPLES", "100"))

FUZZ_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

FUZZ_SCALINGS = (None, {"rope_type": "linear", "factor": 2.0},
                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})

LAYOUTS = ("contiguous", "transposed", "sliced", "offset", "expanded", "negative")


def composite_strategy(strategy):
    return st.composite(strategy) if st is not None else strategy


def fuzz(strategy):
    """given(call=strategy(), data=st.data()) with the deterministic settings, or a test that
    skips when hypothesis is missing."""
    def wrap(test):
        if st is None:
            def skipped():
                pytest.skip("hypothesis is not installed (pip install hypothesis)")
            skipped.__name__, skipped.__doc__ = test.__name__, test.__doc__
            return skipped
        return settings(derandomize=True, max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))(given(call=strategy(), data=st.data())(test))
    return wrap


def draw_values(gen, shape, dtype):
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def laid_out(draw, gen, shape, dtype, kinds=LAYOUTS):
    """A tensor of `shape` with a drawn memory layout: contiguous, two dims transposed, a slice
    (stride 2 in the last dim), a 1-element storage offset, stride 0 along a dim (expanded),
    or the negative bit."""
    kind = draw(st.sampled_from(kinds))
    n = len(shape)
    if kind == "transposed":
        i, j = draw(st.sampled_from([(a, b) for a in range(n) for b in range(a + 1, n)]))
        swapped = list(shape)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return draw_values(gen, swapped, dtype).transpose(i, j)
    if kind == "sliced":
        return draw_values(gen, (*shape[:-1], 2 * shape[-1]), dtype)[..., ::2]
    if kind == "offset":
        return draw_values(gen, (math.prod(shape) + 1,), dtype)[1:].view(shape)
    if kind == "expanded":
        one = list(shape)
        one[draw(st.integers(0, n - 1))] = 1
        return draw_values(gen, one, dtype).expand(shape)
    if kind == "negative":
        return torch._neg_view(draw_values(gen, shape, dtype))
    return draw_values(gen, shape, dtype)


def index_tensor(draw, values, shape=None):
    """int32/int64 tensor of `values`: contiguous, strided, or with the negative bit."""
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    x = torch.tensor(values, dtype=dtype, device=DEVICE)
    if shape is not None:
        x = x.view(shape)
    kind = draw(st.sampled_from(["contiguous", "strided", "negative"]))
    if kind == "strided":
        x = torch.stack((x, torch.full_like(x, -7)), dim=-1)[..., 0]
    elif kind == "negative":
        x = torch._neg_view(-x)
    return x


def fuzz_angles(draw, gen, kind, d2, interleaved, rows, base=10000.0):
    """A table (module-built or arbitrary angles; strided, expanded, float64, bfloat16 or
    negative-bit) or a module (rope scalings, M-RoPE sections)."""
    if kind == "table":
        if draw(st.booleans()):
            table = RotaryPositionEmbedding(d2, interleaved=interleaved, rotary_base=base, device=DEVICE)(rows)
        else:
            table = torch.randn(rows, 1, 1, d2, generator=gen).to(DEVICE) * 3
        layout = draw(st.sampled_from(["contiguous", "strided", "expanded", "float64", "bfloat16", "negative"]))
        if layout == "strided":
            wide = torch.zeros(rows, 1, 1, 2 * d2, device=DEVICE)
            wide[..., ::2] = table
            table = wide[..., ::2]
        elif layout == "expanded" and rows:
            table = table[:1].expand(rows, 1, 1, d2)
        elif layout == "negative":
            table = torch._neg_view(-table)
        elif layout in ("float64", "bfloat16"):
            table = table.to(getattr(torch, layout))
        return table
    section, mrope_interleaved = None, False
    if kind == "mrope":
        first = draw(st.integers(0, d2 // 2))
        second = draw(st.integers(0, d2 // 2 - first))
        section = [first, second, d2 // 2 - first - second]
        mrope_interleaved = draw(st.booleans())
    return RotaryPositionEmbedding(d2, interleaved=interleaved, rotary_base=base, device=DEVICE,
                                   rope_scaling=draw(st.sampled_from(FUZZ_SCALINGS)),
                                   mrope_section=section, mrope_interleaved=mrope_interleaved)


def fuzz_positions(draw, kind, shape, rows):
    """Per-token positions of `shape` (with a leading axis dim for M-RoPE): for a table some
    fall outside it (NaN by contract); for a module any integer of moderate size (angles stay
    below the kernel's 2^24 reduction range)."""
    values = st.integers(-2, rows + 2) if kind == "table" else st.integers(-300, 4000)
    if kind == "mrope":
        shape = (3, *shape)
    numel = math.prod(shape)
    return index_tensor(draw, draw(st.lists(values, min_size=numel, max_size=numel)), shape)


def fuzz_sequences(draw, kind, cp_size, kwargs):
    """Sequence length s (even under CP), batch b and table rows of an sbhd/bshd call, with
    start positions or per-token positions ([s] or [b, s]) added to kwargs when CP allows."""
    s = 2 * draw(st.integers(0, 3)) if cp_size > 1 else draw(st.integers(0, 6))
    b = draw(st.integers(0, 3))
    rows = s * cp_size + draw(st.integers(0, 4))
    extra = draw(st.sampled_from(["none", "start", "positions", "batch positions"])) if cp_size == 1 else "none"
    if extra == "start":
        kwargs["start_positions"] = index_tensor(draw, draw(st.lists(st.integers(-1, 4), min_size=b, max_size=b)))
    elif extra != "none":
        kwargs["positions"] = fuzz_positions(draw, kind, (s,) if extra == "positions" else (b, s), rows)
    return s, b, rows


@composite_strategy
def rope_calls(draw):
    """(t, freqs, kwargs, grad, in_seq, d2) for apply_rotary_pos_emb; in_seq marks the thd
    tokens inside a sequence (None: every token)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    fmt = draw(st.sampled_from(["sbhd", "bshd", "thd"]))
    dtype = draw(st.sampled_from(FUZZ_DTYPES))
    interleaved = draw(st.booleans())
    d = draw(st.integers(2, 20))
    d2 = 2 * draw(st.integers(1, d // 2))
    h = draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["table", "module", "mrope"]))
    cp_size = draw(st.sampled_from([1, 1, 2, 3]))
    cp_rank = draw(st.integers(0, cp_size - 1))
    kwargs = dict(tensor_format=fmt, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank,
                  inverse=draw(st.booleans()))
    in_seq = None
    if fmt == "thd":
        tokens = draw(st.integers(0, 10))
        shape = (tokens, h, d)
        rows = draw(st.integers(0, 12))
        if cp_size == 1 and draw(st.booleans()):
            kwargs["positions"] = fuzz_positions(draw, kind, (tokens,), rows)
        else:
            # Sorted global offsets: empty sequences, a first one after 0, ends past the tokens.
            cu = sorted(draw(st.lists(st.integers(0, (tokens + 3) * cp_size), min_size=2, max_size=5)))
            kwargs["cu_seqlens"] = index_tensor(draw, cu)
            in_seq = tokens_in_sequences(cu, tokens, cp_size)
            if cp_size == 1 and draw(st.booleans()):
                starts = draw(st.lists(st.integers(-1, 4), min_size=len(cu) - 1, max_size=len(cu) - 1))
                kwargs["start_positions"] = index_tensor(draw, starts)
    else:
        s, b, rows = fuzz_sequences(draw, kind, cp_size, kwargs)
        shape = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    freqs = fuzz_angles(draw, gen, kind, d2, interleaved, rows)
    return laid_out(draw, gen, shape, dtype), freqs, kwargs, laid_out(draw, gen, shape, dtype), in_seq, d2


def fuzz_norm(draw, gen, nheads, head_dim):
    """QK-norm keyword arguments for a call on `nheads` heads of `head_dim` channels: over each
    head or over each token, with or without Gemma's offset, a small or a large eps, the weight
    in a drawn dtype."""
    over = draw(st.sampled_from(["head", "token"]))
    size = head_dim if over == "head" else nheads * head_dim
    return dict(norm_weight=draw_values(gen, (size,), draw(st.sampled_from(FUZZ_DTYPES))),
                norm_eps=draw(st.sampled_from([1e-6, 0.5])),
                norm_offset=draw(st.sampled_from([0.0, 1.0])), norm_over=over)


def fuzz_reference(t, freqs, kwargs, grad, in_seq):
    """Output and input gradient of the unfused formula on float64 copies of the values, with
    the documented pass-through gradient for thd tokens outside every sequence (the unfused
    path's own is NaN there: test_unfused_thd_pass_through_gradient)."""
    x = t.resolve_neg().double().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, fused=False, **kwargs)
    (dx,) = torch.autograd.grad(out, x, grad.resolve_neg().double())
    if in_seq is not None:
        dx[~in_seq] = grad.resolve_neg()[~in_seq].double()
    return out.detach(), dx


def assert_fuzz_close(actual, expected, what):
    assert actual.shape == expected.shape, what
    expected = expected.to(actual.dtype)
    # float64 runs compare float64 sin/cos with the reference's float32 ones.
    tol = dict(atol=1e-6, rtol=1e-6) if actual.dtype == torch.float64 else {}
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)


def poisoned_view(draw, shape, dtype):
    """(buffer, out, inside): out a view of `shape` inside a larger buffer (padding around it,
    dims stored in a drawn order), out filled with NaN (each element must be written) and the
    rest of the buffer with a sentinel (none of it may be); inside marks out in the buffer."""
    n = len(shape)
    pads = [draw(st.integers(0, 2)) for _ in shape]
    offsets = [draw(st.integers(0, p)) for p in pads]
    order = list(draw(st.permutations(range(n))))
    window = tuple(slice(o, o + k) for o, k in zip(offsets, shape))

    def make(fill, dtype):
        stored = torch.full([shape[i] + pads[i] for i in order], fill, dtype=dtype, device=DEVICE)
        return stored.permute(*[order.index(i) for i in range(n)])

    buffer, inside = make(7.0, dtype), make(False, torch.bool)
    inside[window] = True
    out = buffer[window]
    out.fill_(float("nan"))
    return buffer, out, inside


@composite_strategy
def qkv_calls(draw):
    """(qkv, q_freqs, k_freqs, split, kwargs, grads) for apply_fused_qkv_rotary_pos_emb."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    fmt = draw(st.sampled_from(["sbhd", "bshd"]))
    dtype = draw(st.sampled_from(FUZZ_DTYPES))
    interleaved = draw(st.booleans())
    d = draw(st.integers(2, 14))
    d2 = 2 * draw(st.integers(1, d // 2))
    split = [d * draw(st.integers(1, 3)), d, draw(st.integers(1, 12))]
    kv_heads = draw(st.integers(0, 3))
    kind = draw(st.sampled_from(["table", "module", "mrope"]))
    cp_size = draw(st.sampled_from([1, 1, 2, 4]))
    cp_rank = draw(st.integers(0, cp_size - 1))
    kwargs = dict(tensor_format=fmt, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank,
                  inverse=draw(st.booleans()))
    s, b, rows = fuzz_sequences(draw, kind, cp_size, kwargs)
    # Distinct q and k angles, so a mix-up shows; both of one kind (as required).
    q_freqs = fuzz_angles(draw, gen, kind, d2, interleaved, rows)
    k_freqs = fuzz_angles(draw, gen, kind, d2, interleaved, rows, base=500.0)
    if kind == "mrope" and q_freqs.n_axes != k_freqs.n_axes:
        k_freqs = q_freqs
    lead = (s, b) if fmt == "sbhd" else (b, s)
    qkv = laid_out(draw, gen, (*lead, kv_heads, sum(split)), dtype)
    shapes = [(*lead, kv_heads * split[0] // d, d), (*lead, kv_heads, d), (*lead, kv_heads, split[2])]
    grads = [laid_out(draw, gen, shp, dtype) for shp in shapes]
    return qkv, q_freqs, k_freqs, split, kwargs, grads

