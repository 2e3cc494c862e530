"""Tests and benchmarks of the Triton fused RoPE against Transformer Engine and PyTorch.

    pytest pytest_benchmark_cuda_triton_comparison.py     # the tests (make test)
    python pytest_benchmark_cuda_triton_comparison.py     # the benchmarks (make bench)

The tests run on a CUDA GPU at Transformer Engine's own test shapes, or without a GPU through
Triton's interpreter (TRITON_INTERPRET=1, set here automatically) at the scaled-down shapes of
`SIZES["interpreter"]`. Wherever TE's fused RoPE can be loaded (see te_comparator.py) the
results are also compared with it; elsewhere those cases are skipped with the reason.
"""

import math
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must be decided before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from te_comparator import load_te_rope  # noqa: E402
from triton_rotary_kernel import set_rotary_kernel  # noqa: E402
from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The one place test sizes live. TE's test_fused_rope uses the "gpu" row; the interpreter
# runs every program in Python, so it gets the same matrix on fewer tokens and heads.
SIZES = {
    "gpu": dict(seq_lengths=(2048, 4096), batch=2, heads=64, hidden_sizes=(128, 256), margin=10,
                thd_cu_seqlens=(0, 400, 542, 711, 727, 752, 1270, 1426, 1450, 1954, 2044, 2048)),
    "interpreter": dict(seq_lengths=(16, 24), batch=2, heads=3, hidden_sizes=(128, 256), margin=10,
                        thd_cu_seqlens=(0, 5, 12, 13, 13, 30, 36)),
}[("gpu" if ON_GPU else "interpreter")]


def _te():
    fn, reason = load_te_rope()
    if fn is None:
        pytest.skip(f"Transformer Engine's fused RoPE unavailable: {reason}")
    return fn


# Gradient is a broadcast scalar: every stride of the incoming gradient is 0.
def _overlapping_grad(output):
    return output.sum() * 2


# Gradient is a full tensor.
def _non_overlapping_grad(output):
    return torch.sum(output * torch.ones_like(output))


def _run(fn, t, loss_func, **kwargs):
    """Forward output and input gradient of fn(t, ...)."""
    t = t.detach().requires_grad_(True)
    out = fn(t, **kwargs)
    loss_func(out).backward()
    return out.detach(), t.grad


def _reference(t, **kwargs):
    """TE's unfused formula in float32 (the comparison TE's own tests make)."""
    return apply_rotary_pos_emb(t.float(), fused=False, **kwargs).to(t.dtype)


def _compare(fn, t, loss_func, reference, **kwargs):
    out, grad = _run(fn, t, loss_func, **kwargs)
    if reference == "te":
        ref_out, ref_grad = _run(_te(), t, loss_func, **kwargs)
    else:
        ref_out, ref_grad = _run(_reference, t, loss_func, **kwargs)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    assert out.is_contiguous() and out.dtype == t.dtype and out.shape == t.shape


def _random_start_positions(batch, margin):
    return torch.randint(0, margin, (batch,), dtype=torch.int32, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# TE's test matrix (tests/pytorch/test_fused_rope.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reference", ["unfused", "te"])
@pytest.mark.parametrize("start_positions", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("loss_func", [_overlapping_grad, _non_overlapping_grad])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("transpose", [None, (0, 1), (2, 3)])
@pytest.mark.parametrize("margin", [0, SIZES["margin"]])
@pytest.mark.parametrize("rotary_percent", [0.5, 1.0])
@pytest.mark.parametrize("hidden_size", SIZES["hidden_sizes"])
@pytest.mark.parametrize("seq_length", SIZES["seq_lengths"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope(dtype, seq_length, hidden_size, rotary_percent, margin, transpose,
                    tensor_format, loss_func, interleaved, cp_size, start_positions, reference):
    if start_positions and (margin == 0 or cp_size > 1):
        pytest.skip("start_positions needs a margin and cp_size == 1 (as in TE's test)")
    torch.manual_seed(seq_length + hidden_size + margin)
    batch, heads = SIZES["batch"], SIZES["heads"]
    t = torch.rand((seq_length - margin, batch, heads, hidden_size), dtype=dtype, device=DEVICE)
    if tensor_format == "bshd":
        t = t.transpose(0, 1).contiguous()
    if transpose:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    starts = _random_start_positions(batch, margin) if start_positions else None
    freqs = RotaryPositionEmbedding(hidden_size, rotary_percent, interleaved=interleaved,
                                    device=DEVICE)(seq_length * cp_size)
    for cp_rank in range(cp_size):
        _compare(apply_rotary_pos_emb, t, loss_func, reference, freqs=freqs,
                 tensor_format=tensor_format, start_positions=starts, interleaved=interleaved,
                 cp_size=cp_size, cp_rank=cp_rank)


def _padded_cu_seqlens(cu_seqlens, cp_size):
    """Pad every sequence to a multiple of 2 * cp_size, as TE's thd test does for CP."""
    padded = [0]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        padded.append(padded[-1] + math.ceil((end - start) / (2 * cp_size)) * 2 * cp_size)
    return padded


@pytest.mark.parametrize("reference", ["unfused", "te"])
@pytest.mark.parametrize("start_positions", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("loss_func", [_overlapping_grad, _non_overlapping_grad])
@pytest.mark.parametrize("transpose", [None, (1, 2)])
@pytest.mark.parametrize("rotary_percent", [0.5, 1.0])
@pytest.mark.parametrize("hidden_size", SIZES["hidden_sizes"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_thd(dtype, hidden_size, rotary_percent, transpose, loss_func, interleaved,
                        cp_size, start_positions, reference):
    if start_positions and cp_size > 1:
        pytest.skip("start_positions is not supported with cp_size > 1 (as in TE)")
    torch.manual_seed(hidden_size)
    cu = SIZES["thd_cu_seqlens"]
    cu = cu if cp_size == 1 else _padded_cu_seqlens(cu, cp_size)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    t = torch.rand((cu[-1] // cp_size, SIZES["heads"], hidden_size), dtype=dtype, device=DEVICE)
    if transpose:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    starts = _random_start_positions(len(cu) - 1, SIZES["margin"]) if start_positions else None
    freqs = RotaryPositionEmbedding(hidden_size, rotary_percent, interleaved=interleaved,
                                    device=DEVICE)(cu[-1] + SIZES["margin"])
    for cp_rank in range(cp_size):
        _compare(apply_rotary_pos_emb, t, loss_func, reference, freqs=freqs, tensor_format="thd",
                 start_positions=starts, interleaved=interleaved, cu_seqlens=cu_seqlens,
                 cp_size=cp_size, cp_rank=cp_rank)


# ---------------------------------------------------------------------------------------------
# Beyond TE's tests
# ---------------------------------------------------------------------------------------------

def _independent_positions(seq_len, cp_size, cp_rank):
    """Positions of a rank's local tokens, written the way TE's unfused code slices freqs."""
    half = seq_len // 2
    if cp_size == 1:
        return list(range(seq_len))
    full = cp_size * seq_len
    return (list(range(cp_rank * half, (cp_rank + 1) * half))
            + list(range(full - (cp_rank + 1) * half, full - cp_rank * half)))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cp_size,cp_rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_matches_textbook_rotation(interleaved, cp_size, cp_rank):
    """Against an independent float64 rotation of each pair (complex multiplication by
    e^{i*theta}), so the kernel and the unfused code are not only checked against each other."""
    torch.manual_seed(1)
    s, b, h, d, d2 = 8, 2, 3, 24, 16
    t = torch.randn(s, b, h, d, dtype=torch.float32, device=DEVICE)
    freqs = RotaryPositionEmbedding(d2, interleaved=interleaved, device=DEVICE)(s * cp_size)
    out = apply_rotary_pos_emb(t, freqs, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank)
    pos = torch.tensor(_independent_positions(s, cp_size, cp_rank), device=DEVICE)
    theta = freqs[pos, 0, 0, :].double()                                     # [s, d2]
    x = t[..., :d2].double()
    if interleaved:
        pairs, angle = torch.complex(x[..., 0::2], x[..., 1::2]), theta[:, None, None, 0::2]
    else:
        pairs, angle = torch.complex(x[..., : d2 // 2], x[..., d2 // 2:]), theta[:, None, None, : d2 // 2]
    rotated = pairs * torch.polar(torch.ones_like(angle), angle)
    if interleaved:
        expected = torch.stack((rotated.real, rotated.imag), dim=-1).flatten(-2)
    else:
        expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(out[..., :d2].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., d2:], t[..., d2:])


GRADCHECK_CASES = [
    dict(tensor_format="sbhd"),
    dict(tensor_format="bshd", interleaved=True),
    dict(tensor_format="sbhd", rotary_dim=6, start_positions=[2, 0]),
    dict(tensor_format="sbhd", cp_size=2, cp_rank=1),
    dict(tensor_format="thd", cu_seqlens=[0, 3, 4, 8]),
    dict(tensor_format="thd", cu_seqlens=[0, 4, 8], cp_size=2, cp_rank=1, interleaved=True),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gradcheck_float64(case):
    case = dict(case)
    rotary_dim = case.pop("rotary_dim", 8)
    fmt = case["tensor_format"]
    cu = case.pop("cu_seqlens", None)
    if cu is not None:
        case["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    if "start_positions" in case:
        case["start_positions"] = torch.tensor(case["start_positions"], dtype=torch.int32, device=DEVICE)
    shape = {"sbhd": (4, 2, 2, 10), "bshd": (2, 4, 2, 10), "thd": (cu[-1] // case.get("cp_size", 1) if cu else 0, 2, 10)}[fmt]
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    # Arbitrary (not pairwise equal) angles: checks the backward is the exact transpose.
    freqs = torch.randn(16, 1, 1, rotary_dim, device=DEVICE) * 3
    assert torch.autograd.gradcheck(lambda x: apply_rotary_pos_emb(x, freqs, **case), (t,))


def test_every_output_element_written():
    """Poison a preallocated output, run each code path, find no poison left."""
    torch.manual_seed(2)
    for interleaved in (False, True):
        for d, d2 in ((128, 128), (96, 48), (80, 40), (72, 72)):
            t = torch.randn(5, 3, 7, d, device=DEVICE)
            freqs = RotaryPositionEmbedding(d2, interleaved=interleaved, device=DEVICE)(5)
            out = torch.full_like(t, float("nan"))
            set_rotary_kernel(t, freqs, interleaved=interleaved, out=out)
            assert not out.isnan().any(), (interleaved, d, d2)
            torch.testing.assert_close(out, _reference(t, freqs=freqs, interleaved=interleaved))


def test_bitwise_deterministic():
    torch.manual_seed(3)
    t = torch.randn(33, 2, 5, 96, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    freqs = RotaryPositionEmbedding(96, 0.5, device=DEVICE)(40)
    grad = torch.randn(33, 2, 5, 96, dtype=torch.bfloat16, device=DEVICE)
    runs = []
    for _ in range(2):
        out = apply_rotary_pos_emb(t, freqs)
        (g,) = torch.autograd.grad(out, t, grad)
        runs.append((out, g))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("interleaved", [False, True])
def test_nan_inf_propagate_like_reference(interleaved):
    torch.manual_seed(4)
    t = torch.randn(6, 2, 3, 32, device=DEVICE)
    t[1, 0, 2, 3] = float("nan")
    t[2, 1, 0, 20] = float("inf")
    t[4, 0, 1, 7] = -float("inf")
    t[5, 1, 1, 31] = float("nan")    # a pass-through channel
    freqs = RotaryPositionEmbedding(16 if interleaved else 24, interleaved=interleaved, device=DEVICE)(6)
    out = apply_rotary_pos_emb(t, freqs, interleaved=interleaved)
    ref = apply_rotary_pos_emb(t, freqs, interleaved=interleaved, fused=False)
    assert out.isnan().any() and out.isinf().any()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf())
    finite = out.isfinite()
    torch.testing.assert_close(out[finite], ref[finite])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary_dim", [(80, 80), (96, 96), (72, 72), (80, 40), (96, 72),
                                                 (72, 24), (128, 6), (64, 34)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_head_and_rotary_dims(dtype, head_dim, rotary_dim, interleaved):
    torch.manual_seed(head_dim * rotary_dim)
    t = torch.rand(7, 3, 5, head_dim, dtype=dtype, device=DEVICE)
    freqs = RotaryPositionEmbedding(rotary_dim, interleaved=interleaved, device=DEVICE)(9)
    for reference in ("unfused", "te"):
        if reference == "te" and load_te_rope()[0] is None:
            continue
        _compare(apply_rotary_pos_emb, t, _non_overlapping_grad, reference, freqs=freqs,
                 interleaved=interleaved)


def test_freqs_any_layout():
    """Non-contiguous and non-float32 freqs give the same result as contiguous float32."""
    torch.manual_seed(5)
    t = torch.randn(6, 2, 3, 16, device=DEVICE)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    wide = torch.zeros(8, 1, 1, 40, device=DEVICE)
    wide[..., ::2][..., :16] = freqs           # stride 2 along d2
    strided = wide[..., ::2][..., :16]
    assert not strided.is_contiguous()
    expected = apply_rotary_pos_emb(t, freqs)
    torch.testing.assert_close(apply_rotary_pos_emb(t, strided), expected)
    half_precision = freqs.to(torch.float64)
    torch.testing.assert_close(apply_rotary_pos_emb(t, half_precision), expected)


def test_rotary_position_embedding_matches_formula():
    emb = RotaryPositionEmbedding(8, rotary_base=100.0, device=DEVICE)(5, offset=2)
    inv = [100.0 ** (-i / 8) for i in (0, 2, 4, 6)]
    expected = torch.tensor([[(p + 2) * f for f in inv * 2] for p in range(5)])
    torch.testing.assert_close(emb[:, 0, 0, :].cpu(), expected)
    inter = RotaryPositionEmbedding(8, rotary_base=100.0, interleaved=True, device=DEVICE)(5, offset=2)
    torch.testing.assert_close(inter[:, 0, 0, 0::2], emb[:, 0, 0, :4])
    torch.testing.assert_close(inter[:, 0, 0, 1::2], emb[:, 0, 0, :4])
    half = RotaryPositionEmbedding(16, rotary_percent=0.5, rotary_base=100.0, device=DEVICE)(5, offset=2)
    torch.testing.assert_close(half, emb)
    scaled = RotaryPositionEmbedding(8, rotary_base=100.0, seq_len_interpolation_factor=2,
                                     pretrained_max_position_embeddings=16, device=DEVICE)(5)
    torch.testing.assert_close(scaled, RotaryPositionEmbedding(8, rotary_base=100.0, device=DEVICE)(5) / 2)


if __name__ == "__main__":
    raise SystemExit("benchmarks: not written yet (see the benchmark issue)")
