"""Tests and benchmarks of the Triton fused RoPE against Transformer Engine and PyTorch.

    pytest pytest_benchmark_cuda_triton_comparison.py     # the tests (make test)
    python pytest_benchmark_cuda_triton_comparison.py     # the benchmarks (make bench)

The tests run on a CUDA GPU at Transformer Engine's own test shapes, or without a GPU through
Triton's interpreter (TRITON_INTERPRET=1, chosen in conftest.py) at the scaled-down shapes of
`SIZES["interpreter"]`. Wherever TE's fused RoPE can be loaded (see te_comparator.py) the
results are also compared with it; elsewhere those cases are skipped with the reason. The
other references are the unfused PyTorch formula (fused=False, in float64 where a test says so),
transformers' own modules, plain torch ops or hand-computed values, never the kernel itself.

Contents (each section starts with a `# == N.` banner):

     1. Transformer Engine's own test matrices: TE's test_fused_rope, test_fused_rope_thd and
        test_fused_qkv_rope, compared with TE's kernel where it loads and with the unfused
        formula everywhere.
     2. Independent references: the textbook rotation, float64 gradcheck, every element written,
        determinism, NaN and Inf, odd sizes.
     3. transformers parity: RoPE scaling, Hugging Face configs and M-RoPE, with transformers'
        own modules as the oracle.
     4. Angles from positions: exactness against float64, the sin/cos bound, the single-rounding
        fma, positions and M-RoPE.
     5. API semantics: thd pass-through, positions outside a table, index dtypes, in place,
        empty inputs, arguments saved for the backward.
     6. Errors: bad input raises a ValueError or TypeError naming the argument.
     7. Integration: torch.compile, opcheck of the custom ops, CUDA graphs, context parallelism
        across processes.
     8. Launcher internals: the thd search, launch rule and grid, the plan cache, the compiled
        kernels' launcher, the generated code.
     9. Fuzzing: random layouts, strides, dtypes and angle sources against the unfused formula
        in float64 (strategies in rope_fuzz_strategies.py).
    10. GPU only: sanitizer cases and large tensors: `make sanitize` runs the -m sanitize tests
        under compute-sanitizer.
    11. Accuracy study and benchmark report: the study's story, the summaries, plots and stamps
        of rope_bench_report.py.

Shared helpers live in rope_test_support.py, the fuzz strategies in rope_fuzz_strategies.py,
the benchmark in rope_bench.py and its report in rope_bench_report.py.
"""

import collections
import contextlib
import functools
import itertools
import json
import math
import os
import re

import pytest
import torch
import triton
import triton.language as tl

import rope_bench_report as report
import triton_rotary_kernel
import triton_rotary_launch
import triton_rotary_main
from rope_bench import run_benchmarks
from rope_fuzz_strategies import (
    assert_fuzz_close,
    fuzz,
    fuzz_norm,
    fuzz_reference,
    laid_out,
    poisoned_view,
    qkv_calls,
    rope_calls,
    st,
)
from rope_test_support import (
    ACCURACY_INPUTS,
    DEVICE,
    DTYPES,
    EXACT_REL_TOL,
    MAX_EXACT_POSITION,
    ON_GPU,
    YARN,
    accuracy_vs_position,
    compare,
    compare_qkv,
    fused_and_unfused,
    gradcheck,
    independent_positions,
    int_tensor,
    mrope_axis_rule,
    mrope_module,
    non_overlapping_grad,
    overlapping_grad,
    pair_positions,
    plot_accuracy,
    rel_error,
    rotate64,
    tokens_in_sequences,
    unfused_reference,
)
from te_comparator import load_te_rope
from triton_rotary_kernel import (
    Tokens,
    Variant,
    _checked_sequence_guess,
    _guess_window,
    _guessed_sequences,
    _program_tokens,
    _tile_in_one_sequence,
    _tile_sequences,
    _window_first_sequence,
)
from triton_rotary_launch import set_rotary_kernel
from triton_rotary_main import (
    RotaryPositionEmbedding,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_inplace,
    apply_rotary_pos_emb_qk,
)

# =================================================================================================
# == 1. Transformer Engine's own test matrices
#    TE's test_fused_rope, test_fused_rope_thd and test_fused_qkv_rope, compared with TE's
#    kernel where it loads and with the unfused formula everywhere.
# =================================================================================================


# The one place test sizes live. TE's test_fused_rope uses the "gpu" row; the interpreter
# runs every program in Python, so it gets the same matrix on fewer tokens and heads.
SIZES = {
    "gpu": dict(seq_lengths=(2048, 4096), batch=2, heads=64, hidden_sizes=(128, 256), margin=10,
                thd_cu_seqlens=(0, 400, 542, 711, 727, 752, 1270, 1426, 1450, 1954, 2044, 2048),
                qkv_seq_lengths=(2, 8, 2048, 4096), qkv_hidden_sizes=(64, 128, 256), kv_heads=8),
    "interpreter": dict(seq_lengths=(16, 24), batch=2, heads=3, hidden_sizes=(128, 256), margin=10,
                        thd_cu_seqlens=(0, 5, 12, 13, 13, 30, 36),
                        qkv_seq_lengths=(2, 8, 24), qkv_hidden_sizes=(64, 128, 256), kv_heads=2),
}[("gpu" if ON_GPU else "interpreter")]


# Which cases of TE's three test matrices run: "full", every combination TE's tests allow;
# "quick", every combination of the axes that select kernel code, with the other axes' values
# chosen so that each pair of values of any two axes still occurs (`_te_matrix`). Quick is the
# default without a GPU, where every program runs in Python; `make test-full` sets full.
TEST_MATRIX = os.environ.get("ROPE_TEST_MATRIX") or ("full" if ON_GPU else "quick")
if TEST_MATRIX not in ("full", "quick"):
    raise ValueError(f"ROPE_TEST_MATRIX must be 'full' or 'quick', not {TEST_MATRIX!r}")


def _te_allows_start_positions(start_positions, cp_size, margin=None, **_):
    """TE's rope tests run start_positions only without CP, and (where the test has a margin)
    only with a margin for them."""
    return not start_positions or (cp_size == 1 and margin != 0)


def _random_start_positions(batch, margin):
    return torch.randint(0, margin, (batch,), dtype=torch.int32, device=DEVICE)


def _pairwise_cover(cases, primary):
    """A subset of `cases` (tuples of value indices, one per axis) that keeps one case for each
    combination of the `primary` axes and contains every pair (axis i = value a, axis j = value
    b) that some case contains. Greedy: each pick is the candidate adding the most new pairs."""
    n = len(cases[0])
    index_pairs = list(itertools.combinations(range(n), 2))
    case_pairs = [frozenset((i, j, case[i], case[j]) for i, j in index_pairs) for case in cases]
    uncovered = set().union(*case_pairs)
    groups = {}
    for k, case in enumerate(cases):
        groups.setdefault(tuple(case[p] for p in primary), []).append(k)
    chosen, uses = set(), collections.Counter()

    def pick(candidates):
        # Ties (often: no new pair left) go to the values used least so far, so that every value
        # of an axis runs about equally often.
        best = max(candidates, key=lambda k: (len(case_pairs[k] & uncovered),
                                              -sum(uses[i, v] for i, v in enumerate(cases[k]))))
        chosen.add(best)
        uncovered.difference_update(case_pairs[best])
        uses.update(enumerate(cases[best]))

    for group in groups.values():
        pick(group)
    while uncovered:  # pairs that no primary combination's pick brought in
        pick(range(len(cases)))
    return [cases[k] for k in sorted(chosen)]


def _case_id(case):
    """Test id of a dict of keyword arguments: key=value pairs joined by '-'."""
    return "-".join(f"{k}={v}" for k, v in case.items())


def _value_id(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if callable(value):
        return value.__name__.strip("_")
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _te_matrix(primary, allowed, **axes):
    """Parametrize a test over one of TE's RoPE test matrices: `axes` (name -> values) and the
    axes TE's three tests share; each case runs against the unfused float32 formula and, with
    `reference="te"`, against TE's own kernel. Only cases `allowed(**case)` accepts are
    generated. TEST_MATRIX "full" takes them all, "quick" a `_pairwise_cover` of them that keeps
    every combination of the `primary` axes."""
    axes = dict(axes, loss_func=[overlapping_grad, non_overlapping_grad], interleaved=[False, True],
                cp_size=[1, 2], start_positions=[False, True])
    names = list(axes)
    cases = [idx for idx in itertools.product(*(range(len(values)) for values in axes.values()))
             if allowed(**{name: axes[name][i] for name, i in zip(names, idx)})]
    if TEST_MATRIX == "quick":
        cases = _pairwise_cover(cases, [names.index(name) for name in primary])
    # Every case against both references, so that the cases run where TE cannot be loaded
    # (and its comparisons are skipped) still cover every pair.
    params, ids = [], []
    for idx in cases:
        values = [axes[name][i] for name, i in zip(names, idx)]
        case_id = "-".join(f"{name}={_value_id(value)}" for name, value in zip(names, values))
        for reference in ("unfused", "te"):
            params.append(values + [reference])
            ids.append(f"{case_id}-{reference}")
    return pytest.mark.parametrize(names + ["reference"], params, ids=ids)


@_te_matrix(primary=("dtype", "tensor_format", "rotary_percent", "interleaved", "cp_size",
                     "start_positions"),
            allowed=_te_allows_start_positions,
            dtype=DTYPES, seq_length=SIZES["seq_lengths"], hidden_size=SIZES["hidden_sizes"],
            rotary_percent=[0.5, 1.0], margin=[0, SIZES["margin"]], transpose=[None, (0, 1), (2, 3)],
            tensor_format=["sbhd", "bshd"])
def test_fused_rope(dtype, seq_length, hidden_size, rotary_percent, margin, transpose,
                    tensor_format, loss_func, interleaved, cp_size, start_positions, reference):
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
        compare(apply_rotary_pos_emb, t, loss_func, reference, freqs=freqs,
                 tensor_format=tensor_format, start_positions=starts, interleaved=interleaved,
                 cp_size=cp_size, cp_rank=cp_rank)


def _padded_cu_seqlens(cu_seqlens, cp_size):
    """Pad every sequence to a multiple of 2 * cp_size, as TE's thd test does for CP."""
    padded = [0]
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        padded.append(padded[-1] + math.ceil((end - start) / (2 * cp_size)) * 2 * cp_size)
    return padded


@_te_matrix(primary=("dtype", "rotary_percent", "interleaved", "cp_size", "start_positions"),
            allowed=_te_allows_start_positions,
            dtype=DTYPES, hidden_size=SIZES["hidden_sizes"], rotary_percent=[0.5, 1.0],
            transpose=[None, (1, 2)])
def test_fused_rope_thd(dtype, hidden_size, rotary_percent, transpose, loss_func, interleaved,
                        cp_size, start_positions, reference):
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
        compare(apply_rotary_pos_emb, t, loss_func, reference, freqs=freqs, tensor_format="thd",
                 start_positions=starts, interleaved=interleaved, cu_seqlens=cu_seqlens,
                 cp_size=cp_size, cp_rank=cp_rank)


def _qkv_case_allowed(seq_length, margin, cp_size, **case):
    """TE's start_positions rule, and a local sequence left after the margin (even under CP)."""
    local = seq_length - margin
    return (_te_allows_start_positions(margin=margin, cp_size=cp_size, **case)
            and local >= 2 and not (local % 2 and cp_size > 1))


@_te_matrix(primary=("dtype", "tensor_format", "rotary_percent", "interleaved", "cp_size",
                     "start_positions"),
            allowed=_qkv_case_allowed,
            dtype=DTYPES, seq_length=SIZES["qkv_seq_lengths"], hidden_size=SIZES["qkv_hidden_sizes"],
            rotary_percent=[0.5, 1.0], margin=[0, SIZES["margin"]], tensor_format=["sbhd", "bshd"])
def test_fused_qkv_rope(dtype, seq_length, hidden_size, rotary_percent, margin, tensor_format,
                        loss_func, interleaved, cp_size, start_positions, reference):
    """TE's test_fused_qkv_rope: packed [s, b, h_kv, 4d + d + d], q/k/v out, packed grad."""
    torch.manual_seed(seq_length + hidden_size)
    batch, kv_heads = SIZES["batch"], SIZES["kv_heads"]
    split = [4 * hidden_size, hidden_size, hidden_size]
    qkv = torch.rand((seq_length - margin, batch, kv_heads, sum(split)), dtype=dtype, device=DEVICE)
    if tensor_format == "bshd":
        qkv = qkv.transpose(0, 1).contiguous()
    starts = _random_start_positions(batch, margin) if start_positions else None
    q_freqs = RotaryPositionEmbedding(hidden_size, rotary_percent, interleaved=interleaved,
                                      device=DEVICE)(seq_length * cp_size)
    k_freqs = q_freqs * 0.5              # distinct angles for k, to catch a q/k mix-up
    for cp_rank in range(cp_size):
        # TE's fused-QKV backward takes no start_positions (nvte_fused_qkv_rope_backward), so
        # its gradient ignores them; ours is checked against the unfused reference instead.
        compare_qkv(qkv, q_freqs, k_freqs, split, loss_func, reference,
                     check_grad=not (reference == "te" and start_positions),
                     tensor_format=tensor_format, start_positions=starts, interleaved=interleaved,
                     cp_size=cp_size, cp_rank=cp_rank)


# =================================================================================================
# == 2. Independent references
#    The textbook rotation, float64 gradcheck, every element written, determinism, NaN and Inf,
#    odd sizes.
# =================================================================================================


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
    pos = torch.tensor(independent_positions(s, cp_size, cp_rank), device=DEVICE)
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
    # The tiles take cp_size as a compile-time 1 unless it is more (CONTEXT_PARALLEL).
    _, plan = set_rotary_kernel(t, freqs, interleaved=interleaved, cp_size=cp_size, cp_rank=cp_rank,
                                return_plan=True)
    assert plan.launch.cfg.CONTEXT_PARALLEL == (cp_size > 1)


GRADCHECK_CASES = [
    dict(tensor_format="sbhd"),
    dict(tensor_format="bshd", interleaved=True),
    dict(tensor_format="sbhd", rotary_dim=6, start_positions=[2, 0]),
    dict(tensor_format="sbhd", cp_size=2, cp_rank=1),
    dict(tensor_format="thd", cu_seqlens=[0, 3, 4, 8]),
    dict(tensor_format="thd", cu_seqlens=[0, 4, 8], cp_size=2, cp_rank=1, interleaved=True),
    # The rotation by the negated angles, whose backward swaps the sines without negating them.
    dict(tensor_format="sbhd", inverse=True),
    dict(tensor_format="thd", cu_seqlens=[0, 3, 4, 8], interleaved=True, inverse=True),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=_case_id)
def test_gradcheck_float64(case):
    case = dict(case)
    rotary_dim = case.pop("rotary_dim", 8)
    fmt = case["tensor_format"]
    cu = case.pop("cu_seqlens", None)
    if cu is not None:
        case["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    if "start_positions" in case:
        case["start_positions"] = torch.tensor(case["start_positions"], dtype=torch.int32, device=DEVICE)
    thd_tokens = cu[-1] // case.get("cp_size", 1) if cu else 0
    shape = {"sbhd": (4, 2, 2, 10), "bshd": (2, 4, 2, 10), "thd": (thd_tokens, 2, 10)}[fmt]
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    # Arbitrary (not pairwise equal) angles: checks the backward is the exact transpose.
    freqs = torch.randn(16, 1, 1, rotary_dim, device=DEVICE) * 3
    assert gradcheck(lambda x: apply_rotary_pos_emb(x, freqs, **case), (t,))


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
            torch.testing.assert_close(out, unfused_reference(t, freqs=freqs, interleaved=interleaved))


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
        compare(apply_rotary_pos_emb, t, non_overlapping_grad, reference, freqs=freqs,
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


@pytest.mark.parametrize("interleaved", [False, True])
def test_one_head_tiles_take_any_table(interleaved):
    """One-head tiles work out sin/cos once for both members of each pair where the table gives
    them the same angle bits (`SAME_HALVES_ONCE`), tiles of several heads always for each. On a
    table whose pairs match on some tiles and not on others (by one ulp, or by a quarter), a
    one-head call gives the bits of a two-head call's first head, forward and backward, and
    the reference formula's values."""
    torch.manual_seed(6)
    s, d = 12, 16
    table = RotaryPositionEmbedding(d, interleaved=interleaved, device=DEVICE)(s).clone()
    second = (lambda k: 2 * k + 1) if interleaved else (lambda k: d // 2 + k)
    up = torch.tensor(math.inf, device=DEVICE)
    table[4:8, 0, 0, second(1)] = torch.nextafter(table[4:8, 0, 0, second(1)], up)
    table[8:, 0, 0, second(0)] += 0.25
    pair = torch.randn(s, 1, 2, d, device=DEVICE)
    one = pair[:, :, :1].clone()
    # Four tokens of one head per tile: tokens 0-3 match, 4-7 differ by an ulp, 8-11 by 0.25.
    four_tokens = 4 * d * one.element_size()
    rule = triton_rotary_launch.launch_rule()._replace(tile_bytes=four_tokens,
                                                       one_head_tile_bytes=four_tokens)
    with triton_rotary_launch.use_launch_rule(rule):
        for backward in (False, True):
            alone = set_rotary_kernel(one, table, interleaved=interleaved, backward=backward)
            together = set_rotary_kernel(pair, table, interleaved=interleaved, backward=backward)
            assert torch.equal(alone.view(torch.int32), together[:, :, :1].view(torch.int32))
        compare(apply_rotary_pos_emb, one, non_overlapping_grad, "unfused", freqs=table,
                interleaved=interleaved)


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


def test_result_does_not_depend_on_batch():
    """A token's output is bit-identical whether it is rotated alone or inside a large batch,
    although the two calls get different tiles and grids, and alone it is a batch of one,
    whose tiles find its sequence index without a division (`BATCH_OF_ONE`): sbhd and bshd,
    angles from TE's table and from positions (the token placed by start_positions)."""
    torch.manual_seed(22)
    t = torch.randn(64, 16, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    module = RotaryPositionEmbedding(64, device=DEVICE)
    for fmt, x in (("sbhd", t), ("bshd", t.transpose(0, 1).contiguous())):
        for freqs in (module(64), module):
            for backward in (False, True):
                whole, plan = set_rotary_kernel(x, freqs, fmt, backward=backward, return_plan=True)
                assert not plan.launch.cfg.BATCH_OF_ONE
                for row in (0, 5, 63):
                    piece = x[row:row + 1, 3:4] if fmt == "sbhd" else x[3:4, row:row + 1]
                    alone, plan = set_rotary_kernel(piece.clone(), freqs, fmt, backward=backward,
                                                    start_positions=int_tensor([row]),
                                                    return_plan=True)
                    assert plan.launch.cfg.BATCH_OF_ONE
                    same = whole[row:row + 1, 3:4] if fmt == "sbhd" else whole[3:4, row:row + 1]
                    assert torch.equal(same, alone), (fmt, type(freqs), backward, row)
    # thd rows are addressed by the token already: never the flag.
    _, plan = set_rotary_kernel(t[0], module, "thd", cu_seqlens=int_tensor([0, 16]), return_plan=True)
    assert not plan.launch.cfg.BATCH_OF_ONE


def test_scaled_angles_match_float64():
    """Angles from positions are multiplied by the module's attention_scaling (YaRN's 1.139)
    and by nothing else: q alone, q and k in pair tiles, forward and backward (the backward
    rotates by the negated angles, with the same scale), against the float64 reference."""
    torch.manual_seed(23)
    q = torch.randn(8, 2, 3, 32, device=DEVICE)
    k = torch.randn(8, 2, 1, 32, device=DEVICE)
    yarn = RotaryPositionEmbedding(32, device=DEVICE, rope_scaling=YARN)
    plain = RotaryPositionEmbedding(32, device=DEVICE)
    assert yarn.attention_scaling > 1.1 and plain.attention_scaling == 1.0
    pos = torch.arange(8, dtype=torch.float64)[:, None, None].expand(8, 2, 16)
    for module in (yarn, plain):
        scale = module.attention_scaling
        for backward in (False, True):
            ref_q, ref_k = (rotate64(x, pos, module.inv_freq, False, scale=scale,
                                     transpose=backward) for x in (q, k))
            alone = set_rotary_kernel(q, module, backward=backward)
            pair = triton_rotary_launch.set_rotary_qk_kernel(q, k, module, backward=backward)
            for got, ref in ((alone, ref_q), (pair[0], ref_q), (pair[1], ref_k)):
                torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def test_negative_bit_inputs():
    """The kernel reads raw memory, so a tensor with the negative bit (a lazily negated view)
    must be resolved first, or the kernel reads the un-negated values. Each result must equal
    the same call on the resolved tensor, bit for bit."""
    torch.manual_seed(32)
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(8)
    base = torch.randn(4, 2, 3, 12, device=DEVICE)
    z = torch.complex(torch.randn_like(base), base)
    for view in (torch._neg_view(base), z.conj().imag):
        assert view.is_neg()
        resolved = view.resolve_neg()
        assert torch.equal(apply_rotary_pos_emb(view, freqs), apply_rotary_pos_emb(resolved, freqs))
        torch.testing.assert_close(apply_rotary_pos_emb(view, freqs), unfused_reference(resolved, freqs=freqs))
    # A negative-bit table, start positions and gradient.
    table = torch._neg_view(-freqs)
    starts = torch._neg_view(int_tensor([0, -1]))
    assert table.is_neg() and starts.is_neg()
    torch.testing.assert_close(apply_rotary_pos_emb(base, table, start_positions=starts[:2]),
                               apply_rotary_pos_emb(base, freqs, start_positions=int_tensor([0, 1])))
    grad = torch.randn_like(base)
    x = base.clone().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs)
    (with_neg,) = torch.autograd.grad(out, x, torch._neg_view(-grad), retain_graph=True)
    (plain,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(with_neg, plain)
    # Fused QKV: packed input and each incoming gradient with the negative bit.
    packed = torch.randn(4, 2, 2, 32, device=DEVICE)
    outs = apply_fused_qkv_rotary_pos_emb(torch._neg_view(packed), freqs, freqs * 0.5, [16, 8, 8])
    for out, ref in zip(outs, apply_fused_qkv_rotary_pos_emb(-packed, freqs, freqs * 0.5, [16, 8, 8])):
        assert torch.equal(out, ref)
    x = packed.clone().requires_grad_(True)
    outs = apply_fused_qkv_rotary_pos_emb(x, freqs, freqs * 0.5, [16, 8, 8])
    grads = [torch.randn_like(o) for o in outs]
    (with_neg,) = torch.autograd.grad(outs, x, [torch._neg_view(-g) for g in grads], retain_graph=True)
    assert torch.equal(with_neg, torch.autograd.grad(outs, x, grads)[0])
    # In place cannot resolve the bit without a copy: refused, naming t; out= likewise.
    with pytest.raises(ValueError, match=r"needs t without a negative"):
        apply_rotary_pos_emb_inplace(torch._neg_view(base.clone()), freqs)
    with pytest.raises(ValueError, match=r"out must not have the negative bit"):
        set_rotary_kernel(base, freqs, out=torch._neg_view(torch.empty_like(base)))


@pytest.mark.parametrize("path", ["table", "module", "qkv-table", "qkv-module"])
def test_double_backward_gradgradcheck(path):
    """The backward is itself differentiable (a bare launch in the backward would make
    create_graph=True silently give a gradient without a graph). float64, tiny shapes: every
    check runs the kernel through the interpreter."""
    torch.manual_seed(33)
    # Arbitrary table angles (pair members differ) check the transpose, not only a rotation.
    table = torch.randn(4, 1, 1, 8, device=DEVICE) * 3
    freqs = table if path.endswith("table") else RotaryPositionEmbedding(8, device=DEVICE)
    if path.startswith("qkv"):
        x = torch.randn(3, 1, 1, 30, dtype=torch.float64, device=DEVICE, requires_grad=True)
        k_freqs = (table.flip(0) if path.endswith("table")
                   else RotaryPositionEmbedding(8, rotary_base=50.0, device=DEVICE))
        fn = lambda x: apply_fused_qkv_rotary_pos_emb(x, freqs, k_freqs, [10, 10, 10])  # noqa: E731
    else:
        x = torch.randn(3, 1, 2, 10, dtype=torch.float64, device=DEVICE, requires_grad=True)
        fn = lambda x: apply_rotary_pos_emb(x, freqs, start_positions=int_tensor([1]))  # noqa: E731
    assert gradcheck(fn, (x,), order=2)


def test_gradient_penalty():
    """d/dw of ||dL/dx||^2 (a gradient penalty) through the kernel's double backward equals the
    unfused formula's, and, for a linear loss, the hand-computed 2 * w * ||c||^2."""
    torch.manual_seed(34)
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(6)
    t = torch.randn(6, 2, 3, 12, dtype=torch.float64, device=DEVICE)
    c = torch.randn_like(t)
    w0 = torch.randn(12, dtype=torch.float64, device=DEVICE)
    results = []
    for fused in (True, False):
        w = w0.clone().requires_grad_(True)
        x = t.clone().requires_grad_(True)
        y = apply_rotary_pos_emb(x * w, freqs, fused=fused)
        loss = (y * y * c).sum()                      # not linear: the penalty depends on y
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        (dw,) = torch.autograd.grad(gx.pow(2).sum(), w)
        results.append(dw)
    # The kernel's float64 sin/cos against the unfused formula's float32 ones.
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-6)
    # Linear loss <rope(w * x), c>: dL/dx = w * R^T c and R is a rotation (f1 == f2 here), so
    # ||dL/dx||^2 = w^2 ||c||^2 and its derivative is 2 * w * ||c||^2.
    w = torch.tensor(0.75, dtype=torch.float64, device=DEVICE, requires_grad=True)
    x = t.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad((apply_rotary_pos_emb(x * w, freqs) * c).sum(), x, create_graph=True)
    (dw,) = torch.autograd.grad(gx.pow(2).sum(), w)
    torch.testing.assert_close(dw, 2 * 0.75 * c.pow(2).sum())


def _norm64(x, weight, eps, offset, over):
    """RMSNorm from its definition in float64: x [..., h, d] over each head's d channels, or
    over all h * d of a token."""
    x, weight = x.double(), weight.double()
    rows = x.flatten(-2) if over == "token" else x
    rows = rows / torch.sqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)
    return rows.reshape(x.shape)


# (tensor format, norm over, interleaved, rotary dim of a 16-channel head, angles)
QK_NORM_CASES = [
    ("sbhd", "head", False, 16, "table"),
    ("bshd", "head", True, 10, "positions"),
    ("sbhd", "token", False, 12, "positions"),
    ("bshd", "token", True, 16, "table"),
    ("thd", "head", False, 8, "positions"),
    ("thd", "token", True, 16, "table"),
]


@pytest.mark.parametrize("fmt,over,interleaved,rotary_dim,angles", QK_NORM_CASES)
def test_qk_norm_matches_its_definition(fmt, over, interleaved, rotary_dim, angles):
    """RMSNorm (float64, from the definition) then the textbook rotation by e^{i theta}: the
    whole head normalized, only rotary_dim channels rotated; float32 within 1e-5."""
    torch.manual_seed(60)
    module = RotaryPositionEmbedding(rotary_dim, interleaved=interleaved, device=DEVICE)
    shape = {"sbhd": (9, 2, 3, 16), "bshd": (2, 9, 3, 16), "thd": (11, 3, 16)}[fmt]
    t = torch.randn(shape, device=DEVICE) * 3
    weight = torch.randn(16 if over == "head" else 48, device=DEVICE)
    kwargs = dict(norm_weight=weight, norm_eps=1e-5, norm_offset=0.5, norm_over=over, interleaved=interleaved)
    if fmt == "thd":
        pos = torch.cat((torch.arange(4), torch.arange(7)))
        kwargs["cu_seqlens"] = int_tensor([0, 4, 11])
    else:
        pos = torch.arange(9)[:, None].expand(9, 2) if fmt == "sbhd" else torch.arange(9)[None, :].expand(2, 9)
    freqs = module if angles == "positions" else module(16)
    out = apply_rotary_pos_emb(t, freqs, fmt, **kwargs)
    ref = rotate64(_norm64(t, weight, 1e-5, 0.5, over), pair_positions(pos, rotary_dim // 2), module.inv_freq,
                   interleaved)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    # The unfused formula, which rounds the norm's output once before rotating, agrees.
    unfused = apply_rotary_pos_emb(t, freqs, fmt, fused=False, **kwargs)
    torch.testing.assert_close(unfused.cpu().double(), ref, atol=1e-5, rtol=1e-5)


QK_NORM_GRADCHECK_CASES = [
    dict(tensor_format="sbhd", norm_over="head", rotary_dim=6),
    dict(tensor_format="bshd", norm_over="token", interleaved=True, norm_offset=1.0),
    dict(tensor_format="thd", norm_over="head", cu_seqlens=[0, 3, 4, 8], interleaved=True, inverse=True),
    dict(tensor_format="thd", norm_over="token", cu_seqlens=[0, 2, 7], rotary_dim=4),
    dict(tensor_format="sbhd", norm_over="head", angles="positions", start_positions=[2, 0]),
]


@pytest.mark.parametrize("case", QK_NORM_GRADCHECK_CASES, ids=_case_id)
def test_qk_norm_gradcheck_float64(case):
    """The gradients of the input and of the weight, against finite differences, with the
    backward's loop over several token blocks per program (a small launch rule)."""
    case = dict(case)
    rotary_dim = case.pop("rotary_dim", 8)
    fmt, over = case["tensor_format"], case.pop("norm_over")
    if "cu_seqlens" in case:
        case["cu_seqlens"] = int_tensor(case["cu_seqlens"])
    if "start_positions" in case:
        case["start_positions"] = int_tensor(case["start_positions"])
    tokens = int(case["cu_seqlens"][-1]) if fmt == "thd" else 0
    shape = {"sbhd": (4, 2, 2, 10), "bshd": (2, 4, 2, 10), "thd": (tokens, 2, 10)}[fmt]
    torch.manual_seed(61)
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(10 if over == "head" else 20, dtype=torch.float64, device=DEVICE, requires_grad=True)
    if case.pop("angles", "table") == "positions":
        freqs = RotaryPositionEmbedding(rotary_dim, interleaved=case.get("interleaved", False), device=DEVICE)
    else:
        freqs = torch.randn(16, 1, 1, rotary_dim, device=DEVICE) * 3
    rule = triton_rotary_launch.launch_rule()._replace(tile_bytes=256, search_tile_bytes=256,
                                                       norm_positions_tile_bytes=256,
                                                       norm_backward_warps_per_sm=1)
    with triton_rotary_launch.use_launch_rule(rule):
        assert gradcheck(
            lambda x, w: apply_rotary_pos_emb(x, freqs, norm_weight=w, norm_over=over, **case), (t, weight))


@pytest.mark.skipif(not ON_GPU and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7),
                    reason="the interpreters of Triton 3.5 and 3.6 cannot run a range over tensor bounds")
def test_qk_norm_pipelined_backward_matches_the_plain_loop():
    """The backward of a norm, its token loop software-pipelined (rule.norm_pipeline_stages,
    fused QKV's too), gives the same bits as the plain loop,
    dL/dweight included, with several token blocks per program; it is planned for angles from
    positions only, not from a table."""
    L = triton_rotary_launch
    torch.manual_seed(63)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    weight = torch.randn(16, device=DEVICE, requires_grad=True)
    calls = {
        "bshd": (torch.randn(2, 9, 3, 16, device=DEVICE), module, dict(tensor_format="bshd")),
        "sbhd_token": (torch.randn(9, 2, 3, 16, device=DEVICE), module, dict(norm_over="token")),
        "thd_positions": (torch.randn(11, 3, 16, device=DEVICE), module,
                          dict(tensor_format="thd", positions=int_tensor(list(range(11))))),
        "table": (torch.randn(9, 2, 3, 16, device=DEVICE), module(9), {}),
        "thd_cu_seqlens": (torch.randn(11, 3, 16, device=DEVICE), module,
                           dict(tensor_format="thd", cu_seqlens=int_tensor([0, 4, 11]))),
    }
    qkv = torch.randn(9, 2, 3, 64, device=DEVICE, requires_grad=True)

    def gradients():
        out = {}
        for name, (t, freqs, kwargs) in calls.items():
            t = t.detach().requires_grad_()
            w = weight if kwargs.get("norm_over") != "token" else weight.repeat(3).detach().requires_grad_()
            y = apply_rotary_pos_emb(t, freqs, norm_weight=w, **kwargs)
            out[name] = torch.autograd.grad(y, (t, w), torch.ones_like(y) + y.detach())
        q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, module, module, [32, 16, 16], q_norm_weight=weight,
                                                 k_norm_weight=weight)
        out["qkv"] = torch.autograd.grad((q * q).sum() + (k * k).sum() + v.sum(), (qkv, weight))
        return out

    small = L.launch_rule()._replace(tile_bytes=128, qkv_tile_bytes=256,
                                     norm_positions_tile_bytes=128, norm_backward_rows=2,
                                     norm_table_backward_rows=2,
                                     search_tile_bytes=128, min_programs_per_sm=0,
                                     norm_backward_warps_per_sm=1)
    results, stages = [], []
    for pipeline_stages in (0, 3):
        L._PLANS.clear()
        with L.use_launch_rule(small._replace(norm_pipeline_stages=pipeline_stages)):
            results.append(gradients())
            stages.append(sorted(p.launch.cfg.PIPELINE_STAGES for p in L._PLANS.values()
                                 if p.launch is not None and p.launch.cfg.NORM and p.launch.cfg.BACKWARD))
    for name in results[0]:
        for plain, pipelined in zip(results[0][name], results[1][name]):
            assert torch.equal(plain, pipelined), name
    # Backward plans: bshd, sbhd (token), thd with positions, thd with cu_seqlens (positions
    # from the pre-pass) and fused QKV pipelined; the table not.
    assert stages == [[0] * 6, [0, 3, 3, 3, 3, 3]], stages


# Each case: t's shape, the call's arguments, the norm over head or token, the angle source.
SAVED_RSTD_CASES = {
    "sbhd_head_table": ((9, 2, 3, 16), {}, "head", "table"),
    "bshd_token_exact": ((2, 9, 3, 16), dict(tensor_format="bshd"), "token", "exact"),
    "thd_token_exact": ((11, 3, 16), dict(tensor_format="thd", cu_seqlens=[0, 4, 11]), "token",
                        "exact"),
    "thd_head_table": ((11, 3, 16), dict(tensor_format="thd", cu_seqlens=[0, 4, 11]), "head",
                       "table"),
}


def _rstd_reference(t, over, eps):
    """1 / sqrt(mean(x^2) + eps) of every row of t in float64: [..., h] or [...]."""
    x = t.double() if over == "head" else t.double().flatten(-2)
    return 1.0 / torch.sqrt(x.square().mean(-1) + eps)


@pytest.mark.parametrize("name", SAVED_RSTD_CASES)
def test_qk_norm_forward_saves_rstd_and_backward_reads_it(name):
    """A norm given a buffer for its rows' rstd (`RMSNorm.rstd`, made by `norm_rstd`): the
    forward writes every row's 1 / sqrt(mean(x^2) + eps) (against float64) and returns what it
    returns without the buffer; the backward that reads the buffer gives the gradients (input
    and weight) of the backward that works rstd out again. On a GPU both hold up to rstd's last
    bits: the kernels are other kernels, whose tiles Triton may lay out otherwise (the store of
    rstd is one more use of the sums), and so add the squares in other orders. q and k in one
    call too, the key of one head taking pair tiles with the query."""
    L = triton_rotary_launch
    shape, kwargs, over, angles = SAVED_RSTD_CASES[name]
    kwargs = {k: int_tensor(v) if k == "cu_seqlens" else v for k, v in kwargs.items()}
    torch.manual_seed(71)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    freqs = module if angles == "exact" else module(16)
    t, grad = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    width = 16 if over == "head" else shape[-2] * 16
    norm = L.RMSNorm(1.0 + 0.1 * torch.randn(width, device=DEVICE), 1e-6, 0.0, over)
    saved = norm._replace(rstd=torch.full_like(L.norm_rstd(t, norm), float("nan")))
    assert saved.rstd.shape == (shape[:-1] if over == "head" else shape[:-2])
    out = L.set_rotary_kernel(t, freqs, norm=norm, **kwargs)
    torch.testing.assert_close(L.set_rotary_kernel(t, freqs, norm=saved, **kwargs), out,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved.rstd.double(), _rstd_reference(t, over, norm.eps), rtol=1e-6,
                               atol=0)
    recomputed = L.set_rotary_kernel(grad, freqs, backward=True, norm=norm, norm_input=t, **kwargs)
    read = L.set_rotary_kernel(grad, freqs, backward=True, norm=saved, norm_input=t, **kwargs)
    for a, b in zip(read, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    saved.rstd.mul_(2.0)        # the backward reads the buffer: other values, other gradients
    doubled = L.set_rotary_kernel(grad, freqs, backward=True, norm=saved, norm_input=t, **kwargs)
    assert not torch.allclose(doubled[0], read[0])
    # q and k of the same tokens, k of one head: pair tiles forward (a norm over each head)
    q, k = torch.randn(*shape[:-2], 4, 16, device=DEVICE), torch.randn(*shape[:-2], 1, 16, device=DEVICE)
    nq = L.RMSNorm(torch.rand(16 if over == "head" else 64, device=DEVICE), 1e-6, 1.0, over)
    nk = L.RMSNorm(torch.rand(16, device=DEVICE), 1e-6, 1.0, over)
    sq, sk = nq._replace(rstd=L.norm_rstd(q, nq)), nk._replace(rstd=L.norm_rstd(k, nk))
    outs = L.set_rotary_qk_kernel(q, k, freqs, q_norm=nq, k_norm=nk, **kwargs)
    for a, b in zip(L.set_rotary_qk_kernel(q, k, freqs, q_norm=sq, k_norm=sk, **kwargs), outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for x, n in ((q, sq), (k, sk)):
        torch.testing.assert_close(n.rstd.double(), _rstd_reference(x, over, 1e-6), rtol=1e-6,
                                   atol=0)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    recomputed = L.set_rotary_qk_kernel(gq, gk, freqs, backward=True, q_norm=nq, k_norm=nk,
                                        q_input=q, k_input=k, **kwargs)
    read = L.set_rotary_qk_kernel(gq, gk, freqs, backward=True, q_norm=sq, k_norm=sk, q_input=q,
                                  k_input=k, **kwargs)
    for a, b in zip(read, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_qk_norm_entry_points_save_rstd_over_the_token(monkeypatch, compiled):
    """The entry points' forwards save each row's rstd where `saves_rstd` says (a norm over
    the token), and their backwards hand that buffer to the launcher; a norm over each head
    saves none. Eager and under torch.compile (fullgraph: the forward's op returns the buffer,
    the backward's op takes it). Both give the unfused formula's gradients."""
    L, M = triton_rotary_launch, triton_rotary_main
    seen = []

    def recording(launcher):
        def record(*args, **kwargs):
            norms = [kwargs.get(k) for k in ("norm", "q_norm", "k_norm")]
            norms += [a for a in args if isinstance(a, L.RMSNorm)]
            seen.append([None if n is None or n.rstd is None else tuple(n.rstd.shape)
                         for n in norms if n is not None])
            return launcher(*args, **kwargs)
        return record

    monkeypatch.setattr(M, "set_rotary_kernel", recording(M.set_rotary_kernel))
    monkeypatch.setattr(M, "set_rotary_qk_kernel", recording(M.set_rotary_qk_kernel))
    torch.manual_seed(72)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    for over in ("token", "head"):
        t = torch.randn(5, 2, 3, 16, device=DEVICE, requires_grad=True)
        k = torch.randn(5, 2, 3, 16, device=DEVICE, requires_grad=True)
        w, wk = (torch.randn(48 if over == "token" else 16, device=DEVICE, requires_grad=True)
                 for _ in range(2))

        def loss(t, k, w, wk, fused):
            y = apply_rotary_pos_emb(t, module, norm_weight=w, norm_over=over, fused=fused)
            yq, yk = apply_rotary_pos_emb_qk(t, k, module, q_norm_weight=w, k_norm_weight=wk,
                                             norm_over=over, fused=fused)
            return (y * y).sum() + (yq * 2).sum() + (yk * yk).sum()

        fused_loss = torch.compile(loss, fullgraph=True) if compiled else loss
        seen.clear()
        inputs = (t, k, w, wk)
        fused_grads = torch.autograd.grad(fused_loss(*inputs, True), inputs)
        for a, b in zip(fused_grads, torch.autograd.grad(loss(*inputs, False), inputs)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        expected = (5, 2) if over == "token" else None
        # the forward and backward of each fused call: every norm with a buffer, or none
        assert sorted(seen, key=len) == [[expected]] * 2 + [[expected, expected]] * 2, (over, seen)


def test_qk_norm_rstd_buffer_is_checked():
    """A wrong `RMSNorm.rstd` is a named error: not a tensor (TypeError); another shape, dtype
    or device, or not contiguous (ValueError); given for q's norm and not k's; given to the
    fused QKV, which works rstd out in its backward."""
    L = triton_rotary_launch
    module = RotaryPositionEmbedding(16, device=DEVICE)
    t = torch.randn(4, 2, 3, 16, device=DEVICE)
    norm = L.RMSNorm(torch.ones(16, device=DEVICE), 1e-6, 0.0, "head")
    good = L.norm_rstd(t, norm)
    with pytest.raises(TypeError, match="norm_rstd must be a torch.Tensor"):
        L.set_rotary_kernel(t, module, norm=norm._replace(rstd=[1.0]))
    for bad in (good[:, :1], good.double(), good.transpose(0, 1).contiguous().transpose(0, 1),
                L.norm_rstd(t, norm._replace(over="token"))):
        with pytest.raises(ValueError, match="norm_rstd must be contiguous, of shape"):
            L.set_rotary_kernel(t, module, norm=norm._replace(rstd=bad))
    with pytest.raises(ValueError, match="q_norm.rstd and k_norm.rstd together"):
        L.set_rotary_qk_kernel(t, t, module, q_norm=norm._replace(rstd=good), k_norm=norm)
    qkv = torch.randn(4, 2, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="takes no rstd"):
        L.set_rotary_qkv_kernel(qkv, module, module, [32, 16, 16], q_norm=norm._replace(rstd=good),
                                k_norm=norm._replace(rstd=good))


THD_PREPASS_CASES = {
    # tokens before cu_seqlens[0] and from cu_seqlens[-1] on, an empty sequence, start positions
    "outside_and_start": (12, dict(cu_seqlens=[2, 5, 5, 9], start_positions=[3, 0, 7])),
    # context parallelism: rank 1 of 2 holds a quarter of each sequence from each half
    "cp": (10, dict(cu_seqlens=[0, 8, 20], cp_size=2, cp_rank=1)),
    # 40 sequences of 1-2 tokens: a tile crosses more sequence ends than it scans, so each
    # token searches on its own (`_tile_sequences`)
    "short": (60, dict(cu_seqlens=[0] + list(itertools.accumulate([1, 2] * 20)))),
}


@pytest.mark.parametrize("name", THD_PREPASS_CASES)
def test_thd_norm_backward_reads_positions_from_a_pre_pass(name):
    """A thd norm backward that would search cu_seqlens takes its tokens' positions from
    sequence_positions_kernel: for every token, the position _token_positions (PyTorch) gives,
    or OUTSIDE_SEQUENCES outside every sequence. The backward's plan reads them
    (SEQUENCE_POSITIONS) and its gradients match the unfused formula's."""
    L, K = triton_rotary_launch, triton_rotary_kernel
    tokens, kwargs = THD_PREPASS_CASES[name]
    kwargs = {key: int_tensor(v) if isinstance(v, list) else v for key, v in kwargs.items()}
    torch.manual_seed(64)
    t = torch.randn(tokens, 3, 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, device=DEVICE, requires_grad=True)
    module = RotaryPositionEmbedding(12, device=DEVICE)
    cp_size, cp_rank = kwargs.get("cp_size", 1), kwargs.get("cp_rank", 0)
    shape = L.check_rope_args(t, module, "thd", kwargs.get("start_positions"), kwargs["cu_seqlens"],
                              cp_size, cp_rank)
    launch = L._sequence_positions_launch(shape, "start_positions" in kwargs, cp_size)
    found = torch.full((tokens,), 7, dtype=torch.int64, device=DEVICE)
    launch((None, (0, 0, 0), kwargs.get("start_positions"), kwargs["cu_seqlens"]), found,
           shape.num_tokens, shape.seq_len, shape.batch, cp_size, cp_rank)
    pos, in_seq = triton_rotary_main._token_positions(shape, "thd", kwargs.get("start_positions"),
                                                      kwargs["cu_seqlens"], cp_size, cp_rank, device=DEVICE)
    assert not in_seq.all() or name != "outside_and_start"
    assert torch.equal(found, torch.where(in_seq, pos, K.OUTSIDE_SEQUENCES.value)), (found, pos, in_seq)

    grad = torch.randn_like(t)
    L._PLANS.clear()
    fused = torch.autograd.grad(apply_rotary_pos_emb(t, module, "thd", norm_weight=weight, **kwargs),
                                (t, weight), grad)
    unfused = torch.autograd.grad(
        apply_rotary_pos_emb(t, module, "thd", norm_weight=weight, fused=False, **kwargs), (t, weight), grad)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)    # float32 inv_freq's angles
    backward = [p for p in L._PLANS.values() if p.launch.cfg.BACKWARD]
    assert len(backward) == 1 and backward[0].positions_pass is not None
    assert backward[0].launch.cfg.POSITIONS_FROM == K.SEQUENCE_POSITIONS.value


def test_qk_norm_weight_gradient_is_deterministic_and_double_backward_raises():
    """dL/dweight is summed in a fixed order: bitwise the same on every run. A backward that
    records its own graph (double backward) is refused with an error that says so."""
    torch.manual_seed(62)
    t = torch.randn(64, 2, 4, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(32, device=DEVICE, requires_grad=True)
    freqs = RotaryPositionEmbedding(32, device=DEVICE)(64)
    grad = torch.randn_like(t)
    runs = [torch.autograd.grad(apply_rotary_pos_emb(t, freqs, norm_weight=weight), (t, weight), grad)
            for _ in range(3)]
    for dt, dw in runs[1:]:
        assert torch.equal(dt, runs[0][0]) and torch.equal(dw, runs[0][1])
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) through a fused QK-norm"):
        torch.autograd.grad(apply_rotary_pos_emb(t, freqs, norm_weight=weight), t, grad, create_graph=True)
    qkv = torch.randn(4, 2, 1, 96, device=DEVICE, requires_grad=True)
    outs = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 32, 32], q_norm_weight=weight, k_norm_weight=weight)
    with pytest.raises(RuntimeError, match="fused QK-norm"):
        torch.autograd.grad(outs[0].sum(), qkv, create_graph=True)


# =================================================================================================
# == 3. transformers parity
#    RoPE scaling, Hugging Face configs and M-RoPE, with transformers' own modules as the
#    oracle.
# =================================================================================================


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is the oracle for rope_scaling / M-RoPE")


def _quiet_transformers(tf):
    # Configs such as yarn with a factor unlike max/original length only warn; keep the log clean.
    tf.logging.set_verbosity_error()


# (model, config kwargs): Llama / Phi configs whose own rotary module gives transformers' inv_freq.
_HF_ROPE_CASES = {
    "default": ("llama", dict(head_dim=128, rope_theta=500000.0)),
    "default_partial": ("phi", dict(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4)),
    "linear_legacy_type_key": ("llama", dict(head_dim=64, rope_scaling={"type": "linear", "factor": 2.5})),
    "linear_partial": ("phi", dict(hidden_size=1024, num_attention_heads=8, partial_rotary_factor=0.5,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama3_1": ("llama", dict(head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama3_2": ("llama", dict(head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "llama3_original_from_max_positions": (
        "llama", dict(head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                    "high_freq_factor": 3.0})),
    # factors that are not powers of two, so rounding depends on the order of the float32 ops
    "llama3_odd_factor": ("llama", dict(head_dim=128, max_position_embeddings=32768,
                                        rope_scaling={"rope_type": "llama3", "factor": 6.0, "low_freq_factor": 1.5,
                                                      "high_freq_factor": 7.0,
                                                      "original_max_position_embeddings": 4096})),
    "yarn_odd_factor": ("llama", dict(head_dim=128, max_position_embeddings=32768,
                                      rope_scaling={"rope_type": "yarn", "factor": 3.3, "beta_fast": 64,
                                                    "truncate": False, "original_max_position_embeddings": 2048})),
    "yarn_qwen": ("llama", dict(head_dim=128, rope_theta=1000000.0, max_position_embeddings=131072,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768})),
    "yarn_mscale": ("llama", dict(head_dim=64, rope_theta=10000.0, max_position_embeddings=163840,
                                  rope_scaling={"rope_type": "yarn", "factor": 40, "mscale": 0.707,
                                                "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                                "original_max_position_embeddings": 4096})),
    "yarn_attention_factor_no_truncate": (
        "llama", dict(head_dim=64, rope_theta=150000.0, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "attention_factor": 1.25,
                                    "original_max_position_embeddings": 4096})),
    "yarn_factor_from_lengths": ("llama", dict(head_dim=96, max_position_embeddings=32768,
                                               rope_scaling={"rope_type": "yarn", "factor": None,
                                                             "original_max_position_embeddings": 4096})),
    "yarn_partial_legacy_keys": ("phi", dict(hidden_size=2048, num_attention_heads=16, partial_rotary_factor=0.5,
                                             rope_theta=20000.0, max_position_embeddings=8192,
                                             rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16})),
}


def _hf_rope_module(tf, model, kwargs):
    import copy
    kwargs = copy.deepcopy(kwargs)
    if model == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        kwargs.setdefault("hidden_size", 1024)
        kwargs.setdefault("num_attention_heads", 8)
        config = tf.LlamaConfig(**kwargs)
        return config, LlamaRotaryEmbedding(config)
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
    config = tf.PhiConfig(**kwargs)
    return config, PhiRotaryEmbedding(config)


@pytest.mark.parametrize("case", sorted(_HF_ROPE_CASES))
def test_inv_freq_and_attention_scaling_match_transformers(case):
    tf = _transformers()
    _quiet_transformers(tf)
    model, kwargs = _HF_ROPE_CASES[case]
    config, hf_rope = _hf_rope_module(tf, model, kwargs)
    expected_inv, expected_scale = hf_rope.inv_freq, hf_rope.attention_scaling
    assert expected_inv.dtype == torch.float32

    # Built by hand from the same numbers a user would read off the model card ...
    head_dim = kwargs.get("head_dim") or kwargs.get("hidden_size", 1024) // kwargs.get("num_attention_heads", 8)
    rope_scaling = {k: v for k, v in (kwargs.get("rope_scaling") or {}).items()}
    direct = RotaryPositionEmbedding(head_dim, rotary_percent=kwargs.get("partial_rotary_factor", 1.0),
                                     rotary_base=kwargs.get("rope_theta", 10000.0), device="cpu",
                                     rope_scaling=rope_scaling or None,
                                     max_position_embeddings=kwargs.get("max_position_embeddings", 2048))
    # ... from the config object, and from its serialised dict.
    from_obj = RotaryPositionEmbedding.from_hf_config(config, device="cpu")
    from_dict = RotaryPositionEmbedding.from_hf_config(config.to_dict(), device="cpu")
    for emb in (direct, from_obj, from_dict):
        assert emb.inv_freq.dtype == torch.float32 and emb.inv_freq.shape == expected_inv.shape
        assert torch.equal(emb.inv_freq, expected_inv)
        assert isinstance(emb.attention_scaling, float) and emb.attention_scaling == expected_scale
        assert emb.rotary_dim == 2 * expected_inv.numel()
        assert emb.n_axes == 1 and emb.mrope_section is None and not emb.mrope_interleaved
        assert emb.pair_axis.dtype == torch.int32 and not emb.pair_axis.any()
        assert emb.pair_axis.shape == expected_inv.shape


def test_yarn_attention_scaling_follows_the_paper():
    """Independent of transformers: YaRN's mscale, 0.1 * ln(s) + 1, and DeepSeek's ratio form."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    emb = RotaryPositionEmbedding(64, device="cpu", rope_scaling=yarn)
    assert emb.attention_scaling == pytest.approx(0.1 * math.log(16.0) + 1)
    ds = dict(yarn, mscale=0.5, mscale_all_dim=2.0)
    emb = RotaryPositionEmbedding(64, device="cpu", rope_scaling=ds)
    assert emb.attention_scaling == pytest.approx((0.05 * math.log(16.0) + 1) / (0.2 * math.log(16.0) + 1))
    # High frequencies are kept, low ones interpolated by the factor.
    base = RotaryPositionEmbedding(64, device="cpu").inv_freq
    assert torch.equal(emb.inv_freq[:2], base[:2])
    torch.testing.assert_close(emb.inv_freq[-2:], base[-2:] / 16.0)


def test_from_hf_config_latent_attention_dim_and_pairs():
    """DeepSeek-V3 (latent attention): the rotary dim is qk_rope_head_dim, also from a
    config.json without head_dim; rope_interleave=True pairs adjacent channels, so q . k after
    our rotation equals transformers' (apply_rotary_pos_emb_interleave de-interleaves q and k
    first, a permutation of channels both share); a latent-attention config without
    rope_interleave is refused unless `interleaved` is given, and a given one wins."""
    tf = _transformers()
    _quiet_transformers(tf)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek
    config = tf.DeepseekV3Config(hidden_size=128, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                 v_head_dim=32, kv_lora_rank=32, q_lora_rank=None, max_position_embeddings=64)
    assert config.rope_interleave is True
    hf_rope = deepseek.DeepseekV3RotaryEmbedding(config)
    emb = RotaryPositionEmbedding.from_hf_config(config, device="cpu")
    assert emb.rotary_dim == 16 and emb.interleaved and torch.equal(emb.inv_freq, hf_rope.inv_freq)

    torch.manual_seed(46)
    b, h, s, d = 2, 3, 5, 16
    q, k = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    cos, sin = hf_rope(q, torch.arange(s).expand(b, s))
    q_hf, k_hf = deepseek.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    q_ours, k_ours = (apply_rotary_pos_emb(x.transpose(1, 2).to(DEVICE), emb.to(DEVICE), "bshd", interleaved=True)
                      for x in (q, k))
    torch.testing.assert_close(torch.einsum("bshd,bthd->bhst", q_ours, k_ours).cpu(),
                               torch.einsum("bhsd,bhtd->bhst", q_hf, k_hf), rtol=1e-5, atol=1e-5)

    config_json = {key: value for key, value in config.to_dict().items() if key not in ("head_dim", "rope_interleave")}
    with pytest.raises(ValueError, match="qk_rope_head_dim.* pass interleaved=True or False"):
        RotaryPositionEmbedding.from_hf_config(config_json)
    for interleaved in (True, False):
        from_json = RotaryPositionEmbedding.from_hf_config(config_json, interleaved=interleaved)
        assert from_json.rotary_dim == 16 and from_json.interleaved is interleaved
        assert torch.equal(from_json.inv_freq.cpu(), hf_rope.inv_freq)
    assert not RotaryPositionEmbedding.from_hf_config(config, interleaved=False).interleaved


def test_from_hf_config_transformers4_and_5_layouts():
    tf = _transformers()
    _quiet_transformers(tf)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    config = tf.PhiConfig(hidden_size=1024, num_attention_heads=8, partial_rotary_factor=0.5, rope_theta=20000.0,
                          max_position_embeddings=8192, rope_scaling=dict(yarn))
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
    hf_rope = PhiRotaryEmbedding(config)
    v4 = {"hidden_size": 1024, "num_attention_heads": 8, "head_dim": None, "partial_rotary_factor": 0.5,
          "rope_theta": 20000.0, "max_position_embeddings": 8192, "rope_scaling": dict(yarn)}
    v5 = {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 8192,
          "rope_parameters": dict(yarn, rope_theta=20000.0, partial_rotary_factor=0.5)}
    # head_dim, when given, wins over hidden_size // num_attention_heads
    v5_head_dim = dict(v5, hidden_size=999, num_attention_heads=7, head_dim=128)
    for cfg in (v4, v5, v5_head_dim):
        emb = RotaryPositionEmbedding.from_hf_config(cfg, device="cpu")
        assert torch.equal(emb.inv_freq, hf_rope.inv_freq), cfg
        assert emb.attention_scaling == hf_rope.attention_scaling
        assert emb.rotary_dim == 64 and emb.rope_type == "yarn"
    assert v4["rope_scaling"] == yarn, "from_hf_config must not modify the caller's config"

    # Phi-3 style: a top-level original_max_position_embeddings takes precedence in transformers.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    llama = tf.LlamaConfig(head_dim=64, max_position_embeddings=16384, original_max_position_embeddings=4096,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})
    expected, _ = ROPE_INIT_FUNCTIONS["yarn"](llama)
    two_k = RotaryPositionEmbedding(64, device="cpu", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 2048})
    assert not torch.equal(two_k.inv_freq, expected)      # so the precedence below is observable
    assert torch.equal(RotaryPositionEmbedding.from_hf_config(llama, device="cpu").inv_freq, expected)

    # No rope information at all: transformers' defaults (theta 10000, full rotation).
    plain = RotaryPositionEmbedding.from_hf_config({"hidden_size": 512, "num_attention_heads": 8}, device="cpu")
    default_cfg, default_rope = _hf_rope_module(tf, "llama", dict(hidden_size=512, num_attention_heads=8))
    assert torch.equal(plain.inv_freq, default_rope.inv_freq) and plain.attention_scaling == 1.0


def _mrope_configs(tf, interleaved):
    """(text config, the same rope wrapped as a VL model config, as transformers 4 would save it)."""
    if interleaved:     # Qwen3-VL: 16 pairs, H and W each take 4 pairs of every third one
        rope = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [8, 4, 4], "mrope_interleaved": True}
        text = tf.Qwen3VLTextConfig(hidden_size=64, num_attention_heads=2, head_dim=32, num_key_value_heads=2,
                                    rope_parameters=dict(rope))
        wrapper = tf.Qwen3VLConfig(text_config=text.to_dict())
        legacy = {"text_config": {"hidden_size": 64, "num_attention_heads": 2, "head_dim": 32,
                                  "rope_theta": 100.0, "rope_scaling": {k: v for k, v in rope.items()
                                                                        if k != "rope_theta"}}}
        return text, wrapper, legacy
    # Qwen2-VL: contiguous blocks of 4, 6 and 6 pairs; head_dim from hidden_size / heads
    text = tf.Qwen2VLTextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                                 "mrope_section": [4, 6, 6]})
    wrapper = tf.Qwen2VLConfig(text_config=text.to_dict())
    legacy = {"hidden_size": 64, "num_attention_heads": 2, "rope_theta": 100.0,      # Qwen2-VL's own config.json
              "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}
    return text, wrapper, legacy


def _hf_mrope_module(tf, text_config, interleaved):
    if interleaved:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
        return Qwen3VLTextRotaryEmbedding(text_config)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    return Qwen2VLRotaryEmbedding(text_config)


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_vl", "qwen3_vl"])
def test_mrope_pair_axis_matches_transformers(interleaved):
    tf = _transformers()
    _quiet_transformers(tf)
    text, wrapper, legacy = _mrope_configs(tf, interleaved)
    hf_rope = _hf_mrope_module(tf, text, interleaved)
    seq = 16
    i = torch.arange(seq)
    # temporal, height and width positions that differ from each other by a different amount at
    # every token, so no pair's angle can match a wrong axis at all tokens by aliasing mod 2*pi
    positions = torch.stack([i, 2 * i + 11, 3 * i + 29])                  # [3, seq]
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    n_pairs = hf_rope.inv_freq.numel()
    cos, sin = cos[0, :, :n_pairs].double(), sin[0, :, :n_pairs].double()   # [seq, pairs]

    inv = hf_rope.inv_freq.double()
    per_axis = positions.double()[:, :, None] * inv                        # [3, seq, pairs]
    embs = [RotaryPositionEmbedding.from_hf_config(c, device="cpu") for c in (text, wrapper, legacy)]
    for emb in embs:
        assert torch.equal(emb.inv_freq, hf_rope.inv_freq)
        assert emb.n_axes == 3 and emb.mrope_interleaved is interleaved
        assert emb.mrope_section == tuple(hf_rope.mrope_section)
        assert emb.pair_axis.dtype == torch.int32 and emb.pair_axis.shape == (n_pairs,)
        assert torch.equal(emb.pair_axis, embs[0].pair_axis)
    axis = embs[0].pair_axis.long()
    angle = per_axis[axis, :, torch.arange(n_pairs)].T                       # [seq, pairs]
    torch.testing.assert_close(cos, angle.cos(), atol=1e-4, rtol=0)
    torch.testing.assert_close(sin, angle.sin(), atol=1e-4, rtol=0)
    # every wrong axis would have been caught, for every pair
    for wrong in range(1, 3):
        other = per_axis[(axis + wrong) % 3, :, torch.arange(n_pairs)].T
        gap = torch.maximum((other.cos() - angle.cos()).abs(), (other.sin() - angle.sin()).abs())
        assert (gap.amax(dim=0) > 1e-2).all()
    # all three axes are in use, and the interleaved layout leaves the tail to the temporal axis
    assert set(axis.tolist()) == {0, 1, 2}
    if interleaved:
        assert axis[12:].tolist() == [0, 0, 0, 0]


def _hf_pair_axis(hf_rope):
    """Which position axis each pair of a transformers M-RoPE module rotates by, read from its
    cos, worked out as it works it out (float32), at positions whose axes lie 2e5 apart: far
    enough for the slowest pair of a 128-dim head to tell them apart (0.5 rad at theta 5e5)."""
    i = torch.arange(16)
    positions = torch.stack([997 * i, 997 * i + 200_000, 997 * i + 400_000])  # [3, seq]
    cos, _ = hf_rope(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    n_pairs = hf_rope.inv_freq.numel()
    cos = cos[0, :, :n_pairs]                                              # [seq, pairs]
    per_axis = (positions.float()[:, :, None] * hf_rope.inv_freq.float()).cos()  # [3, seq, pairs]
    matches = ((per_axis - cos).abs().amax(dim=1) < 1e-6)                  # [3, pairs]
    assert (matches.sum(dim=0) == 1).all(), matches.sum(dim=0)
    return matches.int().argmax(dim=0)


@pytest.mark.parametrize("model", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_from_hf_config_mrope_layout_of_the_model(model):
    """Qwen3-VL's and Qwen3.5's rotary embeddings in transformers interleave the M-RoPE axes
    whatever the config says, with a default mrope_section where it has none: from_hf_config
    builds the same layout from a config without the rope keys, with the section but not the
    flag, and with the flag False, each against transformers' module (pair by pair)."""
    tf = _transformers()
    _quiet_transformers(tf)
    classes = {"qwen3_vl": ("Qwen3VLTextConfig", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextRotaryEmbedding"),
               "qwen3_vl_moe": ("Qwen3VLMoeTextConfig", "qwen3_vl_moe.modeling_qwen3_vl_moe",
                                "Qwen3VLMoeTextRotaryEmbedding"),
               "qwen3_5": ("Qwen3_5TextConfig", "qwen3_5.modeling_qwen3_5", "Qwen3_5TextRotaryEmbedding")}
    config_name, module_name, rope_name = classes[model]
    if not hasattr(tf, config_name):
        pytest.skip(f"transformers {tf.__version__} has no {config_name}")
    import importlib
    hf_class = getattr(importlib.import_module(f"transformers.models.{module_name}"), rope_name)
    default = getattr(tf, config_name)()
    theta = default.rope_parameters["rope_theta"]
    partial = default.rope_parameters.get("partial_rotary_factor", 1.0)
    n_pairs = int(default.head_dim * partial) // 2
    section = [n_pairs - 2 * (n_pairs // 3), n_pairs // 3, n_pairs // 3]  # not the default one
    variants = {"no rope keys": {}, "section only": {"mrope_section": section},
                "flag False": {"mrope_section": section, "mrope_interleaved": False}}
    for name, keys in variants.items():
        config = getattr(tf, config_name)(rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                           **({"partial_rotary_factor": partial}
                                                              if partial != 1.0 else {}), **keys})
        hf_rope = hf_class(config)
        emb = RotaryPositionEmbedding.from_hf_config(config, device="cpu")
        assert torch.equal(emb.inv_freq, hf_rope.inv_freq), name
        assert emb.n_axes == 3 and emb.mrope_interleaved, name
        assert emb.mrope_section == tuple(hf_rope.mrope_section), name
        assert torch.equal(emb.pair_axis.long(), _hf_pair_axis(hf_rope)), name
        assert set(emb.pair_axis.tolist()) == {0, 1, 2}, name


def test_mrope_pair_axis_rules():
    """The layouts spelled out (the Qwen2-VL / Qwen3-VL papers' descriptions)."""
    contiguous = RotaryPositionEmbedding(20, device="cpu", mrope_section=[2, 3, 5])
    assert contiguous.pair_axis.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    interleaved = RotaryPositionEmbedding(20, device="cpu", mrope_section=(4, 3, 3), mrope_interleaved=True)
    assert interleaved.pair_axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    short = RotaryPositionEmbedding(20, device="cpu", mrope_section=(6, 2, 2), mrope_interleaved=True)
    assert short.pair_axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 0, 0]
    assert short.mrope_section == (6, 2, 2) and short.n_axes == 3
    two_axes = RotaryPositionEmbedding(16, device="cpu", mrope_section=[5, 3], interleaved=True)
    assert two_axes.n_axes == 2 and two_axes.pair_axis.tolist() == [0] * 5 + [1] * 3 and two_axes.interleaved
    # M-RoPE changes which position a pair uses, never its frequency or the text-only table
    plain = RotaryPositionEmbedding(20, device="cpu")
    assert torch.equal(contiguous.inv_freq, plain.inv_freq) and torch.equal(contiguous(7, 3), plain(7, 3))


@pytest.mark.parametrize("case", ["llama3_1", "yarn_mscale", "default_partial"])
def test_rotary_position_embedding_table_matches_transformers(case):
    """forward()'s angle table, turned into cos/sin, is what the transformers model uses."""
    tf = _transformers()
    _quiet_transformers(tf)
    model, kwargs = _HF_ROPE_CASES[case]
    config, hf_rope = _hf_rope_module(tf, model, kwargs)
    emb = RotaryPositionEmbedding.from_hf_config(config, device="cpu")
    seq, offset = 40, 1000
    table = emb(seq, offset=offset)
    assert table.shape == (seq, 1, 1, emb.rotary_dim) and table.dtype == torch.float32
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), (torch.arange(seq) + offset)[None])
    torch.testing.assert_close(table[:, 0, 0].cos() * emb.attention_scaling, cos[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(table[:, 0, 0].sin() * emb.attention_scaling, sin[0], atol=2e-6, rtol=0)
    # and the angles themselves are position times the scaled frequency, rotate-half layout
    expected = (torch.arange(seq, dtype=torch.float64) + offset)[:, None] * hf_rope.inv_freq.double()
    torch.testing.assert_close(table[:, 0, 0].double(), torch.cat((expected, expected), -1), rtol=1e-7, atol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_vl", "qwen3_vl"])
def test_mrope_matches_transformers(interleaved):
    """transformers 5 applies M-RoPE with the models' `apply_rotary_pos_emb` (q, k [b, h, s, d],
    cos/sin [b, s, d] recomposed per axis by the rotary module); ours takes the same tensors as
    bshd views and the [3, b, s] position ids."""
    tf = _transformers()
    _quiet_transformers(tf)
    import importlib
    model = "qwen3_vl" if interleaved else "qwen2_vl"
    hf_apply = importlib.import_module(f"transformers.models.{model}.modeling_{model}").apply_rotary_pos_emb
    text, _, _ = _mrope_configs(tf, interleaved)
    hf_rope = _hf_mrope_module(tf, text, interleaved)
    emb = RotaryPositionEmbedding.from_hf_config(text, device=DEVICE)
    torch.manual_seed(45)
    b, s, heads, kv_heads, d = 2, 10, 2, 1, 32
    pos = torch.randint(0, 4096, (3, b, s))
    q, k = torch.randn(b, heads, s, d), torch.randn(b, kv_heads, s, d)
    cos, sin = hf_rope(q, pos)
    hf_q, hf_k = hf_apply(q, k, cos, sin)
    pair_pos = pair_positions(pos, d // 2, mrope_axis_rule(text.rope_parameters["mrope_section"], interleaved))
    for x, hf_out in ((q, hf_q), (k, hf_k)):
        ours = apply_rotary_pos_emb(x.transpose(1, 2).to(DEVICE), emb, "bshd", positions=pos.to(DEVICE))
        ours = ours.transpose(1, 2).cpu()
        # transformers rounds position * inv_freq to float32 (up to 2^-13 rad below 4096, so up to
        # ~6e-4 on these values); a wrong axis or pair layout would be off by O(1)
        torch.testing.assert_close(ours, hf_out, rtol=0, atol=1e-3)
        ref = rotate64(x.transpose(1, 2), pair_pos, emb.inv_freq, False).transpose(1, 2)
        assert rel_error(ours, ref) < EXACT_REL_TOL
        assert rel_error(ours, ref) < rel_error(hf_out, ref)


# (model, its RMSNorm class, norm_offset, norm_over): Qwen3 and Gemma 3 normalize each head,
# OLMo 2 the whole projection of a token.
QK_NORM_MODELS = [("qwen3", "Qwen3RMSNorm", 0.0, "head"), ("gemma3", "Gemma3RMSNorm", 1.0, "head"),
                  ("olmo2", "Olmo2RMSNorm", 0.0, "token")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model,norm_class,offset,over", QK_NORM_MODELS, ids=[m[0] for m in QK_NORM_MODELS])
def test_qk_norm_matches_transformers(model, norm_class, offset, over, dtype):
    """transformers' own RMSNorm module, then its apply_rotary_pos_emb (q [b, h, s, d]): the
    same outputs and gradients (input and weight) as one fused call on the bshd view. In
    bfloat16 the module rounds between norm and rotation and ours rounds once: ours is at
    least as close to the float64 result, on average over the elements."""
    tf = _transformers()
    _quiet_transformers(tf)
    import importlib
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    torch.manual_seed(63)
    b, s, h, d = 2, 24, 4, 32
    norm = getattr(modeling, norm_class)(d if over == "head" else h * d, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    norm = norm.to(dtype)
    rope = RotaryPositionEmbedding(d, device="cpu")
    freqs = rope(s)
    cos, sin = freqs[:, 0, 0].cos()[None].to(dtype), freqs[:, 0, 0].sin()[None].to(dtype)
    x = torch.randn(b, s, h, d, dtype=dtype) * 4
    grad = torch.randn(b, s, h, d, dtype=dtype)

    x_hf = x.clone().requires_grad_(True)
    normed = norm(x_hf.flatten(-2)).unflatten(-1, (h, d)) if over == "token" else norm(x_hf)
    hf_out, _ = modeling.apply_rotary_pos_emb(normed.transpose(1, 2), normed.transpose(1, 2), cos, sin)
    hf_out = hf_out.transpose(1, 2)
    hf_dx, hf_dw = torch.autograd.grad(hf_out, (x_hf, norm.weight), grad)

    x_ours = x.to(DEVICE).requires_grad_(True)
    weight = norm.weight.detach().to(DEVICE).requires_grad_(True)
    kwargs = dict(norm_eps=1e-6, norm_offset=offset, norm_over=over)
    out = apply_rotary_pos_emb(x_ours, freqs.to(DEVICE), "bshd", norm_weight=weight, **kwargs)
    dx, dw = (g.cpu() for g in torch.autograd.grad(out, (x_ours, weight), grad.to(DEVICE)))
    out = out.detach().cpu()
    if not ON_GPU:
        # Triton's interpreter converts float32 to bfloat16 by truncation (the GPU rounds to
        # nearest even): the kernel's single rounding is taken from its float32 result here.
        out = apply_rotary_pos_emb(x.float().to(DEVICE), freqs.to(DEVICE), "bshd",
                                   norm_weight=weight.detach().float(), **kwargs).cpu().to(dtype)

    exact = rotate64(_norm64(x, norm.weight.detach(), 1e-6, offset, over), pair_positions(torch.arange(s), d // 2),
                     rope.inv_freq, False)
    if dtype == torch.float32:
        torch.testing.assert_close(out, hf_out.detach(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(dx, hf_dx, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(dw, hf_dw, atol=1e-4, rtol=1e-5)
    else:
        mean_error = lambda y: (y.double() - exact).abs().mean().item()      # noqa: E731
        assert mean_error(out) <= mean_error(hf_out.detach()), (mean_error(out), mean_error(hf_out.detach()))
        torch.testing.assert_close(out, hf_out.detach(), atol=0.25, rtol=0.05)
        scale = lambda y: y.abs().max().item()                                # noqa: E731
        assert (dx - hf_dx).abs().max() <= 0.05 * scale(hf_dx)
        assert (dw - hf_dw).abs().max() <= 0.05 * scale(hf_dw)


# =================================================================================================
# == 4. Angles from positions
#    Exactness against float64, the sin/cos bound, the single-rounding fma, positions and
#    M-RoPE. The references are written from the definition in float64 (rotate64), never through
#    fused=False, which shares the launcher's position logic.
# =================================================================================================


def test_positions_past_int32():
    """Positions past 2^31 - 1 (a stride-0 table with 2^31 + 10 rows, start positions near
    2^31, a huge cp_size) are computed in int64: in int32 they would wrap negative (NaN) or
    read the wrong row. The expanded row holds arbitrary angles, so a wrong channel shows."""
    torch.manual_seed(35)
    d2, rows = 8, 2**31 + 10
    row = torch.randn(1, 1, 1, d2, device=DEVICE) * 3
    table = row.expand(rows, 1, 1, d2)
    assert table.stride(0) == 0
    t = torch.randn(8, 2, 2, 12, dtype=torch.float64, device=DEVICE)
    short = torch.randn(2, 2, 2, 12, dtype=torch.float64, device=DEVICE)
    thd = torch.randn(8, 2, 12, dtype=torch.float64, device=DEVICE)
    i64 = functools.partial(int_tensor, dtype=torch.int64)
    cp = 2**28                                     # s * cp_size = 2^31 rows needed
    cases = [
        # int32 start positions whose sum with the token index passes 2^31 - 1.
        (t, dict(start_positions=int_tensor([2**31 - 3, 5]))),
        (t, dict(start_positions=i64([2**31 + 1, 2**31 - 8]))),
        # Rank 0 holds the last chunk: position 2 * cp_size - 1 = 2^31 + 7.
        (short, dict(cp_size=2**30 + 4, cp_rank=0)),
        (short, dict(cp_size=2**30 + 4, cp_rank=1)),
        (t, dict(cp_size=cp, cp_rank=cp - 1)),
        (t, dict(positions=i64([2**31 + 5, 2**31 + 9, 7, 2**31 - 1, 0, 1, 2**31, 3]))),
        (thd, dict(tensor_format="thd", cu_seqlens=int_tensor([0, 3, 8]),
                   start_positions=int_tensor([2**31 - 4, 2**31 - 2]))),
        # The thd search compares cu_seqlens with (token + 1) * cp_size = 2^31 here.
        (thd, dict(tensor_format="thd", cu_seqlens=i64([0, 8 * cp]), cp_size=cp, cp_rank=cp - 1)),
        (thd, dict(tensor_format="thd", cu_seqlens=int_tensor([0, 2**31 - 1]), cp_size=cp, cp_rank=3)),
    ]
    for x, kwargs in cases:
        (out, dx), (ref, ref_dx) = fused_and_unfused(x, table, grad=torch.randn_like(x), **kwargs)
        assert out.isfinite().all(), kwargs
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-6)
        # Every token sees the same row: the rotation by that row alone, at position 0..s-1
        # of an ordinary table; thd tokens past cu_seqlens[-1] // cp_size pass through.
        single = apply_rotary_pos_emb(x, row.expand(x.shape[0], 1, 1, d2), fused=False,
                                      tensor_format=kwargs.get("tensor_format", "sbhd"),
                                      cu_seqlens=int_tensor([0, x.shape[0]]) if x is thd else None)
        if x is thd:
            end = int(kwargs["cu_seqlens"][-1]) // kwargs.get("cp_size", 1)
            outside = torch.arange(x.shape[0], device=DEVICE) >= end
            single[outside] = x[outside]
        torch.testing.assert_close(out, single, atol=1e-6, rtol=1e-6)


def _worst_token_rel_error(out, ref, lead):
    """The largest per-token ||out - ref|| / ||ref||: one wrong token among many cannot hide
    in the overall norm. `lead` is the number of token dims (2 for sbhd/bshd, 1 for thd)."""
    diff = (out.detach().double().cpu() - ref).flatten(lead).norm(dim=-1)
    return (diff / ref.flatten(lead).norm(dim=-1)).max().item()


def _random_exact_positions(gen, *shape):
    """Random positions in [0, 2^24), in no order, with the extremes 0, 1 and 2^24 - 1 among them."""
    flat = torch.randint(0, MAX_EXACT_POSITION + 1, shape, generator=gen).view(-1)
    flat[:3] = torch.tensor([MAX_EXACT_POSITION, 0, 1])
    return flat[torch.randperm(flat.numel(), generator=gen)].view(shape)


def _cat_ranges(lengths, starts):
    return torch.cat([torch.arange(n) + st for n, st in zip(lengths, starts)])


def _exact_case(name, head_dim, gen):
    """(t's shape, the call's keyword arguments, every token's position shaped as t's token
    dims). The positions are worked out here from TE's definitions, not read from the code."""
    s, b, h, d = 6, 2, 2, head_dim
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
    if name == "sbhd_positions_s":
        pos = _random_exact_positions(gen, s)
        return (s, b, h, d), dict(positions=pos.to(DEVICE)), pos[:, None].expand(s, b)
    if name == "sbhd_positions_bs":
        pos = _random_exact_positions(gen, b, s)
        return (s, b, h, d), dict(positions=pos.to(DEVICE)), pos.T
    if name == "bshd_positions_bs":
        pos = _random_exact_positions(gen, b, s)
        return (b, s, h, d), dict(tensor_format="bshd", positions=pos.to(DEVICE)), pos
    if name == "bshd_positions_s_int32":
        pos = _random_exact_positions(gen, s)
        return (b, s, h, d), dict(tensor_format="bshd", positions=ints(pos.tolist())), pos[None].expand(b, s)
    if name == "thd_positions":
        pos = _random_exact_positions(gen, 9)
        return (9, h, d), dict(tensor_format="thd", positions=pos.to(DEVICE)), pos
    if name == "sbhd_start":            # implicit: token i of sequence j at i + start[j]
        start = [MAX_EXACT_POSITION - s + 1, 2**23 + 12345]
        return ((s, b, h, d), dict(start_positions=ints(start)),
                torch.arange(s)[:, None] + torch.tensor(start)[None, :])
    if name == "bshd_start":
        start = [2**20 + 3, MAX_EXACT_POSITION - s + 1]
        return ((b, s, h, d), dict(tensor_format="bshd", start_positions=ints(start)),
                torch.tensor(start)[:, None] + torch.arange(s)[None, :])
    if name == "thd_cu_start":          # an empty sequence among them
        cu, start = [0, 3, 3, 8, 10], [MAX_EXACT_POSITION - 2, 5, 2**22 + 1, MAX_EXACT_POSITION - 1]
        lengths = [e - a for a, e in zip(cu[:-1], cu[1:])]
        return ((10, h, d), dict(tensor_format="thd", cu_seqlens=ints(cu), start_positions=ints(start)),
                _cat_ranges(lengths, start))
    # Context parallelism excludes start_positions and positions, so a rank's positions stay
    # below s * cp_size: this checks the load-balanced split on the exact path, not large angles.
    if name == "sbhd_cp":
        pos = torch.tensor(independent_positions(8, 4, 2))
        return (8, b, h, d), dict(cp_size=4, cp_rank=2), pos[:, None].expand(8, b)
    if name == "thd_cp":
        cu, cp_size, cp_rank = [0, 8, 20, 24], 2, 1
        local = [(e - a) // cp_size for a, e in zip(cu[:-1], cu[1:])]
        pos = torch.cat([torch.tensor(independent_positions(n, cp_size, cp_rank)) for n in local])
        return ((sum(local), h, d), dict(tensor_format="thd", cu_seqlens=ints(cu), cp_size=cp_size,
                                         cp_rank=cp_rank), pos)
    raise AssertionError(name)


# (case, head dim, rope type): rotary dim 32 throughout, so head dim 40 / 48 leaves channels to
# copy through; yarn cases carry an attention_scaling != 1.
_EXACT_CASES = [
    ("sbhd_positions_s", 40, "default"), ("sbhd_positions_bs", 32, "yarn"),
    ("bshd_positions_bs", 40, "yarn"), ("bshd_positions_s_int32", 32, "default"),
    ("thd_positions", 48, "yarn"), ("sbhd_start", 32, "default"), ("bshd_start", 40, "yarn"),
    ("thd_cu_start", 40, "default"), ("sbhd_cp", 40, "yarn"), ("thd_cp", 32, "default"),
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case,head_dim,rope", _EXACT_CASES, ids=[c[0] for c in _EXACT_CASES])
def test_angles_from_positions_exact(case, head_dim, rope, interleaved):
    """float32 input, positions up to 2^24 - 1, forward and backward within 2e-6
    (relative) of the float64 rotation by position * inv_freq."""
    gen = torch.Generator().manual_seed(sum(map(ord, case)) + interleaved)
    shape, kwargs, pos = _exact_case(case, head_dim, gen)
    emb = RotaryPositionEmbedding(32, interleaved=interleaved, device=DEVICE,
                                  rope_scaling=YARN if rope == "yarn" else None)
    assert (emb.attention_scaling > 1.1) == (rope == "yarn")
    t = torch.randn(shape, generator=gen).to(DEVICE).requires_grad_(True)
    grad = torch.randn(shape, generator=gen).to(DEVICE)
    out = apply_rotary_pos_emb(t, emb, interleaved=interleaved, **kwargs)
    (dx,) = torch.autograd.grad(out, t, grad)

    pair_pos = pair_positions(pos, 16)
    ref = rotate64(t, pair_pos, emb.inv_freq, interleaved, emb.attention_scaling)
    ref_dx = rotate64(grad, pair_pos, emb.inv_freq, interleaved, emb.attention_scaling, transpose=True)
    lead = len(shape) - 2
    for got, expected in ((out, ref), (dx, ref_dx)):
        assert rel_error(got, expected) < EXACT_REL_TOL
        assert _worst_token_rel_error(got, expected, lead) < EXACT_REL_TOL
    assert torch.equal(out[..., 32:], t[..., 32:]) and torch.equal(dx[..., 32:], grad[..., 32:])


# The kernel's sin/cos of an exact angle hi + lo (`_exact_angle_sincos`) is within
# SINCOS_ABS_BOUND of the true sin/cos: reduction error <= 3 * 2^-23, hardware sin/cos
# <= 2^-21.19 (its docstring); numpy's sin/cos in the interpreter are tighter still.
SINCOS_ABS_BOUND = 8e-7


@triton.jit
def _sincos_probe(HI, LO, SIN, COS, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    # The kernel takes the angle as hi - err: err = -lo.
    sin, cos = triton_rotary_kernel._exact_angle_sincos(tl.load(HI + i, mask=ok), -tl.load(LO + i, mask=ok))
    tl.store(SIN + i, sin, mask=ok)
    tl.store(COS + i, cos, mask=ok)


def _sincos_error(hi, lo):
    """Largest |error| of the kernel's sin and cos of hi + lo against float64."""
    sin, cos = torch.empty_like(hi), torch.empty_like(hi)
    _sincos_probe[(triton.cdiv(hi.numel(), 1024),)](hi, lo, sin, cos, hi.numel(), BLOCK=1024)
    angle = hi.double() + lo.double()
    return max((sin.double() - angle.sin()).abs().max().item(),
               (cos.double() - angle.cos()).abs().max().item())


def test_exact_angle_sincos_error_bound():
    """The exact path's bound, one level down: sin/cos of every float32 angle in (-2^24, 2^24) on a
    GPU (a sample of them in the interpreter), and of random exact products hi + lo (lo
    within half an ulp of hi), within SINCOS_ABS_BOUND of float64; NaN from 2^24 on."""
    gen = torch.Generator().manual_seed(60)
    if ON_GPU:
        top = int(torch.tensor([2.0 ** 24], dtype=torch.float32).view(torch.int32))
        chunk = 1 << 27
        for start in range(0, top, chunk):
            hi = torch.arange(start, min(start + chunk, top), dtype=torch.int32, device=DEVICE).view(torch.float32)
            zero = torch.zeros_like(hi)
            assert _sincos_error(hi, zero) < SINCOS_ABS_BOUND, start
            assert _sincos_error(-hi, zero) < SINCOS_ABS_BOUND, start
            del hi, zero
        samples = 1 << 24
    else:
        samples = 1 << 14
    hi = (torch.rand(samples, generator=gen, dtype=torch.float64) ** 4 * 2.0 ** 24).float()
    hi = hi * torch.where(torch.rand(samples, generator=gen) < 0.5, -1.0, 1.0)
    ulp = (hi.abs().nextafter(torch.tensor(float("inf"))) - hi.abs()).double()
    lo = ((torch.rand(samples, generator=gen, dtype=torch.float64) - 0.5) * ulp).float()
    assert _sincos_error(hi.to(DEVICE), lo.to(DEVICE)) < SINCOS_ABS_BOUND
    big = torch.tensor([2.0 ** 24, -2.0 ** 24, 3e7, float("nan")], device=DEVICE)
    sin, cos = torch.empty_like(big), torch.empty_like(big)
    _sincos_probe[(1,)](big, torch.zeros_like(big), sin, cos, 4, BLOCK=4)
    assert sin.isnan().all() and cos.isnan().all()


@triton.jit
def _fma_probe(A, B, C, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask)
    b = tl.load(B + offs, mask=mask)
    c = tl.load(C + offs, mask=mask)
    tl.store(OUT + offs, triton_rotary_kernel._fma(a, b, c), mask=mask)


def _float32_nearest(value):
    """The float32 nearest to the exact rational `value`, ties to even (independent of any
    floating-point fma: candidates around float(value), compared in exact arithmetic)."""
    from fractions import Fraction

    import numpy as np
    guess = np.float32(float(value))
    candidates = [guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))]
    return min(candidates, key=lambda f: (abs(Fraction(float(f)) - value), int(np.array(f).view(np.int32)) & 1))


def test_fma_rounds_once():
    """The kernel's fma rounds a * b + c once, as the reductions and the exact two-product
    need, also in interpreters whose tl.fma is a multiply and an add (Triton 3.5.1-3.7.1):
    against the exact rational result rounded to float32, on products that cancel against c
    (where two roundings lose everything) and on random sums."""
    from fractions import Fraction
    gen = torch.Generator().manual_seed(61)
    n = 2048
    a = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    b = torch.randn(n, generator=gen)
    c = -(a * b)                                  # the rounded product: a * b + c is its error
    scales = torch.exp2(torch.randint(-40, 40, (n // 2,), generator=gen).float())
    c[n // 2:] = torch.randn(n // 2, generator=gen) * scales
    a[0], b[0], c[0] = 1 + 2**-12, 1 + 2**-12, -(1 + 2**-11)       # exactly 2^-24
    out = torch.empty(n, device=DEVICE)
    _fma_probe[(triton.cdiv(n, 512),)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), out, n, BLOCK=512)
    out = out.cpu()
    assert out[0].item() == 2**-24
    exact = [Fraction(x) * Fraction(y) + Fraction(z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    wrong = [i for i, value in enumerate(exact) if out[i].item() != float(_float32_nearest(value))]
    assert not wrong, [(a[i].item(), b[i].item(), c[i].item(), out[i].item()) for i in wrong[:5]]
    assert (out[:n // 2] != 0).sum() > n // 4       # the cancelling half really tested an error term


def test_table_angles_lose_accuracy_where_exact_angles_do_not():
    """What the exact path is for: TE's table holds float32(position * inv_freq), whose rounding
    at position ~2^20 is up to 2^-5 rad, so the table path is off by > 1e-4 where the exact
    path, on the same input and positions, stays within 2e-6."""
    torch.manual_seed(40)
    s, b, p0 = 8, 2, 2**20 - 3
    emb = RotaryPositionEmbedding(32, device=DEVICE)
    table = emb(p0 + s)                          # TE's whole table, 2^20 rows (128 MiB)
    # Row p of TE's table equals a one-row table at offset p (float32(p) is exact below 2^24):
    # this is how the accuracy study (rope_test_support.accuracy_vs_position) reaches 2^24
    # without a 2 GiB table.
    assert torch.equal(emb(s, offset=p0), table[p0:])
    t = torch.randn(s, b, 2, 40, device=DEVICE)
    pos = torch.arange(p0, p0 + s)
    ref = rotate64(t, pair_positions(pos[:, None].expand(s, b), 16), emb.inv_freq, False)
    for kwargs in (dict(start_positions=torch.full((b,), p0, dtype=torch.int32, device=DEVICE)),
                   dict(positions=pos.to(DEVICE))):
        table_error = rel_error(apply_rotary_pos_emb(t, table, **kwargs), ref)
        exact_error = rel_error(apply_rotary_pos_emb(t, emb, **kwargs), ref)
        assert table_error > 1e-4 and exact_error < EXACT_REL_TOL
        assert table_error > 100 * exact_error


def test_positions_past_float32_integers_are_exact_or_nan():
    """Past 2^24 a position no longer converts to float32 exactly. With linear scaling (factor 4,
    so inv_freq[0] = 1/4) positions up to 2^26 still give angles below 2^24, where the kernel
    does not return NaN: each token must then be either exact (as fused=False is) or NaN, never
    silently off."""
    emb = RotaryPositionEmbedding(32, device=DEVICE, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert emb.inv_freq[0].item() == 0.25
    pos = torch.tensor([2**24 - 1, 2**24 + 1, 2**25 + 3])
    assert (pos * 0.25 < 2**24).all()            # every angle inside the range the kernel takes
    t = torch.randn(3, 1, 2, 32, generator=torch.Generator().manual_seed(51)).to(DEVICE)
    out = apply_rotary_pos_emb(t, emb, positions=pos.to(DEVICE))
    ref = rotate64(t, pair_positions(pos[:, None], 16), emb.inv_freq, False)
    for i in range(3):
        token = out[i:i + 1]
        assert token.isnan().any() or rel_error(token, ref[i:i + 1]) < EXACT_REL_TOL, i


def _fwd_bwd(t, freqs, grad, **kwargs):
    x = t.detach().clone().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, **kwargs)
    (dx,) = torch.autograd.grad(out, x, grad)
    return out.detach(), dx


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("kind", ["table", "module"])
def test_explicit_positions_match_implicit_positions(kind, tensor_format):
    """`positions` is only another way to give the positions: equal to the implicit ones
    (start_positions, thd cu_seqlens) bit for bit, equal to fused=False, and [s] the same as
    [b, s] with identical rows (broadcast or copied)."""
    torch.manual_seed(41)
    emb = RotaryPositionEmbedding(32, device=DEVICE, rope_scaling=YARN if kind == "module" else None)
    freqs = emb(64) if kind == "table" else emb
    ints = functools.partial(torch.tensor, dtype=torch.int32, device=DEVICE)
    s, b, h, d = 6, 2, 3, 40
    if tensor_format == "thd":
        cu, start = [0, 4, 4, 10], [7, 0, 31]
        shape = (10, h, d)
        implicit = dict(cu_seqlens=ints(cu), start_positions=ints(start))
        positions = _cat_ranges([4, 0, 6], start).to(DEVICE)
    else:
        start = [5, 0]
        shape = (s, b, h, d) if tensor_format == "sbhd" else (b, s, h, d)
        implicit = dict(start_positions=ints(start))
        positions = (torch.tensor(start)[:, None] + torch.arange(s)).to(DEVICE)    # [b, s]
    t, grad = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    by_start = _fwd_bwd(t, freqs, grad, tensor_format=tensor_format, **implicit)
    by_positions = _fwd_bwd(t, freqs, grad, tensor_format=tensor_format, positions=positions)
    unfused = _fwd_bwd(t, freqs, grad, tensor_format=tensor_format, positions=positions, fused=False)
    for a, e, u in zip(by_positions, by_start, unfused):
        assert torch.equal(a, e)
        torch.testing.assert_close(a, u)
    if tensor_format == "thd":
        return
    # [s] shared by the batch == [b, s] with equal rows == no positions at all (index in sequence)
    shared = torch.arange(s, device=DEVICE)
    runs = [_fwd_bwd(t, freqs, grad, tensor_format=tensor_format, positions=p)
            for p in (shared, shared.int(), shared.expand(b, s), shared.expand(b, s).contiguous())]
    runs.append(_fwd_bwd(t, freqs, grad, tensor_format=tensor_format))
    for run in runs[1:]:
        assert torch.equal(run[0], runs[0][0]) and torch.equal(run[1], runs[0][1])


def test_fused_qkv_and_inplace_take_module_and_positions():
    """The fused QKV (one launch each way) and the in-place entry point with modules and
    per-token positions equal the plain path on the same views, forward and backward."""
    torch.manual_seed(42)
    q_emb = RotaryPositionEmbedding(32, device=DEVICE, rope_scaling=YARN)
    k_emb = RotaryPositionEmbedding(32, rotary_base=500.0, device=DEVICE)   # q and k may differ
    s, b, kv_heads, d, dv = 5, 2, 2, 40, 24
    split = [2 * d, d, dv]
    qkv = torch.randn(s, b, kv_heads, sum(split), device=DEVICE)
    pos = _random_exact_positions(torch.Generator().manual_seed(42), b, s).to(DEVICE)
    grads = [torch.randn(s, b, n, d, device=DEVICE) for n in (2 * kv_heads, kv_heads)]
    grads.append(torch.randn(s, b, kv_heads, dv, device=DEVICE))

    x = qkv.clone().requires_grad_(True)
    fused = apply_fused_qkv_rotary_pos_emb(x, q_emb, k_emb, split, positions=pos)
    (dx,) = torch.autograd.grad(fused, x, grads)
    y = qkv.clone().requires_grad_(True)
    yq, yk, yv = torch.split(y, split, dim=-1)
    plain = (apply_rotary_pos_emb(yq.reshape(s, b, 2 * kv_heads, d), q_emb, positions=pos),
             apply_rotary_pos_emb(yk, k_emb, positions=pos), yv)
    (dy,) = torch.autograd.grad(plain, y, grads)
    for got, expected in zip(fused, plain):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(dx, dy)
    assert not torch.allclose(fused[0], yq.reshape(s, b, 2 * kv_heads, d))   # q was rotated

    with torch.inference_mode():
        packed = qkv.clone()
        k_view = packed[..., 2 * d:3 * d]                        # strided: k inside qkv
        assert apply_rotary_pos_emb_inplace(k_view, k_emb, positions=pos) is k_view
        torch.testing.assert_close(k_view, plain[1])
        assert torch.equal(packed[..., :2 * d], qkv[..., :2 * d])
        assert torch.equal(packed[..., 3 * d:], qkv[..., 3 * d:])
        t = torch.randn(7, 3, d, device=DEVICE)
        thd_pos = _random_exact_positions(torch.Generator().manual_seed(43), 7).to(DEVICE)
        expected = apply_rotary_pos_emb(t, q_emb, "thd", positions=thd_pos)
        apply_rotary_pos_emb_inplace(t, q_emb, "thd", positions=thd_pos)
        torch.testing.assert_close(t, expected)


def _vl_positions(sequences):
    """[3, t] M-RoPE position ids of packed sequences as Qwen2-VL's get_rope_index lays them out:
    text advances all three axes together; an image (frames, rows, cols) grid keeps its start on
    every axis plus frame / row / column index on the temporal / height / width axis, and the
    text after it resumes at one past the largest position used. Each sequence starts at 0."""
    columns = []
    for segments in sequences:
        start = 0
        for seg in segments:
            if seg[0] == "text":
                p = torch.arange(seg[1]) + start
                columns.append(torch.stack([p, p, p]))
            else:
                _, frames, rows, cols = seg
                f, r, c = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
                columns.append(torch.stack([f.flatten(), r.flatten(), c.flatten()]) + start)
            start = int(columns[-1].max()) + 1
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_vl", "qwen3_vl"])
def test_mrope_exact_and_packed(interleaved):
    """M-RoPE against the float64 reference, forward and backward: (a) random positions up to
    2^24 - 1 on each axis, bshd [3, b, s] and sbhd [3, s]; (b) thd with images, a video and text
    packed into three sequences, where positions jump, repeat and differ across axes."""
    emb = mrope_module(interleaved)
    axis = mrope_axis_rule(emb.mrope_section, interleaved)
    gen = torch.Generator().manual_seed(46)
    s, b, h, d = 5, 2, 2, 40
    packed = _vl_positions([[("text", 3), ("image", 1, 2, 3), ("text", 2)],
                            [("image", 2, 2, 2), ("text", 4)],
                            [("text", 2), ("image", 1, 3, 1), ("text", 1)]])
    assert packed.shape == (3, 29) and not torch.equal(packed[0], packed[1])
    cases = [("bshd", (b, s, h, d), _random_exact_positions(gen, 3, b, s), None),
             ("sbhd", (s, b, h, d), _random_exact_positions(gen, 3, s), lambda p: p[:, :, None].expand(3, s, b)),
             ("thd", (29, h, d), packed, None)]
    for fmt, shape, pos, as_tokens in cases:
        t = torch.randn(shape, generator=gen).to(DEVICE)
        grad = torch.randn(shape, generator=gen).to(DEVICE)
        out, dx = _fwd_bwd(t, emb, grad, tensor_format=fmt, positions=pos.to(DEVICE))
        pair_pos = pair_positions(as_tokens(pos) if as_tokens else pos, 16, axis)
        ref = rotate64(t, pair_pos, emb.inv_freq, False)
        ref_dx = rotate64(grad, pair_pos, emb.inv_freq, False, transpose=True)
        lead = len(shape) - 2
        for got, expected in ((out, ref), (dx, ref_dx)):
            assert rel_error(got, expected) < EXACT_REL_TOL, fmt
            assert _worst_token_rel_error(got, expected, lead) < EXACT_REL_TOL, fmt
        # the unfused path (float64 angles, float32 cos/sin) agrees as well
        unfused = _fwd_bwd(t, emb, grad, tensor_format=fmt, positions=pos.to(DEVICE), fused=False)
        torch.testing.assert_close(out, unfused[0])
        torch.testing.assert_close(dx, unfused[1])


def test_mrope_text_positions_reduce_to_rope():
    """Text only (all axes equal) M-RoPE is plain RoPE: the module without positions, with [3, s]
    positions all equal to the index, and the plain module give the same result."""
    torch.manual_seed(47)
    t = torch.randn(6, 2, 2, 40, device=DEVICE)
    plain = apply_rotary_pos_emb(t, RotaryPositionEmbedding(32, device=DEVICE))
    for interleaved in (False, True):
        mrope = mrope_module(interleaved)
        assert torch.equal(apply_rotary_pos_emb(t, mrope), plain)
        same = torch.arange(6, device=DEVICE).expand(3, 6)
        assert torch.equal(apply_rotary_pos_emb(t, mrope, positions=same), plain)


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_mrope_gradcheck_float64(interleaved):
    """float64 through the kernel, M-RoPE positions that differ per axis: the backward is the
    true gradient."""
    torch.manual_seed(48)
    emb = mrope_module(interleaved, 8, [2, 1, 1])
    pos = torch.tensor([[[3, 70, 5]], [[900, 1, 2]], [[12, 12, 4000]]], device=DEVICE)     # [3, b=1, s=3]
    t = torch.randn(1, 3, 2, 10, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert gradcheck(lambda x: apply_rotary_pos_emb(x, emb, "bshd", positions=pos), (t,))


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_fused_qkv_mrope(tensor_format):
    """Fused QKV with an M-RoPE module and [3, b, s] positions: q and k against the float64
    reference, v copied, and the packed gradient the transposed rotation of (dq, dk) next to dv."""
    torch.manual_seed(49)
    emb = mrope_module(True)
    axis = mrope_axis_rule(emb.mrope_section, True)
    s, b, kv_heads, d, dv = 4, 2, 2, 40, 8
    split = [2 * d, d, dv]
    lead = (s, b) if tensor_format == "sbhd" else (b, s)
    qkv = torch.randn(*lead, kv_heads, sum(split), device=DEVICE)
    pos = _random_exact_positions(torch.Generator().manual_seed(49), 3, b, s)
    tok_pos = pos if tensor_format == "bshd" else pos.transpose(1, 2)            # [3, *lead]
    pair_pos = pair_positions(tok_pos, 16, axis)
    x = qkv.clone().requires_grad_(True)
    q, k, v = apply_fused_qkv_rotary_pos_emb(x, emb, emb, split, tensor_format, positions=pos.to(DEVICE))
    gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    (dx,) = torch.autograd.grad((q, k, v), x, (gq, gk, gv))
    q_in = qkv[..., :2 * d].reshape(*lead, 2 * kv_heads, d)
    assert rel_error(q, rotate64(q_in, pair_pos, emb.inv_freq, False)) < EXACT_REL_TOL
    assert rel_error(k, rotate64(qkv[..., 2 * d:3 * d], pair_pos, emb.inv_freq, False)) < EXACT_REL_TOL
    assert torch.equal(v, qkv[..., 3 * d:])
    ref_dx = torch.cat((rotate64(gq, pair_pos, emb.inv_freq, False, transpose=True).reshape(*lead, kv_heads, 2 * d),
                        rotate64(gk, pair_pos, emb.inv_freq, False, transpose=True), gv.double().cpu()), dim=-1)
    assert rel_error(dx, ref_dx) < EXACT_REL_TOL


# =================================================================================================
# == 5. API semantics
#    Thd pass-through, positions outside a table, index dtypes, in place, empty inputs,
#    arguments saved for the backward.
# =================================================================================================


def test_thd_tokens_outside_sequences_pass_through():
    """TE leaves tokens past cu_seqlens[-1] uninitialised; here they are returned unchanged
    (and their gradient passes through), in both the kernel and the unfused path."""
    torch.manual_seed(6)
    cu_seqlens = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=DEVICE)   # an empty sequence
    t = torch.randn(11, 2, 16, device=DEVICE)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    grad = torch.randn_like(t)
    for fused in (True, False):
        x = t.clone().requires_grad_(True)
        out = apply_rotary_pos_emb(x, freqs, "thd", cu_seqlens=cu_seqlens, fused=fused)
        (g,) = torch.autograd.grad(out, x, grad)
        assert torch.equal(out[7:], t[7:]) and torch.equal(g[7:], grad[7:])
        assert not torch.allclose(out[1:7], t[1:7])
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu_seqlens),
                               unfused_reference(t, freqs=freqs, tensor_format="thd", cu_seqlens=cu_seqlens))


def test_positions_outside_freqs_give_nan():
    """A start position running past freqs gives NaN rows (never an out-of-bounds read)."""
    t = torch.randn(4, 2, 3, 16, device=DEVICE)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(6)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)   # batch 1 needs rows 3..6
    for fused in (True, False):
        out = apply_rotary_pos_emb(t, freqs, start_positions=starts, fused=fused)
        assert not out[:, 0].isnan().any()
        assert out[:3, 1].isfinite().all() and out[3, 1].isnan().all()


def test_int64_index_tensors_and_strided_inputs_match_int32():
    torch.manual_seed(7)
    cu = [0, 5, 9, 16]
    t = torch.randn(16, 4, 32, device=DEVICE)
    freqs = RotaryPositionEmbedding(32, device=DEVICE)(24)
    starts = [3, 0, 7]
    expected = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
                                    start_positions=torch.tensor(starts, dtype=torch.int32, device=DEVICE))
    cu64 = torch.tensor([0, 0] + cu, dtype=torch.int64, device=DEVICE)[2:]      # offset storage
    starts64 = torch.tensor([[s, -1] for s in starts], dtype=torch.int64, device=DEVICE)[:, 0]  # strided
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu64, start_positions=starts64),
                               expected)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_inplace_matches_out_of_place(tensor_format, interleaved):
    torch.manual_seed(8)
    shape = {"sbhd": (6, 2, 3, 24), "bshd": (2, 6, 3, 24), "thd": (12, 3, 24)}[tensor_format]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE) if tensor_format == "thd" else None
    # q inside a packed [.., 3 heads of q | 2 heads of other] buffer: a strided view.
    packed = torch.randn(*shape[:-2], shape[-2] + 2, shape[-1], device=DEVICE)
    q = packed[..., :shape[-2], :]
    freqs = RotaryPositionEmbedding(16, interleaved=interleaved, device=DEVICE)(12)
    expected = apply_rotary_pos_emb(q, freqs, tensor_format, interleaved=interleaved, cu_seqlens=cu)
    untouched = packed.clone()
    with torch.inference_mode():
        returned = apply_rotary_pos_emb_inplace(q, freqs, tensor_format, interleaved=interleaved, cu_seqlens=cu)
    assert returned.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q, expected)
    assert torch.equal(packed[..., shape[-2]:, :], untouched[..., shape[-2]:, :])   # other heads
    assert torch.equal(q[..., 16:], untouched[..., :shape[-2], 16:])               # channels >= d2


def _both_angle_kinds(d2, rows, interleaved=False):
    """The same rotation as a table [rows, 1, 1, d2] and as the module that built it."""
    module = RotaryPositionEmbedding(d2, interleaved=interleaved, device=DEVICE)
    return {"table": module(rows), "module": module}


_ZERO_SIZE_CASES = [
    ("sbhd s=0", (0, 2, 3, 12), dict()),
    ("sbhd b=0", (4, 0, 3, 12), dict()),
    ("sbhd h=0", (4, 2, 0, 12), dict()),
    ("bshd s=0", (2, 0, 3, 12), dict(tensor_format="bshd")),
    ("bshd b=0", (0, 4, 3, 12), dict(tensor_format="bshd")),
    ("sbhd s=0 cp", (0, 2, 3, 12), dict(cp_size=2, cp_rank=1)),
    ("sbhd s=0 start", (0, 2, 3, 12), dict(start_positions=[1, 2])),
    ("thd 0 tokens", (0, 3, 12), dict(tensor_format="thd", cu_seqlens=[0, 0])),
    ("thd 0 tokens, 3 sequences", (0, 3, 12), dict(tensor_format="thd", cu_seqlens=[0, 0, 0, 0])),
    ("thd h=0", (5, 0, 12), dict(tensor_format="thd", cu_seqlens=[0, 2, 5])),
    ("thd positions 0 tokens", (0, 3, 12), dict(tensor_format="thd", positions=[])),
]


@pytest.mark.parametrize("angles", ["table", "module"])
@pytest.mark.parametrize("name,shape,case", _ZERO_SIZE_CASES, ids=[c[0] for c in _ZERO_SIZE_CASES])
def test_zero_size_inputs(name, shape, case, angles):
    """Empty inputs give empty results and gradients of the input's shape, like fused=False
    (no launch with a 0-sized grid, no division by the 0 tokens)."""
    case = dict(case)
    for key in ("cu_seqlens", "start_positions", "positions"):
        if key in case:
            case[key] = int_tensor(case[key], torch.int64)
    freqs = _both_angle_kinds(8, 8)[angles]
    t = torch.randn(shape, device=DEVICE)
    (out, dt), (ref_out, ref_dt) = fused_and_unfused(t, freqs, **case)
    assert out.shape == dt.shape == ref_out.shape == t.shape and out.dtype == t.dtype
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(dt, ref_dt)
    # The launcher with a preallocated (empty) out, forward and backward.
    for backward in (False, True):
        out = torch.empty_like(t)
        assert set_rotary_kernel(t, freqs, backward=backward, out=out, **case) is out


@pytest.mark.parametrize("angles", ["table", "module"])
@pytest.mark.parametrize("qkv_shape", [(0, 2, 2, 32), (3, 0, 2, 32), (3, 2, 0, 32)],
                         ids=["s=0", "b=0", "0 kv heads"])
def test_zero_size_fused_qkv_and_inplace(qkv_shape, angles):
    """Fused QKV with no tokens or no kv heads: q, k, v and the packed gradient empty, of the
    right shapes (fused=False itself fails on s=0 or b=0: test_unfused_qkv_without_tokens)."""
    freqs = _both_angle_kinds(8, 8)[angles]
    split = [16, 8, 8]
    s, b, kv = qkv_shape[:3]
    qkv = torch.randn(qkv_shape, device=DEVICE, requires_grad=True)
    outs = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split)
    assert [tuple(o.shape) for o in outs] == [(s, b, 2 * kv, 8), (s, b, kv, 8), (s, b, kv, 8)]
    assert all(o.dtype == qkv.dtype and o.is_contiguous() for o in outs)
    (dqkv,) = torch.autograd.grad(outs, qkv, [torch.ones_like(o) for o in outs])
    assert dqkv.shape == qkv_shape
    if s * b:       # 0 kv heads: the unfused formula runs, and agrees
        refs = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, fused=False)
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref)
    # The backward launcher alone, from empty gradients.
    assert triton_rotary_launch.set_rotary_qkv_kernel(
        qkv.detach(), freqs, freqs, split, grads=tuple(torch.zeros_like(o) for o in outs)).shape == qkv_shape
    # In place on an empty tensor: nothing to do, t comes back.
    t = torch.randn(s, b, kv, 8, device=DEVICE)
    with torch.no_grad():
        assert apply_rotary_pos_emb_inplace(t, freqs) is t


def test_fused_qkv_launch_tensors_start_where_the_planned_views_start():
    """A fused-QKV launch passes tensors for their data pointers alone, without the views the
    plan takes its strides from: each starts where its view starts, forward and backward, the
    packed tensor a view itself too, so that a launch reads where the plan says."""
    launch = triton_rotary_launch
    split = [24, 8, 4]
    base = torch.randn(6, 3, 2, 40, device=DEVICE)
    qkv = base[:, :, :, 2:38]                   # packed, with a storage offset and gaps
    grads = (torch.randn(6, 3, 6, 8, device=DEVICE), torch.randn(6, 3, 2, 8, device=DEVICE),
             torch.randn(6, 3, 2, 4, device=DEVICE))
    for case_grads in (None, grads):
        result = launch.qkv_outputs(qkv, split, case_grads)
        views = launch._qkv_views(qkv, split, case_grads, result)
        fast = launch._qkv_launch_tensors(qkv, split, case_grads, result)
        assert [x.data_ptr() for x in fast] == [x.data_ptr() for x in views]
        assert len({x.data_ptr() for x in views}) == 6
    assert ([x.data_ptr() for x in launch._packed_starts(qkv, split)]
            == [x.data_ptr() for x in launch._packed_views(qkv, split)])


def test_unfused_qkv_without_tokens():
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(8)
    q, k, v = apply_fused_qkv_rotary_pos_emb(torch.randn(0, 2, 2, 32, device=DEVICE), freqs, freqs,
                                             [16, 8, 8], fused=False)
    assert q.shape == (0, 2, 4, 8) and k.shape == v.shape == (0, 2, 2, 8)


@pytest.mark.sanitize
def test_freqs_without_rows_give_nan():
    """A table with 0 rows places no token: NaN in the rotated channels, the rest copied (the
    old kernel clamped the row to freqs_len - 1 = -1 and read before the table; on a GPU
    `make sanitize` runs this under compute-sanitizer, which reports such a read)."""
    torch.manual_seed(31)
    empty = torch.empty(0, 1, 1, 8, device=DEVICE)
    cases = [  # (t, kwargs, tokens inside a sequence)
        (torch.randn(7, 2, 12, device=DEVICE), dict(tensor_format="thd", cu_seqlens=int_tensor([0, 3, 5])),
         torch.arange(7, device=DEVICE) < 5),
        (torch.randn(3, 2, 2, 12, device=DEVICE), dict(positions=int_tensor([0, 1, 2])), None),
        (torch.randn(2, 3, 2, 12, device=DEVICE),
         dict(tensor_format="bshd", positions=int_tensor([[0, 1, 2], [2, 1, 0]])),
         None),
        (torch.randn(4, 2, 12, device=DEVICE), dict(tensor_format="thd", positions=int_tensor([0, 5, -1, 2])), None),
    ]
    for t, kwargs, inside in cases:
        x = t.clone().requires_grad_(True)
        out = apply_rotary_pos_emb(x, empty, **kwargs)
        grad = torch.randn_like(t)
        (dx,) = torch.autograd.grad(out, x, grad)
        inside = torch.ones(t.shape[:-2], dtype=torch.bool, device=DEVICE) if inside is None else inside
        assert out[inside][..., :8].isnan().all() and dx[inside][..., :8].isnan().all()
        assert torch.equal(out[..., 8:], t[..., 8:]) and torch.equal(dx[..., 8:], grad[..., 8:])
        # Tokens outside every thd sequence pass through, forward and backward.
        assert torch.equal(out[~inside], t[~inside]) and torch.equal(dx[~inside], grad[~inside])
        ref = apply_rotary_pos_emb(t, empty, fused=False, **kwargs)
        assert torch.equal(out.isnan(), ref.isnan())
    # Fused QKV with positions: q and k rotated channels NaN, v copied.
    qkv = torch.randn(3, 2, 2, 32, device=DEVICE)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, empty, empty, [16, 8, 8], positions=int_tensor([0, 1, 2]))
    assert q[..., :8].isnan().all() and k[..., :8].isnan().all()
    assert torch.equal(v, qkv[..., 24:])


def _rope_with_saved_argument(what):
    """(loss of one forward, the argument tensor it keeps for the backward) for each kind of
    tensor argument the backward reads."""
    s, b, h, d = 6, 2, 2, 16
    emb = RotaryPositionEmbedding(d, device=DEVICE)
    t = torch.randn(s, b, h, d, device=DEVICE, requires_grad=True)
    if what == "freqs":
        freqs = emb(s)
        return apply_rotary_pos_emb(t, freqs).sum(), freqs
    if what == "module inv_freq":
        return apply_rotary_pos_emb(t, emb, positions=torch.arange(s, device=DEVICE)).sum(), emb.inv_freq
    if what == "start_positions":
        start = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
        return apply_rotary_pos_emb(t, emb(s + 4), start_positions=start).sum(), start
    if what == "cu_seqlens":
        cu = torch.tensor([0, 4, 12], dtype=torch.int32, device=DEVICE)
        x = torch.randn(12, h, d, device=DEVICE, requires_grad=True)
        return apply_rotary_pos_emb(x, emb(12), "thd", cu_seqlens=cu).sum(), cu
    if what == "positions":
        pos = torch.arange(s, device=DEVICE)
        return apply_rotary_pos_emb(t, emb(2 * s), positions=pos).sum(), pos
    qkv = torch.randn(s, b, 2, 4 * d, device=DEVICE, requires_grad=True)
    freqs = emb(s)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [2 * d, d, d])
    return q.sum() + k.sum() + v.sum(), freqs


@pytest.mark.parametrize("what", ["freqs", "module inv_freq", "start_positions", "cu_seqlens",
                                  "positions", "fused qkv freqs"])
def test_arguments_modified_before_backward_raise(what):
    """The tensors the backward reads besides the gradient (freqs or the module's inv_freq,
    start_positions, cu_seqlens, positions) are saved for it: changed in place between forward
    and backward, the backward raises PyTorch's in-place error, as TE's does, instead of
    returning the gradient of other angles or positions. Unchanged, the backward runs."""
    loss, _ = _rope_with_saved_argument(what)
    loss.backward()
    loss, argument = _rope_with_saved_argument(what)
    with torch.no_grad():
        argument.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_calls_autograd_does_not_record_skip_the_autograd_function():
    """Where autograd records nothing (no_grad, or an input that does not require grad) a
    call goes straight to the launch: no grad_fn, the same values as the recorded call; a
    recorded call gets the autograd function's grad_fn. Fused QKV likewise."""
    torch.manual_seed(43)
    t = torch.randn(6, 2, 3, 16, device=DEVICE, requires_grad=True)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(6)
    recorded = apply_rotary_pos_emb(t, freqs)
    assert type(recorded.grad_fn).__name__ == "RopeForwardAndBackwardBackward"
    with torch.no_grad():
        unrecorded = apply_rotary_pos_emb(t, freqs)
    assert unrecorded.grad_fn is None and not unrecorded.requires_grad
    assert torch.equal(unrecorded, recorded.detach())
    plain = apply_rotary_pos_emb(t.detach(), freqs, inverse=True)
    assert plain.grad_fn is None
    assert torch.equal(plain, apply_rotary_pos_emb(t, freqs, inverse=True).detach())
    qkv = torch.randn(6, 2, 2, 64, device=DEVICE, requires_grad=True)
    outs = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16])
    assert type(outs[0].grad_fn).__name__ == "FusedQKVRopeForwardAndBackwardBackward"
    with torch.no_grad():
        plain_outs = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16])
    for out, ref in zip(plain_outs, outs):
        assert out.grad_fn is None and torch.equal(out, ref.detach())


def test_unfused_thd_pass_through_gradient():
    """Documented: thd tokens outside every sequence pass through, forward and backward. The
    kernel does; fused=False gives NaN gradients where such a token's would-be position is
    outside the table."""
    cu = int_tensor([0, 2])
    t = torch.randn(9, 1, 8, device=DEVICE, requires_grad=True)
    out = apply_rotary_pos_emb(t, RotaryPositionEmbedding(8, device=DEVICE)(3), "thd", cu_seqlens=cu, fused=False)
    grad = torch.randn_like(out)
    (dt,) = torch.autograd.grad(out, t, grad)
    assert torch.equal(dt[2:], grad[2:])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_inverse_rotates_by_the_negated_angles(tensor_format, interleaved):
    """inverse=True against the rotation by e^{-i theta} computed from its definition in
    float64 (angles from positions, and TE's table of the same angles), and against the
    forward rotation with the table negated (any table: its pair members need not agree)."""
    torch.manual_seed(41)
    s, b, h, d, d2 = 6, 2, 3, 20, 12
    shape = {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "thd": (s, h, d)}[tensor_format]
    t = torch.randn(shape, dtype=torch.float64, device=DEVICE)
    module = RotaryPositionEmbedding(d2, interleaved=interleaved, device=DEVICE)
    kwargs = dict(tensor_format=tensor_format, interleaved=interleaved)
    if tensor_format == "thd":
        kwargs["cu_seqlens"] = int_tensor([0, 2, 6])
        pair_pos = torch.tensor([0, 1, 0, 1, 2, 3])[:, None].expand(s, d2 // 2)
    else:
        pos = torch.arange(s)[:, None] if tensor_format == "sbhd" else torch.arange(s)[None, :]
        pair_pos = pos.expand(shape[:2])[..., None].expand(*shape[:2], d2 // 2)
    expected = rotate64(t, pair_pos, module.inv_freq, interleaved, transpose=True)
    for freqs in (module, module(s)):
        out = apply_rotary_pos_emb(t, freqs, inverse=True, **kwargs)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-6)
    table = torch.randn(s, 1, 1, d2, device=DEVICE) * 3
    torch.testing.assert_close(apply_rotary_pos_emb(t, table, inverse=True, **kwargs),
                               apply_rotary_pos_emb(t, -table, fused=False, **kwargs),
                               atol=1e-6, rtol=1e-6)


def test_inverse_undoes_the_rotation():
    """The inverse of the forward gives the input back (float64), through
    apply_rotary_pos_emb, the in-place path and fused QKV, for angles from positions and for
    TE's table; its gradient is the forward rotation."""
    torch.manual_seed(42)
    t = torch.randn(7, 2, 4, 16, dtype=torch.float64, device=DEVICE)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    for freqs in (module, module(7)):
        rotated = apply_rotary_pos_emb(t, freqs)
        torch.testing.assert_close(apply_rotary_pos_emb(rotated, freqs, inverse=True), t,
                                   atol=1e-12, rtol=1e-12)
        in_place = rotated.clone()
        with torch.no_grad():
            apply_rotary_pos_emb_inplace(in_place, freqs, inverse=True)
        torch.testing.assert_close(in_place, t, atol=1e-12, rtol=1e-12)
        x = t.clone().requires_grad_(True)
        grad = torch.randn_like(t)
        (dx,) = torch.autograd.grad(apply_rotary_pos_emb(x, freqs, inverse=True), x, grad)
        torch.testing.assert_close(dx, apply_rotary_pos_emb(grad, freqs), atol=1e-12, rtol=1e-12)
    split = [32, 16, 8]
    qkv = torch.randn(7, 2, 2, sum(split), dtype=torch.float64, device=DEVICE)
    q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, module, module, split)
    packed = torch.cat((q.unflatten(2, (2, 2)).flatten(3), k, v), dim=-1)
    for got, want in zip(apply_fused_qkv_rotary_pos_emb(packed, module, module, split, inverse=True),
                         torch.split(qkv, split, dim=-1)):
        torch.testing.assert_close(got, want.reshape(got.shape), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("over", ["head", "token"])
def test_qk_norm_inplace_and_no_grad_match_the_recorded_call(over):
    """In place, every channel is normalized (the rotated ones and those past rotary_dim);
    a call under no_grad takes the no-autograd path; both equal the recorded call bitwise."""
    torch.manual_seed(64)
    t = torch.randn(8, 2, 3, 16, device=DEVICE)
    weight = torch.randn(16 if over == "head" else 48, device=DEVICE)
    freqs = RotaryPositionEmbedding(16, rotary_percent=0.5, device=DEVICE)(8)
    kwargs = dict(norm_weight=weight, norm_over=over, norm_offset=1.0)
    recorded = apply_rotary_pos_emb(t.clone().requires_grad_(True), freqs, **kwargs)
    assert recorded.grad_fn is not None
    with torch.no_grad():
        plain = apply_rotary_pos_emb(t, freqs, **kwargs)
        inplace = t.clone()
        assert apply_rotary_pos_emb_inplace(inplace, freqs, **kwargs) is inplace
    assert plain.grad_fn is None
    assert torch.equal(plain, recorded.detach()) and torch.equal(inplace, plain)
    assert not torch.equal(inplace[..., 8:], t[..., 8:])          # normalized, not copied
    with pytest.raises(ValueError, match="norm_weight requires grad"):
        apply_rotary_pos_emb_inplace(t.clone(), freqs, norm_weight=weight.requires_grad_(True))


def test_qk_norm_zero_size_inputs():
    """No tokens: an empty result, and a zero weight gradient of the weight's shape."""
    weight = torch.randn(16, device=DEVICE, requires_grad=True)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    for shape, fmt, extra in (((0, 2, 3, 16), "sbhd", {}), ((0, 3, 16), "thd", dict(cu_seqlens=int_tensor([0, 0])))):
        t = torch.randn(shape, device=DEVICE, requires_grad=True)
        out = apply_rotary_pos_emb(t, freqs, fmt, norm_weight=weight, **extra)
        assert out.shape == t.shape
        dt, dw = torch.autograd.grad(out, (t, weight), torch.ones_like(out))
        assert dt.shape == t.shape and torch.equal(dw, torch.zeros_like(weight))
    # q and k together, k without heads: q's own call, and k's weight gradient zero.
    q = torch.randn(4, 2, 3, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(4, 2, 0, 16, device=DEVICE, requires_grad=True)
    k_weight = torch.randn(16, device=DEVICE, requires_grad=True)
    outs = apply_rotary_pos_emb_qk(q, k, freqs, q_norm_weight=weight, k_norm_weight=k_weight)
    dq, dk, dwq, dwk = torch.autograd.grad(outs, (q, k, weight, k_weight), [torch.ones_like(o) for o in outs])
    ref = apply_rotary_pos_emb(q, freqs, norm_weight=weight)
    assert torch.equal(outs[0], ref) and outs[1].shape == k.shape
    ref_dq, ref_dw = torch.autograd.grad(ref, (q, weight), torch.ones_like(ref))
    assert torch.equal(dq, ref_dq) and torch.equal(dwq, ref_dw)
    assert dk.shape == k.shape and torch.equal(dwk, torch.zeros_like(k_weight))


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_norm_fused_qkv_matches_separate_calls(interleaved):
    """Fused QKV with per-head norms of q and k equals normalizing and rotating q and k apart
    (v copied), forward and backward, the weights' gradients included."""
    torch.manual_seed(65)
    kv_heads, q_per_kv, d = 2, 3, 16
    qkv = torch.randn(6, 2, kv_heads, (q_per_kv + 2) * d, device=DEVICE)
    q_freqs = RotaryPositionEmbedding(12, interleaved=interleaved, device=DEVICE)(6)
    k_freqs = q_freqs * 0.5
    wq, wk = torch.randn(d, device=DEVICE), torch.randn(d, device=DEVICE)
    split = [q_per_kv * d, d, d]
    norms = dict(norm_eps=1e-5, norm_offset=0.25)

    x = qkv.clone().requires_grad_(True)
    q_w, k_w = wq.clone().requires_grad_(True), wk.clone().requires_grad_(True)
    fused = apply_fused_qkv_rotary_pos_emb(x, q_freqs, k_freqs, split, interleaved=interleaved,
                                           q_norm_weight=q_w, k_norm_weight=k_w, **norms)
    grads = [torch.randn_like(o) for o in fused]
    fused_grads = torch.autograd.grad(fused, (x, q_w, k_w), grads)

    y = qkv.clone().requires_grad_(True)
    q_w2, k_w2 = wq.clone().requires_grad_(True), wk.clone().requires_grad_(True)
    q, k, v = torch.split(y, split, dim=-1)
    q = q.unflatten(-1, (q_per_kv, d)).flatten(2, 3)
    apart = (apply_rotary_pos_emb(q, q_freqs, interleaved=interleaved, norm_weight=q_w2, **norms),
             apply_rotary_pos_emb(k, k_freqs, interleaved=interleaved, norm_weight=k_w2, **norms), v)
    apart_grads = torch.autograd.grad(apart, (y, q_w2, k_w2), grads)
    for a, b in zip(fused, apart):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for a, b in zip(fused_grads, apart_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    unfused = apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, interleaved=interleaved, fused=False,
                                             q_norm_weight=wq, k_norm_weight=wk, **norms)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a.detach(), b, atol=1e-5, rtol=1e-5)


_QK_CASES = {
    # name: (q shape, k shape, format, angles, options)
    "sbhd table, 4:1 heads": ((6, 2, 4, 32), (6, 2, 1, 32), "sbhd", "table", {}),
    "bshd module, 6:2 heads, partial": ((2, 7, 6, 32), (2, 7, 2, 32), "bshd", "half", {}),
    "sbhd, k has more heads": ((6, 2, 3, 32), (6, 2, 5, 32), "sbhd", "module", {}),
    "interleaved, start_positions": ((6, 2, 4, 32), (6, 2, 2, 32), "sbhd", "interleaved",
                                     {"start_positions": [3, 1]}),
    "cp rank 1 of 2, inverse": ((8, 2, 4, 32), (8, 2, 1, 32), "sbhd", "module",
                                {"cp_size": 2, "cp_rank": 1, "inverse": True}),
    "thd, tokens outside sequences": ((15, 4, 32), (15, 1, 32), "thd", "table",
                                      {"cu_seqlens": [2, 7, 7, 13]}),
    "thd positions": ((15, 4, 32), (15, 2, 32), "thd", "module", {"positions": list(range(15))}),
    "thd, cp rank 1 of 2": ((16, 4, 32), (16, 1, 32), "thd", "module",
                            {"cu_seqlens": [0, 8, 20, 32], "cp_size": 2, "cp_rank": 1}),
    "M-RoPE": ((6, 2, 4, 32), (6, 2, 1, 32), "sbhd", "mrope", {"positions": "axes"}),
}


def _watch_launches(patch, seen):
    """`seen(launch)` at every launch made from here on (each launch still runs): `patch` (a
    monkeypatch or one of its contexts) wraps _Launch.__call__ until it is undone."""
    real_call = triton_rotary_launch._Launch.__call__

    def watched(launch, *args):
        seen(launch)
        real_call(launch, *args)
    patch.setattr(triton_rotary_launch._Launch, "__call__", watched)


def _counted_launches(patch):
    """A Counter of the launches made from here on, by kernel name (`_watch_launches`)."""
    launches = collections.Counter()
    _watch_launches(patch, lambda launch: launches.update([launch.kernel.fn.__name__]))
    return launches


@pytest.mark.parametrize("name", list(_QK_CASES))
def test_qk_pair_matches_separate_calls(name, monkeypatch):
    """apply_rotary_pos_emb_qk equals apply_rotary_pos_emb of q and of k, forward and
    backward, bit for bit (the same arithmetic, the angles shared by both tiles), in one
    launch of rotary_qk_kernel each way; q and k may be views of another layout."""
    q_shape, k_shape, fmt, angles, options = _QK_CASES[name]
    torch.manual_seed(71)
    freqs = {"table": RotaryPositionEmbedding(32, device=DEVICE)(16),
             "half": RotaryPositionEmbedding(32, rotary_percent=0.5, device=DEVICE),
             "module": RotaryPositionEmbedding(32, device=DEVICE),
             "interleaved": RotaryPositionEmbedding(32, interleaved=True, device=DEVICE)(16),
             "mrope": RotaryPositionEmbedding(32, mrope_section=[4, 6, 6], device=DEVICE)}[angles]
    options = dict(options)
    options["interleaved"] = angles == "interleaved"
    if options.get("positions") == "axes":
        options["positions"] = torch.arange(3 * q_shape[0], device=DEVICE).view(3, -1) % 5
    for key in ("cu_seqlens", "start_positions", "positions"):
        if isinstance(options.get(key), list):
            options[key] = int_tensor(options[key])
    # k as a view with its heads and channels strided (a slice of a wider buffer)
    q = torch.randn(q_shape, device=DEVICE).requires_grad_(True)
    k_buffer = torch.randn((*k_shape[:-2], k_shape[-2] + 1, 2 * k_shape[-1]), device=DEVICE)
    k = k_buffer[..., 1:, ::2].detach().requires_grad_(True)
    with monkeypatch.context() as patch:
        launches = _counted_launches(patch)
        out_q, out_k = apply_rotary_pos_emb_qk(q, k, freqs, fmt, **options)
        grads = (torch.randn_like(out_q), torch.randn_like(out_k))
        grad_q, grad_k = torch.autograd.grad((out_q, out_k), (q, k), grads)
    assert launches == {"rotary_qk_kernel": 2}, launches
    for x, out, grad, dx in ((q, out_q, grads[0], grad_q), (k, out_k, grads[1], grad_k)):
        x2 = x.detach().requires_grad_(True)
        ref = apply_rotary_pos_emb(x2, freqs, fmt, **options)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(dx, torch.autograd.grad(ref, x2, grad)[0], rtol=0, atol=0,
                                   equal_nan=True)
        unfused = apply_rotary_pos_emb(x.detach(), freqs, fmt, fused=False, **options)
        torch.testing.assert_close(out.detach(), unfused, equal_nan=True)


def _norm_case_angles(angles):
    """The angle source a norm test case names, for heads of d 32: TE's table of 16 positions
    ("table"), or the module (exact angles): "module", "half" (rotary_percent 0.5),
    "interleaved"."""
    module = {"table": RotaryPositionEmbedding(32, device=DEVICE),
              "half": RotaryPositionEmbedding(32, rotary_percent=0.5, device=DEVICE),
              "module": RotaryPositionEmbedding(32, device=DEVICE),
              "interleaved": RotaryPositionEmbedding(32, interleaved=True, device=DEVICE)}[angles]
    return module(16) if angles == "table" else module


_QK_NORM_CASES = {
    # name: (q shape, k shape, format, angles, options, norm_over, the launches of forward and
    # backward under the GPU launch rule; one second pass for both weights of one width). A
    # one-head key's forward takes pair tiles (test_qk_norm_forward_takes_pair_tiles_where_the_rule_says).
    "4:1 heads, exact angles": ((6, 2, 4, 32), (6, 2, 1, 32), "sbhd", "module", {}, "head",
                                {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    "4:1 heads, table": ((6, 2, 4, 32), (6, 2, 1, 32), "sbhd", "table", {}, "head",
                         {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    "thd, tokens outside sequences, offset": ((15, 4, 32), (15, 1, 32), "thd", "module",
                                              {"cu_seqlens": [2, 7, 7, 13], "norm_offset": 1.0},
                                              "head", {"rotary_qk_kernel": 2,
                                                       # one each way (QK_NORM_POSITIONS_PASS)
                                                       "sequence_positions_kernel": 2,
                                                       "weight_gradient_kernel": 1}),
    "thd, cp rank 1 of 2": ((16, 4, 32), (16, 1, 32), "thd", "module",
                            {"cu_seqlens": [0, 8, 20, 32], "cp_size": 2, "cp_rank": 1}, "head",
                            {"rotary_qk_kernel": 2, "sequence_positions_kernel": 2,
                             "weight_gradient_kernel": 1}),
    "k has more heads, interleaved, inverse": ((6, 2, 3, 32), (6, 2, 5, 32), "sbhd", "interleaved",
                                               {"inverse": True}, "head",
                                               {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    "bshd view, partial rotary, start_positions": ((2, 7, 8, 32), (2, 7, 2, 32), "bshd", "half",
                                                   {"start_positions": [3, 1]}, "head",
                                                   {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    # More query heads than the positions tile takes: the key's forward tile is the query's
    # plain one too (NORM_POSITIONS_TILE_BYTES), so the forward is one launch. That tile is
    # not the one k's own call takes, so its norm's sums may add up in another order on a
    # GPU: k's output equals that call's to float32 rounding (_QK_NORM_KEY_RETILED).
    "20:4 heads, exact angles": ((4, 2, 20, 32), (4, 2, 4, 32), "sbhd", "module", {}, "head",
                                 {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    # A query of one head keeps its tile (4 warps), which the key's positions tile joins.
    "1:4 heads, exact angles": ((6, 2, 1, 32), (6, 2, 4, 32), "sbhd", "module", {}, "head",
                                {"rotary_qk_kernel": 2, "weight_gradient_kernel": 1}),
    # The same tiles for q and k: two launches each way (`_joins`).
    "norm over the token, 2 + 2 heads": ((6, 2, 2, 32), (6, 2, 2, 32), "sbhd", "module", {}, "token",
                                         {"rotary_kernel": 4, "weight_gradient_kernel": 1}),
    # Weights of [4 * d] and [d]: a second pass each.
    "norm over the token, 4 + 1 heads": ((6, 2, 4, 32), (6, 2, 1, 32), "sbhd", "module", {}, "token",
                                         {"rotary_qk_kernel": 2, "weight_gradient_kernel": 2}),
}


# Keys in another forward tile than their own call's: those of the query's plain tile, and
# one-head keys, whose forward takes pair tiles (`_norm_pair_tiles`).
_QK_NORM_KEY_RETILED = {"20:4 heads, exact angles", "4:1 heads, exact angles", "4:1 heads, table",
                        "thd, tokens outside sequences, offset"}


@pytest.mark.parametrize("name", list(_QK_NORM_CASES))
def test_qk_norm_pair_matches_separate_calls(name, monkeypatch):
    """apply_rotary_pos_emb_qk with norms equals a call of apply_rotary_pos_emb with its norm
    for q and one for k: outputs and input gradients bit for bit where each tensor keeps its
    own tiles (a key in another forward tile, _QK_NORM_KEY_RETILED: its output to float32
    rounding), the weights' gradients to float32 rounding (the backward's programs are
    shared between q and k, so the partial sums add up in another grouping); launched as one
    rotary_qk_kernel each way where q's and k's tiles allow it, and one second pass for both
    weights where they have one width."""
    q_shape, k_shape, fmt, angles, options, over, kernels = _QK_NORM_CASES[name]
    torch.manual_seed(74)
    freqs = _norm_case_angles(angles)
    options = dict(options, interleaved=angles == "interleaved", norm_over=over)
    for key in ("cu_seqlens", "start_positions"):
        if key in options:
            options[key] = int_tensor(options[key])
    width = (lambda shape: 32) if over == "head" else (lambda shape: shape[-2] * 32)
    q = torch.randn(q_shape, device=DEVICE).requires_grad_(True)
    k_buffer = torch.randn((*k_shape[:-1], 2 * k_shape[-1]), device=DEVICE)
    k = k_buffer[..., ::2].detach().requires_grad_(True)              # channels strided
    wq = (1 + 0.2 * torch.randn(width(q_shape), device=DEVICE)).requires_grad_(True)
    wk = (1 + 0.2 * torch.randn(width(k_shape), device=DEVICE)).requires_grad_(True)
    # The GPU's rule on one SM, as the interpreter plans it: the tiles, and so the launches,
    # of these small inputs are then the same on a GPU. The interpreters of Triton 3.5 and 3.6
    # run no pipelined loop; the plain one gives the same bits
    # (test_qk_norm_pipelined_backward_matches_the_plain_loop).
    monkeypatch.setattr(triton_rotary_launch, "_sm_count", lambda device: 1)
    rule = triton_rotary_launch.GPU_RULE
    if not ON_GPU and tuple(map(int, triton.__version__.split(".")[:2])) < (3, 7):
        rule = rule._replace(norm_pipeline_stages=0)
    with monkeypatch.context() as patch, triton_rotary_launch.use_launch_rule(rule):
        launches = _counted_launches(patch)
        outs = apply_rotary_pos_emb_qk(q, k, freqs, fmt, q_norm_weight=wq, k_norm_weight=wk,
                                       **options)
        grads = [torch.randn_like(o) for o in outs]
        got = torch.autograd.grad(outs, (q, k, wq, wk), grads)
    assert launches == kernels, launches
    for i, (x, w) in enumerate(((q, wq), (k, wk))):
        x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        with triton_rotary_launch.use_launch_rule(rule):
            ref = apply_rotary_pos_emb(x2, freqs, fmt, norm_weight=w2, **options)
            dx, dw = torch.autograd.grad(ref, (x2, w2), grads[i])
        retiled = i == 1 and name in _QK_NORM_KEY_RETILED
        torch.testing.assert_close(outs[i], ref, rtol=2e-6 if retiled else 0,
                                   atol=2e-6 if retiled else 0)
        torch.testing.assert_close(got[i], dx, rtol=0, atol=0)
        torch.testing.assert_close(got[2 + i], dw, rtol=1e-5, atol=1e-5)
        unfused = apply_rotary_pos_emb(x.detach(), freqs, fmt, fused=False, norm_weight=w.detach(),
                                       **options)
        torch.testing.assert_close(outs[i].detach(), unfused, rtol=1e-5, atol=1e-5)


def test_qk_norm_thd_forward_reads_positions_from_one_pre_pass(monkeypatch):
    """On thd with cu_seqlens, the forward of q and k with norms in one call reads its tokens'
    positions from one sequence_positions_kernel launch for both (rule.qk_norm_positions_pass),
    with the same bits as tiles that search cu_seqlens; a call for one tensor searches."""
    L = triton_rotary_launch
    torch.manual_seed(75)
    cu_seqlens = int_tensor([0, 5, 5, 12, 17])
    q, k = torch.randn(17, 4, 32, device=DEVICE), torch.randn(17, 2, 32, device=DEVICE)
    wq, wk = 1 + 0.2 * torch.randn(32, device=DEVICE), 1 + 0.2 * torch.randn(32, device=DEVICE)
    module = RotaryPositionEmbedding(32, device=DEVICE)
    launches = _counted_launches(monkeypatch)
    results = {}
    for pre_pass in (True, False):
        launches.clear()
        with L.use_launch_rule(L.launch_rule()._replace(qk_norm_positions_pass=pre_pass)):
            results[pre_pass] = apply_rotary_pos_emb_qk(
                q, k, module, "thd", cu_seqlens=cu_seqlens, q_norm_weight=wq, k_norm_weight=wk)
        assert launches["sequence_positions_kernel"] == int(pre_pass), launches
        launches.clear()
        apply_rotary_pos_emb(q, module, "thd", cu_seqlens=cu_seqlens, norm_weight=wq)
        assert launches == {"rotary_kernel": 1}, launches
    for got, searched in zip(results[True], results[False]):
        torch.testing.assert_close(got, searched, rtol=0, atol=0)
    for got, x, w in zip(results[True], (q, k), (wq, wk)):
        torch.testing.assert_close(got, apply_rotary_pos_emb(x, module, "thd", fused=False,
                                                             cu_seqlens=cu_seqlens, norm_weight=w),
                                   rtol=1e-5, atol=1e-5)


def test_qk_norm_key_launch_starts_while_the_query_launch_ends(monkeypatch):
    """q and k with norms in two launches (equal tiles: a norm over the token, as OLMo 2's),
    with rule.qk_norm_overlap: the query's launch lets the next one start once all its
    programs have begun (Variant.LAUNCH_DEPENDENTS), and the key's is a programmatic dependent
    launch (Triton's launch_pdl) whose programs end after the query's (WAITS_FOR_PREVIOUS),
    forward and backward; without it, plain launches. The outputs and gradients are the same
    bits either way. A GPU before compute capability 9.0 takes plain launches."""
    L = triton_rotary_launch
    torch.manual_seed(76)
    q, k = torch.randn(2, 9, 4, 32, device=DEVICE), torch.randn(2, 9, 4, 32, device=DEVICE)
    wq, wk = 1 + 0.2 * torch.randn(128, device=DEVICE), 1 + 0.2 * torch.randn(128, device=DEVICE)
    grads = torch.randn_like(q), torch.randn_like(k)
    module = RotaryPositionEmbedding(32, device=DEVICE)
    launched = []

    def record(launch):
        if launch.kernel.fn.__name__ == "rotary_kernel":
            cfg = launch.constexprs[0]
            launched.append((cfg.LAUNCH_DEPENDENTS, cfg.WAITS_FOR_PREVIOUS,
                             launch.options.get("launch_pdl", False)))
    _watch_launches(monkeypatch, record)
    early = not ON_GPU or torch.cuda.get_device_capability()[0] >= 9
    results = {}
    for overlap in (True, False):
        L._PLANS.clear()
        launched.clear()
        with L.use_launch_rule(L.launch_rule()._replace(qk_norm_overlap=overlap)):
            x = [t.clone().requires_grad_(True) for t in (q, k, wq, wk)]
            outs = apply_rotary_pos_emb_qk(x[0], x[1], module, "bshd", q_norm_weight=x[2],
                                           k_norm_weight=x[3], norm_over="token")
            results[overlap] = (*outs, *torch.autograd.grad(outs, x, grads))
        # forward: q's launch, then k's; backward the same
        plain = [(False, False, False)] * 2
        expected = [(True, False, False), (False, True, True)] if overlap and early else plain
        assert launched == expected * 2, launched
    for got, plain in zip(results[True], results[False]):
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_qk_norm_forward_takes_pair_tiles_where_the_rule_says(monkeypatch):
    """The forward of q and k with per-head norms takes pair tiles (one rotary_qk_kernel launch
    whose programs hold a query tile and the key heads of its tokens) where a query of several
    heads meets a key of one (with exact angles, a query of at most NORM_PAIR_EXACT_MAX_HEADS);
    not for a one-head query, more key heads or a norm over the token, and never in the
    backward (`_norm_pair_tiles`). The pair tile is
    q's own forward tile, but for 2 to NORM_PAIR_FEW_HEADS query heads: after the angles with exact
    angles, half the plain tile with a table. Each output of pair tiles equals its own call's to
    float32 rounding (the separate tiles' outputs: test_qk_norm_pair_matches_separate_calls)."""
    monkeypatch.setattr(triton_rotary_launch, "_sm_count", lambda device: 1)
    L = triton_rotary_launch
    row = 32 * 4                                    # bytes of one head of d 32 in float32
    positions_rows, plain_rows = L.NORM_POSITIONS_TILE_BYTES // row, L.TILE_BYTES // row
    module = RotaryPositionEmbedding(32, device=DEVICE)
    cases = {   # name: (query heads, key heads, angles, norm_over, the pair tile's
                #        (NORM_AFTER_ANGLES, tokens x heads) or None: no pair tiles)
        "4:1, exact angles": (4, 1, module, "head", (False, positions_rows)),
        "4:1, table": (4, 1, module(128), "head", (True, plain_rows)),
        "2:1, exact angles": (2, 1, module, "head", (True, positions_rows)),
        "2:1, table": (2, 1, module(128), "head", (True, plain_rows // 2)),
        "1:1, exact angles": (1, 1, module, "head", None),
        "8:1, exact angles": (8, 1, module, "head", None),
        "8:1, table": (8, 1, module(128), "head", (True, plain_rows)),
        "8:2, exact angles": (8, 2, module, "head", None),
        "4:1, over the token": (4, 1, module, "token", None),
    }
    # The cases of one key head take pair tiles (with exact angles up to 4 query heads), and
    # those of 2 query heads are few-head ones.
    assert (L.NORM_PAIR_KEY_HEADS, L.NORM_PAIR_FEW_HEADS, L.NORM_PAIR_EXACT_MAX_HEADS) == (1, 2, 4)
    torch.manual_seed(76)
    found, expected = {}, {}
    for name, (q_heads, k_heads, freqs, over, pair) in cases.items():
        q = torch.randn(128, 1, q_heads, 32, device=DEVICE, requires_grad=True)
        k = torch.randn(128, 1, k_heads, 32, device=DEVICE, requires_grad=True)
        width = (lambda heads: 32) if over == "head" else (lambda heads: heads * 32)
        wq = 1 + 0.2 * torch.randn(width(q_heads), device=DEVICE)
        wk = 1 + 0.2 * torch.randn(width(k_heads), device=DEVICE)
        L._PLANS.clear()
        with L.use_launch_rule(L.GPU_RULE):
            outs = apply_rotary_pos_emb_qk(q, k, freqs, q_norm_weight=wq, k_norm_weight=wk,
                                           norm_over=over)
        (plan,) = L._PLANS.values()
        expected[name], found[name] = pair, None
        if plan.launch is None or plan.launch.cfg[1] is not None:         # separate tiles
            continue
        cfg = plan.launch.cfg[0]
        found[name] = (cfg.NORM_AFTER_ANGLES, cfg.BLOCK_T * cfg.BLOCK_H)
        L._PLANS.clear()
        with L.use_launch_rule(L.GPU_RULE):
            sum(o.sum() for o in outs).backward()
        assert not any(p.launch is not None and p.launch.cfg[1] is None
                       for p in L._PLANS.values()), name
        for x, w, out in ((q, wq, outs[0]), (k, wk, outs[1])):
            with L.use_launch_rule(L.GPU_RULE):
                ref = apply_rotary_pos_emb(x.detach(), freqs, norm_weight=w, norm_over=over)
            torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6, msg=name)
    assert found == expected


def test_qk_pair_gradcheck_norms_and_bad_input():
    """float64 gradcheck and gradgradcheck of the joint call, gradcheck with norms (the
    weights' gradients included); empty q or k; bad pairs and bad weights named."""
    torch.manual_seed(72)
    f64 = dict(device=DEVICE, dtype=torch.float64)
    module = RotaryPositionEmbedding(8, rotary_percent=0.5, device=DEVICE)
    q = torch.randn(3, 2, 2, 8, **f64, requires_grad=True)
    k = torch.randn(3, 2, 1, 8, **f64, requires_grad=True)
    assert gradcheck(lambda a, b: apply_rotary_pos_emb_qk(a, b, module), (q, k))
    assert gradcheck(lambda a, b: apply_rotary_pos_emb_qk(a, b, module), (q, k), order=2)

    wq = torch.randn(8, **f64, requires_grad=True)
    wk = torch.randn(8, **f64, requires_grad=True)
    norms = dict(norm_eps=1e-5, norm_offset=1.0)
    assert gradcheck(
        lambda a, b, c, d: apply_rotary_pos_emb_qk(a, b, module, q_norm_weight=c, k_norm_weight=d,
                                                   **norms), (q, k, wq, wk))

    empty_q = torch.randn(3, 2, 0, 8, **f64)
    out_q, out_k = apply_rotary_pos_emb_qk(empty_q, k.detach(), module)
    assert out_q.shape == empty_q.shape
    torch.testing.assert_close(out_k, apply_rotary_pos_emb(k.detach(), module), rtol=0, atol=0)

    bad = [(torch.randn(4, 2, 1, 8, **f64), {}, ValueError, "k must have q's tokens"),
           (torch.randn(3, 2, 1, 4, **f64), {}, ValueError, "k must have q's tokens"),
           (k.detach().float(), {}, ValueError, "k must have q's dtype"),
           ([1.0], {}, TypeError, "k must be a torch.Tensor"),
           (k.detach(), {"q_norm_weight": torch.ones(8, **f64)},
            ValueError, "q_norm_weight and k_norm_weight together"),
           (k.detach(), {"q_norm_weight": torch.ones(8, **f64), "k_norm_weight": torch.ones(4, **f64)},
            ValueError, r"k_norm_weight must have shape \[d\] = \[8\]"),
           (k.detach(), {"q_norm_weight": torch.ones(8, dtype=torch.int32), "k_norm_weight": torch.ones(8, **f64)},
            TypeError, "q_norm_weight must be float32")]
    for k_bad, extra, error, message in bad:
        for fused in (True, False):
            with pytest.raises(error, match=message):
                apply_rotary_pos_emb_qk(q.detach(), k_bad, module, fused=fused, **extra)


# =================================================================================================
# == 6. Errors
#    Bad input raises a ValueError or TypeError naming the argument.
# =================================================================================================


_BAD_ROPE_ARGS = [
    (dict(rope_scaling={"rope_type": "ntk-magic"}), ValueError, "rope_scaling.*ntk-magic"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError, "rope_scaling.*dynamic.*supported"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
                        "original_max_position_embeddings": 4096}), ValueError, "rope_scaling.*longrope.*supported"),
    (dict(rope_scaling={"rope_type": "linear"}), ValueError, r"rope_scaling\['factor'\]"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), TypeError, r"rope_scaling\['factor'\]"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), ValueError, r"rope_scaling\['factor'\]"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}), ValueError, "low_freq_factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}), ValueError, "high_freq_factor"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ValueError, "original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}),
     ValueError, "max_position_embeddings"),
    (dict(rope_scaling=[("rope_type", "linear")]), TypeError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 500000.0}), ValueError, "rotary_base"),
    (dict(mrope_section=[10, 10, 10]), ValueError, "mrope_section.*sum"),
    (dict(mrope_section=[20, 14, -2]), ValueError, "mrope_section.*non-negative"),
    (dict(mrope_section=[16.0, 8, 8]), TypeError, "mrope_section"),
    (dict(mrope_section=32), TypeError, "mrope_section"),
    (dict(mrope_section=[16, 16], mrope_interleaved=True), ValueError, "mrope_section"),
    (dict(mrope_interleaved=True), ValueError, "mrope_section"),
    (dict(rope_scaling={"rope_type": "default", "mrope_section": [16, 8, 8]}, mrope_section=[8, 16, 8]),
     ValueError, "mrope_section"),
    (dict(dim=10, rotary_percent=0.5), ValueError, "even"),
    (dict(dim=66, rotary_percent=0.01), ValueError, "even"),
    (dict(dim=0), ValueError, "dim"),
    (dict(rotary_percent=1.5), ValueError, "rotary_percent"),
    (dict(rotary_base=-1.0), ValueError, "rotary_base"),
    # Settings that would make every frequency 0 or inf, or every output NaN.
    (dict(rotary_base=float("inf")), ValueError, "rotary_base must be a positive number"),
    (dict(rotary_base=1e-320), ValueError, "not finite and > 0"),
    (dict(rope_scaling={"rope_type": "linear", "factor": float("inf")}), ValueError,
     r"rope_scaling\['factor'\] must be a finite number"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                        "attention_factor": float("nan")}), ValueError, r"rope_scaling\['attention_factor'\]"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                        "attention_factor": -1.0}), ValueError, r"rope_scaling\['attention_factor'\]"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                        "mscale": float("nan"), "mscale_all_dim": 1.0}), ValueError, r"rope_scaling\['mscale'\]"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                        "beta_fast": -1}), ValueError, r"rope_scaling\['beta_fast'\]"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                        "truncate": "no"}), TypeError, r"rope_scaling\['truncate'\] must be a bool"),
    (dict(rotary_base=1.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 4096}),
     ValueError, "rotary_base=1.0 with rope_scaling=.* gives no frequencies"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": float("inf")}),
     ValueError, "original_max_position_embeddings must be a positive number"),
    (dict(interleaved="no"), TypeError, "interleaved must be a bool"),
    (dict(rope_scaling={"mrope_section": [16, 8, 8], "mrope_interleaved": "false"}), TypeError,
     r"rope_scaling\['mrope_interleaved'\] must be a bool"),
    (dict(seq_len_interpolation_factor=0), ValueError, "seq_len_interpolation_factor"),
    (dict(seq_len_interpolation_factor=2, pretrained_max_position_embeddings=0), ValueError,
     "pretrained_max_position_embeddings"),
]


@pytest.mark.parametrize("kwargs,error,match", _BAD_ROPE_ARGS, ids=[m for _, _, m in _BAD_ROPE_ARGS])
def test_rope_scaling_bad_arguments_raise(kwargs, error, match):
    kwargs = dict(kwargs)
    dim = kwargs.pop("dim", 64)
    with pytest.raises(error, match=match):
        RotaryPositionEmbedding(dim, device="cpu", **kwargs)


@pytest.mark.parametrize("args,error,match", [
    ((2.5,), TypeError, "max_seq_len must be an int, got float"),
    ((True,), TypeError, "max_seq_len must be an int, got bool"),
    (("4",), TypeError, "max_seq_len must be an int, got str"),
    ((-1,), ValueError, "max_seq_len must be >= 0"),
    ((4, float("nan")), TypeError, "offset must be an int, got float"),
], ids=["float length", "bool length", "str length", "negative length", "nan offset"])
def test_module_table_bad_arguments_raise(args, error, match):
    """The module's table, `module(max_seq_len, offset)`, names a length or offset that is not
    an int (a float would be rounded up by arange, a NaN offset would fill it with NaN)."""
    with pytest.raises(error, match=re.escape(match)):
        RotaryPositionEmbedding(16, device="cpu")(*args)


def test_numpy_scalars_are_taken_as_numbers():
    """A number argument given as a numpy scalar (as configs read through numpy hold them) or
    a Fraction is taken as the Python number of its value: the same angles, attention scaling
    and outputs (numpy's float32 would otherwise keep yarn's mscale arithmetic in float32);
    a NaN one is still refused as a number that is not finite."""
    np = pytest.importorskip("numpy")
    from fractions import Fraction
    t = torch.randn(8, 1, 2, 64, device=DEVICE)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    f32 = np.float32
    for given in (dict(rotary_base=f32(10000.0)),
                  dict(rotary_percent=f32(0.5), max_position_embeddings=np.int64(4096)),
                  dict(seq_len_interpolation_factor=Fraction(2)),
                  dict(rope_scaling=dict(yarn, beta_fast=f32(16.0))),
                  dict(rope_scaling=dict(yarn, factor=f32(8.0), mscale=f32(0.707),
                                         mscale_all_dim=f32(1.3)))):
        as_python = {key: ({k: float(v) if isinstance(v, (np.floating, Fraction)) else v
                            for k, v in value.items()} if isinstance(value, dict)
                           else int(value) if isinstance(value, np.integer) else float(value))
                     for key, value in given.items()}
        ours = RotaryPositionEmbedding(64, device=DEVICE, **given)
        python = RotaryPositionEmbedding(64, device=DEVICE, **as_python)
        assert torch.equal(ours(8), python(8)), given
        assert getattr(ours, "attention_scaling", 1.0) == getattr(python, "attention_scaling", 1.0), given
    freqs, weight = RotaryPositionEmbedding(64, device=DEVICE)(8), torch.rand(64, device=DEVICE)
    assert torch.equal(apply_rotary_pos_emb(t, freqs, norm_weight=weight, norm_eps=np.float32(0.25)),
                       apply_rotary_pos_emb(t, freqs, norm_weight=weight, norm_eps=0.25))
    with pytest.raises(ValueError, match=re.escape("rope_scaling['beta_fast'] must be a finite number")):
        RotaryPositionEmbedding(64, rope_scaling=dict(yarn, beta_fast=np.float32("nan")))
    with pytest.raises(ValueError, match="norm_eps must be finite"):
        apply_rotary_pos_emb(t, freqs, norm_weight=weight, norm_eps=np.float32("inf"))


def test_from_hf_config_bad_configs_raise():
    with pytest.raises(ValueError, match="head_dim"):
        RotaryPositionEmbedding.from_hf_config({"rope_theta": 10000.0})
    per_layer = {"hidden_size": 512, "num_attention_heads": 8,
                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="rope_parameters"):
        RotaryPositionEmbedding.from_hf_config(per_layer)
    gemma3_json = {"hidden_size": 512, "num_attention_heads": 8, "head_dim": 64, "rope_theta": 1e6,
                   "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    with pytest.raises(ValueError, match="rope_local_base_freq: its sliding-window layers"):
        RotaryPositionEmbedding.from_hf_config(gemma3_json)
    with pytest.raises(ValueError, match="rope_scaling.*dynamic"):
        RotaryPositionEmbedding.from_hf_config({"hidden_size": 512, "num_attention_heads": 8,
                                                "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    for key, value in (("num_attention_heads", 0), ("num_attention_heads", "8"), ("hidden_size", 64.0)):
        config = dict({"hidden_size": 512, "num_attention_heads": 8}, **{key: value})
        with pytest.raises(ValueError, match=f"config's {key} must be a positive int"):
            RotaryPositionEmbedding.from_hf_config(config)
    # A flag of the config's rope dict is named as its key, there and for the models whose
    # layout transformers fixes.
    for model_type in (None, "qwen3_vl_text"):
        config = {"hidden_size": 64, "num_attention_heads": 2, "model_type": model_type,
                  "rope_scaling": {"rope_type": "default", "mrope_section": [8, 4, 4],
                                   "mrope_interleaved": "false"}}
        with pytest.raises(TypeError, match=r"^rope_scaling\['mrope_interleaved'\] must be a bool"):
            RotaryPositionEmbedding.from_hf_config(config)


def test_inplace_rejects_training_and_overlap():
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    t = torch.randn(4, 2, 3, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="t requires grad"):
        apply_rotary_pos_emb_inplace(t, freqs)
    with pytest.raises(ValueError, match="overlapping memory"):
        apply_rotary_pos_emb_inplace(torch.randn(1, 1, 3, 16, device=DEVICE).expand(4, 2, 3, 16), freqs)


@pytest.mark.parametrize("saved_by", ["torch", "ours"])
def test_inplace_rotation_is_seen_by_autograd(saved_by):
    """The in-place rotation writes t's memory with a kernel: a backward that saved t (a torch
    op's, or our QK-norm's) then refuses to run on its new values, as after t.mul_(2), instead
    of computing a gradient from them."""
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    t = torch.randn(4, 2, 3, 16, device=DEVICE)
    weight = torch.randn(16, device=DEVICE, requires_grad=True)
    if saved_by == "torch":
        loss = (weight * t).sum()                          # mul saves t for weight's gradient
    else:
        loss = apply_rotary_pos_emb(t, freqs, norm_weight=weight).sum()
    version = t._version
    with torch.no_grad():
        assert apply_rotary_pos_emb_inplace(t, freqs) is t
    assert t._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _valid_args():
    return dict(t=torch.randn(4, 2, 3, 16, device=DEVICE), freqs=RotaryPositionEmbedding(16, device=DEVICE)(8))


def _thd_args(**extra):
    return dict(t=torch.randn(6, 3, 16, device=DEVICE), freqs=RotaryPositionEmbedding(16, device=DEVICE)(8),
                tensor_format="thd", **extra)


# (name, how to break the arguments, error type, text the message must contain)
BAD_INPUTS = [
    ("t not a tensor", lambda a: a.update(t=[[1.0]]), TypeError, "t must be a torch.Tensor"),
    ("t integer", lambda a: a.update(t=a["t"].int()), TypeError, "t must be float32"),
    ("t rank vs format", lambda a: a.update(t=a["t"][0]), ValueError, "t must be 4-D"),
    ("thd rank", lambda a: a.update(tensor_format="thd", cu_seqlens=int_tensor([0, 4])), ValueError, "t must be 3-D"),
    ("unknown format", lambda a: a.update(tensor_format="sbdh"), ValueError, "tensor_format must be one of"),
    ("inverse not a bool", lambda a: a.update(inverse=1), TypeError, "inverse must be a bool, got int"),
    ("freqs not a tensor", lambda a: a.update(freqs=1.0), TypeError, "freqs must be a torch.Tensor"),
    ("freqs integer", lambda a: a.update(freqs=a["freqs"].int()), TypeError, "freqs must be a floating-point"),
    ("freqs 2-D", lambda a: a.update(freqs=a["freqs"][:, 0, 0]), ValueError, "freqs must have shape [s2, 1, 1, d2]"),
    ("freqs [s2,b,1,d2]", lambda a: a.update(freqs=a["freqs"].expand(8, 2, 1, 16)), ValueError,
     "freqs must have shape"),
    ("odd d2", lambda a: a.update(freqs=a["freqs"][..., :15]), ValueError, "must be even"),
    ("d2 > d", lambda a: a.update(freqs=RotaryPositionEmbedding(32, device=DEVICE)(8)), ValueError,
     "exceeds t's head dim"),
    ("freqs too short", lambda a: a.update(freqs=a["freqs"][:3]), ValueError, "freqs has 3 positions"),
    ("s * cp_size > s2", lambda a: a.update(cp_size=4, cp_rank=0), ValueError, "s * cp_size = 4 * 4"),
    ("odd local length under cp", lambda a: a.update(t=a["t"][:3], cp_size=2), ValueError, "must be even"),
    ("cp_rank >= cp_size", lambda a: a.update(cp_size=2, cp_rank=2), ValueError, "cp_rank must be in [0, cp_size=2)"),
    ("cp_rank negative", lambda a: a.update(cp_rank=-1), ValueError, "cp_rank must be in"),
    ("cp_size 0", lambda a: a.update(cp_size=0), ValueError, "cp_size must be in [1, 2147483647]"),
    ("cp_size 2**64", lambda a: a.update(cp_size=2**64), ValueError, "cp_size must be in [1,"),
    ("cp_size float", lambda a: a.update(cp_size=2.0), TypeError, "cp_size must be an int"),
    ("interleaved not bool", lambda a: a.update(interleaved=1), TypeError, "interleaved must be a bool"),
    ("cu_seqlens missing", lambda a: a.update(_thd_args()), ValueError, "cu_seqlens is required"),
    ("cu_seqlens float", lambda a: a.update(_thd_args(cu_seqlens=int_tensor([0, 6], torch.float32))), TypeError,
     "cu_seqlens must be int32 or int64"),
    ("cu_seqlens 2-D", lambda a: a.update(_thd_args(cu_seqlens=int_tensor([[0, 6]]))), ValueError,
     "cu_seqlens must be 1-D"),
    ("cu_seqlens one entry", lambda a: a.update(_thd_args(cu_seqlens=int_tensor([0]))), ValueError,
     "at least 2 entries"),
    ("cu_seqlens with sbhd", lambda a: a.update(cu_seqlens=int_tensor([0, 4])), ValueError,
     "only valid with tensor_format='thd'"),
    ("start_positions length", lambda a: a.update(start_positions=int_tensor([0, 1, 2])), ValueError,
     "start_positions must have 2 entries"),
    ("start_positions float", lambda a: a.update(start_positions=int_tensor([0, 1], torch.float32)), TypeError,
     "start_positions must be int32 or int64"),
    ("start_positions list", lambda a: a.update(start_positions=[0, 1]), TypeError,
     "start_positions must be a torch.Tensor"),
    ("start_positions with cp", lambda a: a.update(start_positions=int_tensor([0, 1]), cp_size=2), ValueError,
     "not supported with cp_size > 1"),
    ("freqs on another device", lambda a: a.update(freqs=a["freqs"].to("meta")), TypeError, "freqs is on meta"),
    ("cu_seqlens on another device", lambda a: a.update(_thd_args(cu_seqlens=int_tensor([0, 6]).to("meta"))), TypeError,
     "cu_seqlens is on meta"),
    ("norm_weight not a tensor", lambda a: a.update(norm_weight=[1.0] * 16), TypeError,
     "norm_weight must be a torch.Tensor"),
    ("norm_weight integer", lambda a: a.update(norm_weight=torch.ones(16, dtype=torch.int32, device=DEVICE)),
     TypeError, "norm_weight must be float32"),
    ("norm_weight on another device", lambda a: a.update(norm_weight=torch.ones(16, device="meta")), TypeError,
     "norm_weight is on meta"),
    ("norm_weight of h * d per head", lambda a: a.update(norm_weight=torch.ones(48, device=DEVICE)), ValueError,
     "norm_weight must have shape [d] = [16] for norm_over='head', got (48,)"),
    ("norm_weight of d per token", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE), norm_over="token"),
     ValueError, "norm_weight must have shape [h * d] = [48] for norm_over='token'"),
    ("norm_weight 2-D", lambda a: a.update(norm_weight=torch.ones(1, 16, device=DEVICE)), ValueError,
     "norm_weight must have shape [d]"),
    ("norm_over unknown", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE), norm_over="channel"),
     ValueError, "norm_over must be 'head' or 'token', got 'channel'"),
    ("norm_eps negative", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE), norm_eps=-1e-6), ValueError,
     "norm_eps must be >= 0"),
    ("norm_eps a string", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE), norm_eps="1e-6"), TypeError,
     "norm_eps must be a float, got str"),
    ("norm_offset nan", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE), norm_offset=float("nan")),
     ValueError, "norm_offset must be finite"),
    # Without a weight there is no norm, but a wrong option is still a wrong argument.
    ("norm_over unknown, no weight", lambda a: a.update(norm_over="tokens"), ValueError,
     "norm_over must be 'head' or 'token', got 'tokens'"),
    ("norm_eps negative, no weight", lambda a: a.update(norm_eps=-1.0), ValueError, "norm_eps must be >= 0"),
    ("norm_offset a tensor, no weight", lambda a: a.update(norm_offset=torch.ones(2)), TypeError,
     "norm_offset must be a float, got Tensor"),
    # Sparse and nested tensors have no strides for the kernel to read.
    ("t sparse", lambda a: a.update(t=a["t"].to_sparse()), TypeError,
     "t must be a strided (dense) tensor, got layout torch.sparse_coo"),
    ("t nested", lambda a: a.update(t=torch.nested.nested_tensor(
        [torch.randn(4, 3, 16, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)])), TypeError,
     "t must be a strided (dense) tensor, got a nested tensor"),
    ("freqs sparse", lambda a: a.update(freqs=a["freqs"].to_sparse()), TypeError,
     "freqs must be a strided (dense) tensor"),
    ("start_positions sparse", lambda a: a.update(start_positions=int_tensor([0, 1]).to_sparse()), TypeError,
     "start_positions must be a strided (dense) tensor"),
    ("cu_seqlens sparse", lambda a: a.update(_thd_args(cu_seqlens=int_tensor([0, 6]).to_sparse())), TypeError,
     "cu_seqlens must be a strided (dense) tensor"),
    ("positions sparse", lambda a: a.update(positions=int_tensor([0, 1, 2, 3]).to_sparse()), TypeError,
     "positions must be a strided (dense) tensor"),
    ("norm_weight sparse", lambda a: a.update(norm_weight=torch.ones(16, device=DEVICE).to_sparse()), TypeError,
     "norm_weight must be a strided (dense) tensor"),
    # Its table divides the positions by the factor; angles from positions cannot.
    ("module interpolating positions", lambda a: a.update(freqs=RotaryPositionEmbedding(
        16, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=8, device=DEVICE)),
     ValueError, "freqs interpolates positions (seq_len_interpolation_factor=2)"),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name,breaker,error,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_named_error(name, breaker, error, message, fused):
    args = _valid_args()
    breaker(args)
    with pytest.raises(error, match=re.escape(message)):
        apply_rotary_pos_emb(fused=fused, **args)


@pytest.mark.parametrize("entry", ["apply_rotary_pos_emb", "apply_rotary_pos_emb_qk", "apply_fused_qkv_rotary_pos_emb"])
@pytest.mark.parametrize("fused", [None, 0, 1, "False"], ids=repr)
def test_fused_must_be_a_bool(entry, fused):
    """`fused` picks the kernel or the formula: a value that is not a bool is refused, not read
    by its truth value (None and 0 would run the formula, "False" the kernel)."""
    t, freqs = torch.randn(4, 2, 2, 16, device=DEVICE), RotaryPositionEmbedding(8, device=DEVICE)(8)
    calls = {"apply_rotary_pos_emb": lambda: apply_rotary_pos_emb(t, freqs, fused=fused),
             "apply_rotary_pos_emb_qk": lambda: apply_rotary_pos_emb_qk(t, t[:, :, :1], freqs, fused=fused),
             "apply_fused_qkv_rotary_pos_emb": lambda: apply_fused_qkv_rotary_pos_emb(
                 torch.randn(4, 2, 1, 32, device=DEVICE), freqs, freqs, [16, 8, 8], fused=fused)}
    with pytest.raises(TypeError, match=f"^fused must be a bool, got {type(fused).__name__}$"):
        calls[entry]()


@pytest.mark.parametrize("transform", ["vmap", "vmap of positions", "jvp", "grad"])
@pytest.mark.parametrize("entry", ["module", "table", "qk", "qkv", "in place"])
def test_torch_func_transforms_are_named(entry, transform):
    """A tensor of a torch.func transform (vmap's batched tensor, jvp's and grad's wrappers)
    has no storage for a kernel: refused naming the argument, while fused=False, plain
    PyTorch, is what the transforms see through: vmap of it is the loop of its calls."""
    torch.manual_seed(48)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    xs = torch.randn(3, 4, 2, 2, 16, device=DEVICE)            # vmap's dim, then sbhd
    positions = torch.randint(0, 40, (3, 2, 4), device=DEVICE)  # [b, s] per vmapped call
    qkv = torch.randn(3, 4, 2, 1, 64, device=DEVICE)

    def call(x, fused, pos=None):
        freqs = module(8) if entry == "table" else module
        kw = dict(fused=fused) if entry != "in place" else {}
        if entry == "qk":
            return apply_rotary_pos_emb_qk(x, x[:, :, :1] * 2, freqs, positions=pos, **kw)[0]
        if entry == "qkv":
            return apply_fused_qkv_rotary_pos_emb(x, freqs, freqs, [16, 16, 32], positions=pos, **kw)[0]
        if entry == "in place":
            return apply_rotary_pos_emb_inplace(x.clone(), freqs, positions=pos)
        return apply_rotary_pos_emb(x, freqs, positions=pos, **kw)

    inputs = qkv if entry == "qkv" else xs
    name = {"qk": "q", "qkv": "qkv"}.get(entry, "t")
    skips = {("vmap of positions", "table"): "positions take angles from a module",
             ("grad", "in place"): "no autograd in place"}
    if (transform, entry) in skips:
        pytest.skip(skips[transform, entry])
    weights = inputs[1].sum(-1, keepdim=True)           # grad's loss: a weighted sum
    cases = {   # the transformed call, and what fused=False's must equal (None: grad's, below)
        "vmap of positions": (lambda fused: torch.func.vmap(lambda p: call(inputs[0], fused, p))(positions),
                              lambda: torch.stack([call(inputs[0], False, p) for p in positions])),
        "vmap": (lambda fused: torch.func.vmap(lambda x: call(x, fused))(inputs),
                 lambda: torch.stack([call(x, False) for x in inputs])),
        # linear in x: its jvp is the call on the tangent
        "jvp": (lambda fused: torch.func.jvp(lambda x: call(x, fused), (inputs[0],), (inputs[1],))[1],
                lambda: call(inputs[1], False)),
        "grad": (lambda fused: torch.func.grad(lambda x: (call(x, fused) * weights).sum())(inputs[0]), None)}
    run, loop = cases[transform]
    if transform == "vmap of positions":
        name = "positions"
    with pytest.raises(TypeError, match=f"^{name} is a tensor of a torch.func transform .* pass fused=False"):
        run(True)
    if entry == "in place":
        return          # no fused=False to take
    if loop is not None:
        torch.testing.assert_close(run(False), loop())
    else:
        x = inputs[0].clone().requires_grad_(True)
        (call(x, False) * weights).sum().backward()
        torch.testing.assert_close(run(False), x.grad)


@pytest.mark.parametrize("entry", ["table", "module", "qk", "qkv", "in place"])
def test_tensor_without_data_is_rejected_before_the_kernel(entry):
    """A meta tensor has no data for a kernel, under the interpreter too (where CPU tensors are
    taken): refused naming the argument, while fused=False, plain PyTorch, computes its shape."""
    t = torch.empty(4, 2, 3, 16, device="meta")
    module = RotaryPositionEmbedding(16, device="meta")
    qkv = torch.empty(4, 2, 1, 64, device="meta")
    calls = {"table": ("t", lambda fused: apply_rotary_pos_emb(t, module(8), fused=fused)),
             "module": ("t", lambda fused: apply_rotary_pos_emb(t, module, fused=fused)),
             "qk": ("q", lambda fused: apply_rotary_pos_emb_qk(t, t[:, :, :1], module, fused=fused)[0]),
             "qkv": ("qkv", lambda fused: apply_fused_qkv_rotary_pos_emb(qkv, module, module, [16, 16, 32],
                                                                         fused=fused)[0]),
             "in place": ("t", lambda fused: apply_rotary_pos_emb_inplace(t, module(8)))}
    name, call = calls[entry]
    if entry != "in place":
        assert call(False).shape == (t.shape if entry != "qkv" else (4, 2, 1, 16))
    with pytest.raises(TypeError, match=f"^{name} is on meta: the Triton kernel needs a CUDA tensor"):
        call(True)


def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setattr(triton_rotary_launch, "_interpreting", lambda: False)
    t = torch.randn(4, 2, 3, 16)
    with pytest.raises(TypeError, match="needs a CUDA tensor"):
        apply_rotary_pos_emb(t, RotaryPositionEmbedding(16, device="cpu")(8))


_QKV_BAD = [  # (how to break the valid call, error, text naming the argument)
    (lambda a: a.update(qkv=a["qkv"].int()), TypeError, "qkv must be float32"),
    (lambda a: a.update(qkv=[1.0]), TypeError, "qkv must be a torch.Tensor"),
    (lambda a: a.update(qkv=a["qkv"][0]), ValueError, "qkv must be 4-D"),
    (lambda a: a.update(q_freqs=1.0), TypeError, "q_freqs must be a torch.Tensor"),
    (lambda a: a.update(k_freqs=a["k_freqs"].int()), TypeError, "k_freqs must be a floating-point"),
    (lambda a: a.update(q_freqs=a["q_freqs"][:, 0]), ValueError, "q_freqs must have shape [s2, 1, 1, d2]"),
    (lambda a: a.update(k_freqs=a["k_freqs"][:3]), ValueError, "k_freqs has 3 positions"),
    (lambda a: a.update(k_freqs=a["k_freqs"][..., :7]), ValueError, "k_freqs' last dimension"),
    (lambda a: a.update(q_freqs=RotaryPositionEmbedding(16, device=DEVICE)(8)), ValueError,
     "q_freqs' rotary dim d2=16 exceeds qkv's head dim"),
    (lambda a: a.update(k_freqs=a["k_freqs"].to("meta")), TypeError, "k_freqs is on meta but qkv is on"),
    (lambda a: a.update(start_positions=int_tensor([0, 1]).to("meta")), TypeError,
     "start_positions is on meta but qkv"),
    (lambda a: a.update(positions=int_tensor([0, 1, 2, 3]).to("meta")), TypeError, "positions is on meta but qkv"),
    (lambda a: a.update(positions=int_tensor([0, 1, 2])), ValueError, "positions must have shape"),
    (lambda a: a.update(q_freqs=RotaryPositionEmbedding(8, device=DEVICE)), TypeError,
     "q_freqs and k_freqs must be of one kind"),
    (lambda a: a.update(inverse="yes"), TypeError, "inverse must be a bool, got str"),
    (lambda a: a.update(q_norm_weight=torch.ones(8, device=DEVICE)), ValueError,
     "give q_norm_weight and k_norm_weight together"),
    (lambda a: a.update(q_norm_weight=torch.ones(8, device=DEVICE), k_norm_weight=torch.ones(16, device=DEVICE)),
     ValueError, "k_norm_weight must have shape [d] = [8]"),
    (lambda a: a.update(q_norm_weight=torch.ones(8, device="meta"), k_norm_weight=torch.ones(8, device=DEVICE)),
     TypeError, "q_norm_weight is on meta"),
    (lambda a: a.update(q_norm_weight=torch.ones(8, device=DEVICE), k_norm_weight=torch.ones(8, device=DEVICE),
                        norm_eps=None), TypeError, "norm_eps must be a float, got NoneType"),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("breaker,error,message", _QKV_BAD, ids=[m for _, _, m in _QKV_BAD])
def test_qkv_errors_name_qkv_arguments(breaker, error, message, fused):
    """Errors of apply_fused_qkv_rotary_pos_emb name its own arguments, not the 't' and
    'freqs' of the shared checks, which the caller never passed."""
    args = dict(qkv=torch.randn(4, 2, 2, 32, device=DEVICE), q_freqs=RotaryPositionEmbedding(8, device=DEVICE)(8),
                k_freqs=RotaryPositionEmbedding(8, device=DEVICE)(8) * 0.5, qkv_split_arg_list=[16, 8, 8])
    breaker(args)
    with pytest.raises(error, match=re.escape(message)) as info:
        apply_fused_qkv_rotary_pos_emb(fused=fused, **args)
    assert not re.search(r"(?<![\w'])t(?![\w'])|\bfreqs\b", str(info.value)), str(info.value)


def test_qkv_error_without_interpreter_names_qkv(monkeypatch):
    monkeypatch.setattr(triton_rotary_launch, "_interpreting", lambda: False)
    freqs = RotaryPositionEmbedding(8, device="cpu")(8)
    with pytest.raises(TypeError, match=r"^qkv is on cpu: the Triton kernel needs a CUDA tensor"):
        apply_fused_qkv_rotary_pos_emb(torch.randn(4, 2, 2, 32), freqs, freqs, [16, 8, 8])


class _DuckRope:
    """Anything with a RotaryPositionEmbedding's attributes is taken as one."""
    def __init__(self, inv_freq, n_axes=1, pair_axis=None, interleaved=False):
        self.inv_freq, self.n_axes, self.pair_axis = inv_freq, n_axes, pair_axis
        self.interleaved, self.attention_scaling = interleaved, 1.0


def test_duck_typed_modules_are_checked():
    """A module's own fields are input too: a missing pair_axis is named, an axis outside
    [0, n_axes) gives NaN (never a read outside positions), a negative-bit inv_freq is read
    with its sign."""
    inv = RotaryPositionEmbedding(8, device=DEVICE).inv_freq
    t = torch.randn(5, 2, 3, 8, device=DEVICE)
    pos = torch.randint(0, 50, (3, 5), device=DEVICE)
    with pytest.raises(TypeError, match="pair_axis"):
        apply_rotary_pos_emb(t, _DuckRope(inv, n_axes=3), positions=pos)
    bad_axis = torch.tensor([0, 1, 7, -1], dtype=torch.int32, device=DEVICE)
    for dtype in (torch.float32, torch.float64):     # float64 computes its angles apart
        out = apply_rotary_pos_emb(t.to(dtype), _DuckRope(inv, 3, bad_axis), positions=pos)
        assert out[..., [2, 3, 6, 7]].isnan().all() and out[..., [0, 1, 4, 5]].isfinite().all()
    neg = torch._neg_view(-inv)
    torch.testing.assert_close(apply_rotary_pos_emb(t, _DuckRope(neg)),
                               apply_rotary_pos_emb(t, _DuckRope(inv)))


def test_angle_sources_given_as_freqs_are_checked():
    """An AngleSource passed as freqs (what the autograd functions and custom ops hand on) is
    checked like a module: inv_freq or pair_axis without unit stride is named, since the kernel
    reads them in order, and so are a scale that is not a finite number and fields of other
    types; contiguous ones rotate as the module does."""
    L = triton_rotary_launch
    module = RotaryPositionEmbedding(16, mrope_section=[2, 3, 3], device=DEVICE)
    t = torch.randn(8, 2, 3, 16, device=DEVICE)
    positions = torch.randint(0, 40, (3, 2, 8), device=DEVICE)
    source = L.angle_source(module)

    def strided(x):                  # the same values, every second element of a buffer
        return torch.stack([x, torch.zeros_like(x)], 1).reshape(-1)[::2]

    torch.testing.assert_close(apply_rotary_pos_emb(t, source, positions=positions),
                               apply_rotary_pos_emb(t, module, positions=positions))
    for field in ("angles", "pair_axis"):
        bad = source._replace(**{field: strided(getattr(source, field))})
        with pytest.raises(ValueError, match="unit stride"):
            apply_rotary_pos_emb(t, bad, positions=positions)
    # Its other fields: what the kernel is specialized on, or multiplies by.
    for change, error, match in ((dict(scale=float("nan")), ValueError, "scale must be a finite number"),
                                 (dict(scale="1"), ValueError, "scale must be a finite number"),
                                 (dict(n_axes=0), ValueError, "n_axes must be an int >= 1"),
                                 (dict(from_positions="yes"), TypeError, "from_positions must be a bool"),
                                 (dict(interleaved=1), TypeError, "interleaved must be a bool or None")):
        with pytest.raises(error, match=match):
            apply_rotary_pos_emb(t, source._replace(**change), positions=positions)


def test_launcher_backward_flag_must_be_a_bool():
    """set_rotary_kernel's `backward` picks the rotation's direction: 1 or "yes" are named,
    not taken by their truth."""
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    t = torch.randn(4, 2, 3, 16, device=DEVICE)
    for value in (1, "yes"):
        with pytest.raises(TypeError, match="backward must be a bool"):
            set_rotary_kernel(t, freqs, backward=value)


def test_qk_pair_names_a_missing_tensor():
    """apply_rotary_pos_emb_qk names q or k when one is not a tensor, fused or not, and q's or
    k's norm weight when it does not fit, also where q or k is empty."""
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    q = torch.randn(8, 2, 3, 16, device=DEVICE)
    k = torch.randn(8, 2, 1, 16, device=DEVICE)
    for fused in (True, False):
        for args, name in (((q, None), "k"), ((None, q), "q"), ((None, None), "q")):
            with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got NoneType"):
                apply_rotary_pos_emb_qk(*args, freqs, fused=fused)
        good, bad = torch.ones(16, device=DEVICE), torch.ones(9, device=DEVICE)
        for q_, k_ in ((q, k), (q[:, :, :0], k), (q, k[:, :, :0])):
            for weights, name in (((bad, good), "q_norm_weight"), ((good, bad), "k_norm_weight")):
                with pytest.raises(ValueError, match=f"{name} must have shape"):
                    apply_rotary_pos_emb_qk(q_, k_, freqs, fused=fused, q_norm_weight=weights[0],
                                            k_norm_weight=weights[1])


def test_norm_options_are_checked_without_a_weight():
    """A wrong norm_over, norm_eps or norm_offset is named by the q-and-k and fused-QKV entry
    points without norm weights too (apply_rotary_pos_emb's: BAD_INPUTS), fused or not."""
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    q, k = torch.randn(8, 2, 3, 16, device=DEVICE), torch.randn(8, 2, 1, 16, device=DEVICE)
    qkv = torch.randn(8, 2, 2, 64, device=DEVICE)
    bad = ((dict(norm_over="channel"), ValueError, "norm_over must be 'head' or 'token'"),
           (dict(norm_eps=-1.0), ValueError, "norm_eps must be >= 0"),
           (dict(norm_offset="1"), TypeError, "norm_offset must be a float, got str"))
    for options, error, message in bad:
        for fused in (True, False):
            with pytest.raises(error, match=re.escape(message)):
                apply_rotary_pos_emb_qk(q, k, freqs, fused=fused, **options)
        if "norm_over" not in options:
            with pytest.raises(error, match=re.escape(message)):
                apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16], **options)


def test_qkv_backward_grads_and_overlapping_out_are_rejected():
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(6)
    qkv = torch.randn(4, 2, 2, 32, device=DEVICE)
    dq, dk = torch.randn(4, 2, 4, 8, device=DEVICE), torch.randn(4, 2, 2, 8, device=DEVICE)
    with pytest.raises(TypeError, match="dq, dk, dv"):
        triton_rotary_launch.set_rotary_qkv_kernel(qkv, freqs, freqs, [16, 8, 8], grads=(dq, dk))
    buffer = torch.randn(2 * 4 * 2 * 3 * 8, device=DEVICE)
    t = buffer[: 4 * 2 * 3 * 8].view(4, 2, 3, 8)
    out = buffer[8: 8 + 4 * 2 * 3 * 8].view(4, 2, 3, 8)       # overlaps t, shifted by a head
    with pytest.raises(ValueError, match="share memory with t"):
        set_rotary_kernel(t, freqs, out=out)
    # The same layouts, planned first with an out apart from t: whether memory is shared is
    # a matter of pointers, which no plan's key holds.
    apart = torch.empty_like(t)
    set_rotary_kernel(t, freqs, out=apart)
    with pytest.raises(ValueError, match="share memory with t"):
        set_rotary_kernel(t, freqs, out=out)


def test_out_of_another_shape_is_rejected():
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(6)
    t = torch.randn(4, 2, 3, 8, device=DEVICE)
    buffer = torch.zeros(t.numel(), device=DEVICE)     # the writes past out stay inside it
    out = buffer[: t.numel() // 2].view(2, 2, 3, 8)
    with pytest.raises(ValueError, match="out"):
        set_rotary_kernel(t, freqs, out=out)


def _positions_error_args(**extra):
    args = dict(t=torch.randn(4, 2, 3, 16, device=DEVICE), freqs=RotaryPositionEmbedding(16, device=DEVICE),
                positions=torch.arange(4, device=DEVICE))
    args.update(extra)
    return args


def _long(*shape):
    return torch.zeros(shape, dtype=torch.long, device=DEVICE)


def _thd_positions_error_args(**extra):
    return _positions_error_args(**{"t": torch.randn(6, 3, 16, device=DEVICE), "tensor_format": "thd",
                                    "positions": torch.arange(6, device=DEVICE), **extra})


# (name, arguments, error type, text the message must contain)
_BAD_POSITIONS = [
    ("float", lambda: _positions_error_args(positions=torch.arange(4.0, device=DEVICE)), TypeError,
     "positions must be int32 or int64"),
    ("list", lambda: _positions_error_args(positions=[0, 1, 2, 3]), TypeError,
     "positions must be a torch.Tensor"),
    ("too short", lambda: _positions_error_args(positions=torch.arange(3, device=DEVICE)), ValueError,
     "positions must have shape [s] or [b, s]"),
    ("[s, b] instead of [b, s]", lambda: _positions_error_args(positions=_long(4, 2)),
     ValueError, "positions must have shape [s] or [b, s]"),
    ("axis dim for a one-axis module", lambda: _positions_error_args(positions=_long(1, 2, 4)),
     ValueError, "positions must have shape [s] or [b, s]"),
    ("on another device", lambda: _positions_error_args(positions=torch.arange(4, device="meta")), TypeError,
     "positions is on meta"),
    ("with start_positions", lambda: _positions_error_args(start_positions=_long(2).int()),
     ValueError, "positions and start_positions cannot be combined"),
    ("with cp_size > 1", lambda: _positions_error_args(cp_size=2, cp_rank=1), ValueError,
     "positions cannot be combined with cp_size > 1"),
    ("thd with cu_seqlens", lambda: _thd_positions_error_args(cu_seqlens=int_tensor([0, 6])), ValueError,
     "give cu_seqlens or positions"),
    ("thd [1, t]", lambda: _thd_positions_error_args(positions=_long(1, 6)), ValueError,
     "positions must have shape [t]"),
    ("module interleaved, call not", lambda: _positions_error_args(
        freqs=RotaryPositionEmbedding(16, interleaved=True, device=DEVICE)), ValueError,
     "interleaved=False but freqs was built with interleaved=True"),
    ("call interleaved, module not", lambda: _positions_error_args(interleaved=True), ValueError,
     "interleaved=True but freqs was built with interleaved=False"),
    # M-RoPE: the axis dim must be there, with the module's number of axes
    ("M-RoPE module, one-axis positions", lambda: _positions_error_args(freqs=mrope_module(False, 16, [2, 3, 3])),
     ValueError, "positions must have shape [3, s] or [3, b, s]"),
    ("M-RoPE module, two axes", lambda: _positions_error_args(
        freqs=mrope_module(False, 16, [2, 3, 3]), positions=_long(2, 2, 4)), ValueError,
     "positions must have shape [3, s] or [3, b, s]"),
    ("M-RoPE module, thd [t]", lambda: _thd_positions_error_args(freqs=mrope_module(True, 16, [4, 2, 2])),
     ValueError, "positions must have shape [3, t]"),
    ("M-RoPE positions for a table", lambda: _positions_error_args(
        freqs=RotaryPositionEmbedding(16, device=DEVICE)(8), positions=_long(3, 2, 4)),
     ValueError, "positions must have shape [s] or [b, s]"),
]


@pytest.mark.parametrize("entry", ["fused", "unfused", "inplace"])
@pytest.mark.parametrize("name,make_args,error,message", _BAD_POSITIONS, ids=[b[0] for b in _BAD_POSITIONS])
def test_bad_positions_raise_named_error(name, make_args, error, message, entry):
    args = make_args()
    with pytest.raises(error, match=re.escape(message)):
        if entry == "inplace":
            with torch.no_grad():
                apply_rotary_pos_emb_inplace(**args)
        else:
            apply_rotary_pos_emb(fused=entry == "fused", **args)


def test_fused_qkv_bad_positions_raise_named_error():
    emb = RotaryPositionEmbedding(16, device=DEVICE)
    qkv = torch.randn(4, 2, 2, 48, device=DEVICE)
    cases = [(dict(positions=torch.arange(4.0)), TypeError, "positions must be int32 or int64"),
             (dict(positions=torch.arange(5)), ValueError, "positions must have shape [s] or [b, s]"),
             (dict(positions=torch.zeros(3, 2, 4, dtype=torch.long)), ValueError, "positions must have shape"),
             (dict(positions=torch.arange(4), start_positions=_long(2).int()), ValueError,
              "positions and start_positions cannot be combined"),
             (dict(positions=torch.arange(4), interleaved=True), ValueError,
              "interleaved=True but q_freqs was built with interleaved=False")]
    for fused in (True, False):
        for kwargs, error, message in cases:
            kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            with pytest.raises(error, match=re.escape(message)):
                apply_fused_qkv_rotary_pos_emb(qkv, emb, emb, [16, 16, 16], fused=fused, **kwargs)
    # one autograd function serves both, so q and k must agree on the number of axes
    with pytest.raises(TypeError, match="q_freqs and k_freqs must be of one kind"):
        apply_fused_qkv_rotary_pos_emb(qkv, mrope_module(False, 16, [2, 3, 3]), emb, [16, 16, 16])


# =================================================================================================
# == 7. Integration
#    Torch.compile, opcheck of the custom ops, CUDA graphs, context parallelism across
#    processes.
# =================================================================================================


def _compiled_variants():
    return sum(len(cache[0]) for cache in triton_rotary_kernel.rotary_kernel.device_caches.values())


def test_torch_compile_fullgraph():
    """No graph break (fullgraph=True), same values forward and backward, and no new Triton
    compilation when only the sequence length changes."""
    torch.manual_seed(10)
    freqs = RotaryPositionEmbedding(32, device=DEVICE)(64)

    def step(x, f):
        return (apply_rotary_pos_emb(x, f) * 2).sum(dim=-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    variants = []
    for seq_len in (32, 48, 64):
        t = torch.randn(seq_len, 2, 3, 32, device=DEVICE)
        x1, x2 = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
        out, ref = compiled(x1, freqs), step(x2, freqs)
        torch.testing.assert_close(out, ref)
        grad = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, x1, grad)[0], torch.autograd.grad(ref, x2, grad)[0])
        if ON_GPU:
            variants.append(_compiled_variants())
    if ON_GPU:
        assert variants[0] == variants[1] == variants[2], variants


def test_torch_compile_inverse_round_trip():
    """fullgraph=True through the rotation and its inverse, recorded by autograd and not: the
    round trip gives x back, its gradient the incoming one, the same values as eager."""
    torch.manual_seed(44)
    module = RotaryPositionEmbedding(16, device=DEVICE)

    def round_trip(x):
        return apply_rotary_pos_emb(apply_rotary_pos_emb(x, module, "bshd"), module, "bshd", inverse=True)

    compiled = torch.compile(round_trip, fullgraph=True)
    t = torch.randn(2, 6, 3, 20, device=DEVICE)
    x = t.clone().requires_grad_(True)
    out = compiled(x)
    torch.testing.assert_close(out, t, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(t)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(compiled(t), round_trip(t))


def test_torch_compile_qk_pair():
    """fullgraph=True through apply_rotary_pos_emb_qk: one op for q and k, the same values
    forward and backward as eager."""
    torch.manual_seed(73)
    module = RotaryPositionEmbedding(32, device=DEVICE)

    def step(q, k):
        out_q, out_k = apply_rotary_pos_emb_qk(q, k, module, "bshd")
        return out_q.sum(dim=2) * out_k[:, :, 0]

    compiled = torch.compile(step, fullgraph=True)
    q, k = torch.randn(2, 8, 4, 32, device=DEVICE), torch.randn(2, 8, 1, 32, device=DEVICE)
    x = [v.clone().requires_grad_(True) for v in (q, k)]
    y = [v.clone().requires_grad_(True) for v in (q, k)]
    out, ref = compiled(*x), step(*y)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, x, grad), torch.autograd.grad(ref, y, grad)):
        torch.testing.assert_close(a, b)


def test_torch_compile_qk_norm():
    """fullgraph=True through the QK-norm forms of the three entry points: the same outputs
    and gradients (inputs and weights) as eager."""
    torch.manual_seed(46)
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)

    def step(x, qkv, w, wq, wk):
        y = apply_rotary_pos_emb(x, freqs, norm_weight=w, norm_over="token")
        q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16], q_norm_weight=wq,
                                                 k_norm_weight=wk, norm_offset=1.0)
        q2, k2 = apply_rotary_pos_emb_qk(x, qkv[..., 32:48], freqs, q_norm_weight=wq, k_norm_weight=wk)
        return (y.square().sum() + (q * 2).sum() + k.square().sum() + v.sum() + q2.square().sum()
                + (k2 * 3).sum())

    inputs = [torch.randn(8, 2, 3, 16, device=DEVICE), torch.randn(8, 2, 1, 64, device=DEVICE),
              torch.randn(48, device=DEVICE), torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE)]
    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (compiled, step):
        args = [x.clone().requires_grad_(True) for x in inputs]
        loss = fn(*args)
        results.append((loss, *torch.autograd.grad(loss, args)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_torch_compile_qk_one_tensor_twice():
    """fullgraph=True where a call gets one tensor twice: the same tensor as q and k, and one
    weight for both norms (a tied weight), of apply_rotary_pos_emb_qk and of the fused QKV.
    Dynamo traces no autograd.Function given one tensor as two inputs; the calls pass a view
    instead. Outputs and gradients (the shared weight's the sum of both norms') as eager."""
    torch.manual_seed(47)
    module = RotaryPositionEmbedding(16, device=DEVICE)

    def step(x, qkv, w):
        q, k = apply_rotary_pos_emb_qk(x, x, module, q_norm_weight=w, k_norm_weight=w)
        q2, k2 = apply_rotary_pos_emb_qk(x, x, module, tensor_format="bshd")
        q3, k3, v3 = apply_fused_qkv_rotary_pos_emb(qkv, module, module, [32, 16, 16],
                                                    q_norm_weight=w, k_norm_weight=w)
        return ((q * 2).sum() + k.square().sum() + q2.square().sum() + (k2 * 3).sum()
                + q3.square().sum() + (k3 * 5).sum() + v3.sum())

    inputs = [torch.randn(6, 2, 3, 16, device=DEVICE), torch.randn(6, 2, 1, 64, device=DEVICE),
              torch.randn(16, device=DEVICE)]
    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        args = [x.clone().requires_grad_(True) for x in inputs]
        loss = fn(*args)
        results.append((loss, *torch.autograd.grad(loss, args)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_capture_and_replay():
    torch.manual_seed(11)
    freqs = RotaryPositionEmbedding(64, device=DEVICE)(40)
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32, device=DEVICE)
    cases = [dict(tensor_format="sbhd", shape=(33, 2, 4, 64)),
             dict(tensor_format="thd", shape=(32, 4, 64), cu_seqlens=cu),
             dict(tensor_format="bshd", shape=(2, 33, 4, 64),
                  start_positions=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE))]
    for case in cases:
        case = dict(case)
        shape = case.pop("shape")
        x = torch.randn(shape, device=DEVICE, requires_grad=True)
        grad = torch.randn(shape, device=DEVICE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                       # warm-up (compiles) off the graph
            torch.autograd.grad(apply_rotary_pos_emb(x, freqs, **case), x, grad)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = apply_rotary_pos_emb(x, freqs, **case)
            (gx,) = torch.autograd.grad(out, x, grad)
        for _ in range(2):
            with torch.no_grad():
                x.copy_(torch.randn(shape, device=DEVICE))
                grad.copy_(torch.randn(shape, device=DEVICE))
            graph.replay()
            x_eager = x.detach().clone().requires_grad_(True)
            out_eager = apply_rotary_pos_emb(x_eager, freqs, **case)
            assert torch.equal(out, out_eager)
            assert torch.equal(gx, torch.autograd.grad(out_eager, x_eager, grad)[0])


def test_torch_compile_fused_qkv_and_inplace():
    """fullgraph=True (no graph break) through the fused-QKV op, forward and backward, and
    through the in-place op under no_grad; the same values as eager."""
    torch.manual_seed(36)
    q_freqs = RotaryPositionEmbedding(8, device=DEVICE)(6)
    k_freqs = q_freqs * 0.5

    def step(x):
        q, k, v = apply_fused_qkv_rotary_pos_emb(x, q_freqs, k_freqs, [16, 8, 8])
        return (q * 2).sum(dim=-1), k - 1, v * 3

    compiled = torch.compile(step, fullgraph=True)
    qkv = torch.randn(6, 2, 2, 32, device=DEVICE)
    x1, x2 = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    outs, refs = compiled(x1), step(x2)
    grads = [torch.randn_like(o) for o in refs]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(outs, x1, grads)[0], torch.autograd.grad(refs, x2, grads)[0])

    def rotate_in_place(x):
        apply_rotary_pos_emb_inplace(x[..., :8], q_freqs)
        return x * 2

    compiled_inplace = torch.compile(rotate_in_place, fullgraph=True)
    t = torch.randn(6, 2, 3, 12, device=DEVICE)
    expected = torch.cat((apply_rotary_pos_emb(t[..., :8], q_freqs, fused=False), t[..., 8:]), dim=-1)
    with torch.no_grad():
        x = t.clone()
        result = compiled_inplace(x)
    torch.testing.assert_close(x, expected)                    # mutated through the view
    torch.testing.assert_close(result, expected * 2)


def _opcheck_cases():
    """(op, args) for each custom op, with the argument lists `_compiled_or_eager` passes them."""
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(4)[:, :, :, :].float()
    module = RotaryPositionEmbedding(8, device=DEVICE)
    t = torch.randn(4, 2, 2, 10, device=DEVICE)
    table = (freqs, None, False, 1, 1.0)
    angles = (module.inv_freq, None, True, 1, 1.0)
    ops = torch.ops.triton_rotary
    qkv = torch.randn(4, 2, 1, 30, device=DEVICE)
    grads = (torch.randn(4, 2, 1, 10, device=DEVICE),) * 2 + (torch.randn(4, 2, 1, 10, device=DEVICE),)
    return [
        ("rope table", ops.rope.default, (t, *table, "sbhd", None, False, None, 1, 0, None, False, False)),
        ("rope module backward", ops.rope.default,
         (t, *angles, "bshd", None, False, None, 1, 0, int_tensor([[3, 1], [0, 2], [1, 1], [5, 0]]), False, True)),
        ("rope thd inverse", ops.rope.default,
         (t[:, 0], *table, "thd", None, True, int_tensor([0, 1, 4]), 1, 0, None, True, False)),
        ("rope_ table", ops.rope_.default,
         (t.clone(), *table, "sbhd", int_tensor([0, 0]), False, None, 1, 0, None, False, False)),
        ("rope_qk module backward", ops.rope_qk.default,
         (t, t[:, :, :1], *angles, "sbhd", None, False, None, 1, 0, None, False, True)),
        ("rope_ module inverse", ops.rope_.default,
         (t.clone(), *angles, "sbhd", None, False, None, 2, 1, None, True, False)),
        ("qkv_rope table", ops.qkv_rope.default,
         (qkv, freqs, None, freqs * 0.5, None, False, 1, 1.0, 1.0, [10, 10, 10], "sbhd", None, False, 1, 0, None,
          False)),
        ("qkv_rope module inverse", ops.qkv_rope.default,
         (qkv, module.inv_freq, None, module.inv_freq, None, True, 1, 1.0, 0.5, [10, 10, 10], "bshd",
          int_tensor([1, 0, 2, 3]), False, 1, 0, None, True)),
        ("qkv_rope_backward", ops.qkv_rope_backward.default,
         (*grads, freqs, None, freqs * 0.5, None, False, 1, 1.0, 1.0, [10, 10, 10], "sbhd", None, True, 1, 0, None,
          False)),
        ("rope norm", ops.rope.default,
         (t, *table, "sbhd", None, False, None, 1, 0, None, False, False, torch.randn(20, device=DEVICE), 1e-6, 0.0,
          "token")),
        ("rope_ norm", ops.rope_.default,
         (t.clone(), *angles, "sbhd", None, True, None, 1, 0, None, False, False, torch.randn(10, device=DEVICE),
          1e-6, 1.0, "head")),
        ("rope_norm_backward", ops.rope_norm_backward.default,
         (torch.randn_like(t), t, None, *table, "sbhd", None, False, None, 1, 0, None, False, True,
          torch.randn(10, device=DEVICE), 1e-6, 0.5, "head")),
        ("rope_norm_saving_rstd", ops.rope_norm_saving_rstd.default,
         (t, *table, "sbhd", None, False, None, 1, 0, None, False, False, torch.randn(20, device=DEVICE), 1e-6,
          0.0, "token")),
        ("rope_norm_backward saved rstd", ops.rope_norm_backward.default,
         (torch.randn_like(t), t, torch.rand(4, 2, device=DEVICE) + 0.5, *angles, "sbhd", None, False, None, 1, 0,
          None, False, True, torch.randn(20, device=DEVICE), 1e-6, 0.5, "token")),
        ("qkv_rope norm", ops.qkv_rope.default,
         (qkv, freqs, None, freqs * 0.5, None, False, 1, 1.0, 1.0, [10, 10, 10], "sbhd", None, False, 1, 0, None,
          False, torch.randn(10, device=DEVICE), torch.randn(10, device=DEVICE), 1e-6, 0.0)),
        ("rope_qk_norm", ops.rope_qk_norm.default,
         (t, t[:, :, :1], torch.randn(10, device=DEVICE), *angles, "sbhd", None, False, None, 1, 0, None, False,
          False, torch.randn(10, device=DEVICE), 1e-6, 1.0, "head")),
        ("rope_qk_norm_backward", ops.rope_qk_norm_backward.default,
         (torch.randn_like(t), torch.randn(4, 2, 1, 10, device=DEVICE), t, t[:, :, 1:], torch.randn(10, device=DEVICE),
          None, None, *table, "sbhd", None, False, None, 1, 0, None, False, True, torch.randn(10, device=DEVICE),
          1e-6, 0.5, "head")),
        ("rope_qk_norm_saving_rstd", ops.rope_qk_norm_saving_rstd.default,
         (t, t[:, :, :1], torch.randn(10, device=DEVICE), *angles, "sbhd", None, False, None, 1, 0, None, False,
          False, torch.randn(20, device=DEVICE), 1e-6, 0.0, "token")),
        ("rope_qk_norm_backward saved rstd", ops.rope_qk_norm_backward.default,
         (torch.randn_like(t), torch.randn(4, 2, 1, 10, device=DEVICE), t, t[:, :, 1:], torch.randn(10, device=DEVICE),
          torch.rand(4, 2, device=DEVICE) + 0.5, torch.rand(4, 2, device=DEVICE) + 0.5, *table, "sbhd", None, False,
          None, 1, 0, None, False, True, torch.randn(20, device=DEVICE), 1e-6, 0.5, "token")),
        ("qkv_rope_norm_backward", ops.qkv_rope_norm_backward.default,
         (*grads, qkv, freqs, None, freqs * 0.5, None, False, 1, 1.0, 1.0, [10, 10, 10], "sbhd", None, True, 1, 0,
          None, False, torch.randn(10, device=DEVICE), torch.randn(10, device=DEVICE), 1e-6, 1.0)),
    ]


_OPCHECK_NAMES = ("rope table", "rope module backward", "rope thd inverse", "rope_ table", "rope_qk module backward",
                  "rope_ module inverse", "qkv_rope table", "qkv_rope module inverse", "qkv_rope_backward",
                  "rope norm", "rope_ norm", "rope_norm_backward", "rope_norm_saving_rstd",
                  "rope_norm_backward saved rstd", "rope_qk_norm", "rope_qk_norm_backward",
                  "rope_qk_norm_saving_rstd", "rope_qk_norm_backward saved rstd", "qkv_rope norm",
                  "qkv_rope_norm_backward")


@pytest.mark.parametrize("name", _OPCHECK_NAMES)
def test_opcheck_custom_ops(name):
    """torch.library.opcheck: schema (mutation declared for rope_ only), fake kernels that
    agree with the real ones in shape, strides and dtype, and AOT dispatch."""
    cases = {case_name: (op, args) for case_name, op, args in _opcheck_cases()}
    assert set(cases) == set(_OPCHECK_NAMES)
    op, args = cases[name]
    torch.library.opcheck(op, args)


def _cp_split(x, cu_seqlens, cp_size, rank, dim=0):
    """Rank `rank`'s tokens under TE's load-balanced split: each sequence (the whole dim for
    sbhd, each cu_seqlens span for thd) is cut into 2*cp_size chunks and the rank keeps chunks
    rank and 2*cp_size-1-rank."""
    spans = list(zip(cu_seqlens[:-1], cu_seqlens[1:])) if cu_seqlens else [(0, x.shape[dim])]
    pieces = []
    for start, end in spans:
        chunks = x.narrow(dim, start, end - start).chunk(2 * cp_size, dim=dim)
        pieces += [chunks[rank], chunks[2 * cp_size - 1 - rank]]
    return torch.cat(pieces, dim=dim)


def _cp_worker(rank, world_size, init_file, tensor_format, results):
    """One context-parallel rank: RoPE on its own tokens, then all_gather to rank 0."""
    import torch.distributed as dist
    use_nccl = ON_GPU
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)                       # every rank builds the same global tensors
        cu = [0, 8 * world_size, 12 * world_size, 28 * world_size] if tensor_format == "thd" else None
        shape = (cu[-1], 3, 32) if cu else (16 * world_size, 2, 3, 32)
        full = torch.randn(shape, device=device)
        grad = torch.randn(shape, device=device)
        freqs = RotaryPositionEmbedding(32, device=device)(shape[0])
        kwargs = dict(tensor_format=tensor_format, cp_size=world_size, cp_rank=rank)
        if cu:
            kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
        local = _cp_split(full, cu, world_size, rank).requires_grad_(True)
        out = apply_rotary_pos_emb(local, freqs, **kwargs)
        (dx,) = torch.autograd.grad(out, local, _cp_split(grad, cu, world_size, rank))
        gathered = [[torch.empty_like(out) for _ in range(world_size)] for _ in range(2)]
        dist.all_gather(gathered[0], out.detach().contiguous())
        dist.all_gather(gathered[1], dx.contiguous())
        if rank == 0:
            # Undo the split: put every rank's chunks back where they came from.
            index = _cp_split(torch.arange(shape[0], device=device), cu, 1, 0)
            order = torch.cat([_cp_split(index, cu, world_size, r) for r in range(world_size)])
            whole_out, whole_dx = torch.empty_like(full), torch.empty_like(full)
            whole_out[order] = torch.cat(gathered[0])
            whole_dx[order] = torch.cat(gathered[1])
            x = full.clone().requires_grad_(True)
            single_kwargs = dict(tensor_format=tensor_format, cu_seqlens=kwargs.get("cu_seqlens"))
            ref = apply_rotary_pos_emb(x, freqs, **single_kwargs)
            (ref_dx,) = torch.autograd.grad(ref, x, grad)
            torch.testing.assert_close(whole_out, ref.detach())
            torch.testing.assert_close(whole_dx, ref_dx)
            results.put("ok")
    except Exception as err:   # report, then let the other ranks finish
        results.put(f"rank {rank}: {err!r}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_across_processes(world_size, tensor_format, tmp_path):
    """Split a sequence the load-balanced way over real ranks (gloo on CPU through the
    interpreter, NCCL on GPUs), rotate each piece with its own cp_rank, gather, undo the split:
    the same as one process rotating the whole sequence, forward and backward."""
    import torch.multiprocessing as mp
    if ON_GPU and torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL run needs {world_size} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_cp_worker, args=(world_size, str(tmp_path / "rendezvous"), tensor_format, results),
                       nprocs=world_size, join=True, start_method="spawn")
    assert results.get() == "ok"


def test_torch_compile_fullgraph_module_and_positions():
    """A compiled step with a module and positions (a one-axis yarn module and an M-RoPE one):
    no graph break, the same values forward and backward as eager."""
    torch.manual_seed(44)
    emb = RotaryPositionEmbedding(32, device=DEVICE, rope_scaling=YARN)
    mrope = mrope_module(True)
    b, s = 2, 6

    def step(x, pos, axis_pos):
        return (apply_rotary_pos_emb(x, emb, "bshd", positions=pos) * 2
                + apply_rotary_pos_emb(x, mrope, "bshd", positions=axis_pos)).sum(dim=-1)

    compiled = torch.compile(step, fullgraph=True)
    t = torch.randn(b, s, 3, 40, device=DEVICE)
    pos = torch.randint(0, 2**24, (b, s), device=DEVICE)
    axis_pos = torch.randint(0, 4096, (3, b, s), device=DEVICE)
    x1, x2 = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
    out, ref = compiled(x1, pos, axis_pos), step(x2, pos, axis_pos)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x1, grad)[0], torch.autograd.grad(ref, x2, grad)[0])


def test_torch_compile_traces_a_modules_scale():
    """A module's attention_scaling is a float torch.compile may trace as a symbol (under
    dynamic=True, or once one compiled function has seen modules of two scales): no graph
    break, eager's values and gradients, and a scale that is not finite still refused, by the
    op when the graph runs."""
    torch.manual_seed(45)
    t = torch.randn(6, 2, 3, 16, device=DEVICE)
    modules = [RotaryPositionEmbedding(16, device=DEVICE)] + [
        RotaryPositionEmbedding(16, device=DEVICE, rope_scaling={**YARN, "factor": factor}) for factor in (4.0, 8.0)]
    assert len({m.attention_scaling for m in modules}) == 3

    def step(x, rope):
        return apply_rotary_pos_emb(x, rope) * 2

    for dynamic in (None, True):
        compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
        for rope in modules:
            x1, x2 = t.clone().requires_grad_(True), t.clone().requires_grad_(True)
            out, ref = compiled(x1, rope), step(x2, rope)
            torch.testing.assert_close(out, ref)
            grad = torch.randn_like(out)
            torch.testing.assert_close(torch.autograd.grad(out, x1, grad)[0], torch.autograd.grad(ref, x2, grad)[0])
    modules[0].attention_scaling = float("nan")
    with pytest.raises(ValueError, match="scale must be a finite number, got nan"):
        compiled(t, modules[0])


# =================================================================================================
# == 8. Launcher internals
#    The thd search, launch rule and grid, the plan cache, the compiled kernels' launcher, the
#    generated code.
# =================================================================================================


@triton.jit
def _tile_sequences_probe(cu_seqlens, SEQ, SEQ_START, SEQ_END, num_tokens, num_seqs, cp_size,
                          cfg: tl.constexpr):
    """The thd sequence search of rotary_kernel for tiles of cfg.BLOCK_T tokens (its tokens as
    the kernel picks them), its results stored per token."""
    tokens = Tokens(num_tokens, num_tokens, num_seqs, cp_size, 0)
    tok, ok, _, _ = _program_tokens(tl.program_id(0), tokens, cfg)
    seq, seq_start, seq_end = _tile_sequences(cu_seqlens, tl.program_id(0) * cfg.BLOCK_T,
                                              (tok.to(tl.int64) + 1) * cp_size, num_seqs,
                                              num_tokens, cp_size, cfg.SEARCH_LEVELS,
                                              cfg.SEARCH_GUESS, cfg.SEARCH_ONE_SEQUENCE,
                                              cfg.SEARCH_WINDOW_FIRST)
    tl.store(SEQ + tok, seq, mask=ok)
    tl.store(SEQ_START + tok, seq_start, mask=ok)
    tl.store(SEQ_END + tok, seq_end, mask=ok)


@triton.jit
def _guessed_sequences_probe(cu_seqlens, FOUND, SEQ, SEQ_START, SEQ_END, num_tokens, num_seqs,
                             cp_size, cfg: tl.constexpr):
    """`_guessed_sequences` alone for tiles of cfg.BLOCK_T tokens: whether it found the
    tile's sequences (per tile) and what it gives (per token)."""
    tokens = Tokens(num_tokens, num_tokens, num_seqs, cp_size, 0)
    tok, ok, _, _ = _program_tokens(tl.program_id(0), tokens, cfg)
    found, seq, seq_start, seq_end = _guessed_sequences(
        cu_seqlens, tl.program_id(0) * cfg.BLOCK_T, (tok.to(tl.int64) + 1) * cp_size, num_seqs,
        num_tokens)
    tl.store(FOUND + tl.program_id(0), found)
    tl.store(SEQ + tok, seq, mask=ok)
    tl.store(SEQ_START + tok, seq_start, mask=ok)
    tl.store(SEQ_END + tok, seq_end, mask=ok)


@triton.jit
def _checked_sequence_guess_probe(cu_seqlens, HIT, GUESS, num_tokens, num_seqs, cp_size,
                                  BLOCK_T: tl.constexpr):
    """`_checked_sequence_guess` alone for tiles of BLOCK_T tokens: per tile, whether the
    check held and the guess."""
    first_tok = tl.program_id(0) * BLOCK_T
    hit, g, _, _ = _checked_sequence_guess(cu_seqlens, first_tok, (first_tok + 1).to(tl.int64) * cp_size,
                                           num_seqs, num_tokens)
    tl.store(HIT + tl.program_id(0), hit)
    tl.store(GUESS + tl.program_id(0), g)


@triton.jit
def _tile_in_one_sequence_probe(cu_seqlens, INSIDE, num_tokens, num_seqs, cp_size,
                                BLOCK_T: tl.constexpr, WINDOW_FIRST: tl.constexpr = False):
    """`_tile_in_one_sequence` alone for tiles of BLOCK_T tokens, after the checked guess (or
    with WINDOW_FIRST the guessed window) as `_tile_sequences` makes it: per tile, whether the
    tile lies inside one sequence."""
    first_tok = tl.program_id(0) * BLOCK_T
    first_next = (first_tok + 1).to(tl.int64) * cp_size
    if WINDOW_FIRST:
        hit, _, _, g_end = _window_first_sequence(
            _guess_window(cu_seqlens, first_tok, num_seqs, num_tokens), first_next, num_seqs)
    else:
        hit, _, _, g_end = _checked_sequence_guess(cu_seqlens, first_tok, first_next, num_seqs,
                                                   num_tokens)
    tl.store(INSIDE + tl.program_id(0),
             _tile_in_one_sequence(hit, g_end, first_tok, num_tokens, cp_size, BLOCK_T))


def _lengths_cu(lengths, start=0):
    return list(itertools.accumulate(lengths, initial=start))


# (cu_seqlens, tokens past its end, cp_size, tokens per tile): a tile crossing few sequence ends
# (read from one vector of cu_seqlens after the first token's search) or many (every token
# searched on its own).
_TILE_SEARCH_CASES = {
    "long sequences": (_lengths_cu([64] * 16), 0, 1, 8),
    "one-token tiles": (_lengths_cu([3, 1, 5, 2] * 4), 0, 1, 1),
    "short and empty sequences": (_lengths_cu([0, 1, 0, 2, 1, 0, 0, 3] * 40), 0, 1, 16),
    "tokens before and after": (_lengths_cu([7, 0, 9, 30, 1, 1, 1, 12], start=5), 11, 1, 8),
    "context parallel": (_lengths_cu([8, 4, 12, 0, 16, 4] * 3), 0, 2, 4),
    "5000 sequences": (_lengths_cu([1, 2, 0, 3, 1] * 1000), 0, 1, 8),
    # one long sequence among short ones: where lengths would put a tile is far from where it
    # is, for most tiles
    "skewed lengths": (_lengths_cu([1] * 100 + [1000] + [1] * 100), 0, 1, 8),
    # one length, but a tile spans more sequences than the window holds past the guess
    "one-token sequences, 64-token tiles": (_lengths_cu([1] * 200), 0, 1, 64),
    "one length, context parallel": (_lengths_cu([16] * 12), 0, 2, 4),
}
# Cases whose every tile's sequences lie in `_guessed_sequences`' window (fewer sequences
# than the window, or lengths close enough to even and tiles spanning few of them), and cases
# where some do not.
_GUESS_FINDS_ALL = {"long sequences", "one-token tiles", "short and empty sequences",
                    "tokens before and after", "context parallel", "5000 sequences",
                    "one length, context parallel"}
_GUESS_MISSES_SOME = {"skewed lengths", "one-token sequences, 64-token tiles"}


def _sequence_search_case(case, index_dtype):
    """(cu_seqlens, num_seqs, num_tokens, cp_size, block_t, three int result tensors filled
    with -1, each token's expected sequence) of a _TILE_SEARCH_CASES case."""
    cu, past_end, cp_size, block_t = _TILE_SEARCH_CASES[case]
    num_tokens = cu[-1] // cp_size + past_end
    results = [torch.full((num_tokens,), -1, dtype=index_dtype, device=DEVICE) for _ in range(3)]
    local_cu = torch.tensor(cu, dtype=torch.int64) // cp_size
    expected = (torch.searchsorted(local_cu, torch.arange(num_tokens), right=True) - 1).clamp(min=0)
    return (torch.tensor(cu, dtype=index_dtype, device=DEVICE), len(cu) - 1, num_tokens, cp_size,
            block_t, results, expected)


def _check_sequences(cu_seqlens, num_seqs, seq, seq_start, seq_end, expected, tokens=None):
    """The tokens' (all, or those at index `tokens`) sequences, starts and ends are those of
    searchsorted (`expected`)."""
    cu = cu_seqlens.cpu().long()
    seq, seq_start, seq_end = (x.cpu().long() for x in (seq, seq_start, seq_end))
    if tokens is not None:
        seq, seq_start, seq_end, expected = seq[tokens], seq_start[tokens], seq_end[tokens], expected[tokens]
    assert seq.tolist() == expected.tolist()
    assert seq_start.tolist() == cu[expected].tolist()
    assert seq_end.tolist() == cu[(expected + 1).clamp(max=num_seqs)].tolist()


@pytest.mark.parametrize("guess,one_sequence,window_first", [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False),
    (True, True, True)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", list(_TILE_SEARCH_CASES))
def test_tile_sequence_search_matches_searchsorted(case, index_dtype, guess, one_sequence,
                                                   window_first):
    """Each token's sequence (the last i with cu[i] // cp_size <= token, 0 if none) and its
    bounds, whether the tile's tokens come from the vector after the first token's sequence
    or (many sequence ends in one tile) from a search of their own, with SEARCH_GUESS from
    the guessed window where it holds them, and with SEARCH_ONE_SEQUENCE from the first
    token's sequence where the tile lies inside it (found by the checked guess, or with
    SEARCH_WINDOW_FIRST in the guessed window)."""
    cu_seqlens, num_seqs, num_tokens, cp_size, block_t, (seq, seq_start, seq_end), expected = (
        _sequence_search_case(case, index_dtype))
    cfg = Variant(BLOCK_T=block_t, BLOCK_H=1, BLOCK_HALF=1, BLOCK_PASS=0, INTERLEAVED=False,
                  BACKWARD=False, SEQ_MAJOR=True, HAS_START=False, WIDE_INNER=False,
                  ANGLES_FROM_POSITIONS=False, POSITIONS_FROM=0, FLAT_GRID=False, IS_THD=True,
                  SEARCH_LEVELS=triton_rotary_launch._search_levels(num_seqs), SEARCH_GUESS=guess,
                  SEARCH_ONE_SEQUENCE=one_sequence, SEARCH_WINDOW_FIRST=window_first)
    _tile_sequences_probe[(triton.cdiv(num_tokens, block_t),)](
        cu_seqlens, seq, seq_start, seq_end, num_tokens, num_seqs, cp_size, cfg)
    _check_sequences(cu_seqlens, num_seqs, seq, seq_start, seq_end, expected)


@pytest.mark.parametrize("case", sorted(_GUESS_FINDS_ALL | _GUESS_MISSES_SOME))
def test_guessed_sequences_are_right_where_found(case):
    """The guessed window (`_guessed_sequences`) says it found a tile's sequences at every
    tile where lengths are even and tiles span few of them, or sequences are fewer than the
    window; not at some tiles of skewed lengths or of tiles spanning more sequences than it
    holds; wherever it says found, every token's sequence and bounds are searchsorted's."""
    cu_seqlens, num_seqs, num_tokens, cp_size, block_t, (seq, seq_start, seq_end), expected = (
        _sequence_search_case(case, torch.int32))
    tiles = triton.cdiv(num_tokens, block_t)
    found = torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE)
    cfg = Variant(BLOCK_T=block_t, BLOCK_H=1, BLOCK_HALF=1, BLOCK_PASS=0, INTERLEAVED=False,
                  BACKWARD=False, SEQ_MAJOR=True, HAS_START=False, WIDE_INNER=False,
                  ANGLES_FROM_POSITIONS=False, POSITIONS_FROM=0, FLAT_GRID=False, IS_THD=True)
    _guessed_sequences_probe[(tiles,)](cu_seqlens, found, seq, seq_start, seq_end, num_tokens,
                                       num_seqs, cp_size, cfg)
    found = found.cpu()
    assert set(found.tolist()) <= {0, 1}
    if case in _GUESS_FINDS_ALL:
        assert found.all()
    else:
        assert not found.all()
    tokens = found.repeat_interleave(block_t)[:num_tokens].bool()
    _check_sequences(cu_seqlens, num_seqs, seq, seq_start, seq_end, expected, tokens)


@pytest.mark.parametrize("case,every_tile_hits", [
    ("long sequences", True), ("one-token sequences, 64-token tiles", True),
    ("one length, context parallel", True), ("skewed lengths", False),
    ("tokens before and after", False), ("short and empty sequences", False)])
def test_checked_sequence_guess(case, every_tile_hits):
    """`_searched_sequences` takes the first token's sequence from `_checked_sequence_guess`
    where its check holds: at every tile where sequences are of one length (with context
    parallelism too), at some tiles otherwise; and wherever the check holds the guess is
    searchsorted's sequence of the tile's first token, so a hit never needs the search."""
    cu_seqlens, num_seqs, num_tokens, cp_size, block_t, _, expected = _sequence_search_case(
        case, torch.int32)
    tiles = triton.cdiv(num_tokens, block_t)
    hit, guess = (torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _checked_sequence_guess_probe[(tiles,)](cu_seqlens, hit, guess, num_tokens, num_seqs, cp_size,
                                            block_t)
    hit, guess = hit.cpu(), guess.cpu().long()
    assert set(hit.tolist()) <= {0, 1}
    assert bool(hit.all()) == every_tile_hits and hit.any(), hit
    first = expected[::block_t]                    # each tile's first token's sequence
    assert guess[hit.bool()].tolist() == first[hit.bool()].tolist()


@pytest.mark.parametrize("case,inside_tiles,inside_by_window", [
    ("long sequences", "all", "all"), ("one length, context parallel", "all", "all"),
    ("one-token tiles", "some", "all"), ("tokens before and after", "some", "some"),
    ("short and empty sequences", "none", "none"),
    ("one-token sequences, 64-token tiles", "none", "none")])
def test_tiles_inside_one_sequence_take_it_without_a_search(case, inside_tiles, inside_by_window):
    """`_tile_sequences` takes a tile's sequence for all its tokens, searching none, where
    `_tile_in_one_sequence` says the tile lies inside it: at every tile where sequences are of
    one length, longer than tiles and aligned with them (with context parallelism too); at
    some tiles where lengths differ (the checked guess of the first token's sequence misses
    some tiles, one-token tiles too) or tokens lie before and after the sequences; at none
    where every tile spans several sequences (or an empty one); and wherever it says so,
    every real token of the tile is in that sequence by searchsorted (a tail tile's
    included). With the first token's sequence from the guessed window (WINDOW_FIRST) at
    least at the tiles the checked guess finds, and at every one-token tile."""
    cu_seqlens, num_seqs, num_tokens, cp_size, block_t, _, expected = _sequence_search_case(
        case, torch.int32)
    tiles = triton.cdiv(num_tokens, block_t)
    local_cu = torch.tensor(_TILE_SEARCH_CASES[case][0]) // cp_size
    found = []
    for window_first, expect in ((False, inside_tiles), (True, inside_by_window)):
        inside = torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE)
        _tile_in_one_sequence_probe[(tiles,)](cu_seqlens, inside, num_tokens, num_seqs, cp_size,
                                              block_t, window_first)
        inside = inside.cpu()
        assert set(inside.tolist()) <= {0, 1}
        assert {"all": bool(inside.all()), "some": bool(inside.any()) and not inside.all(),
                "none": not inside.any()}[expect], (window_first, inside)
        for tile in inside.nonzero().flatten().tolist():
            tile_seqs = expected[tile * block_t:(tile + 1) * block_t]
            first = int(tile_seqs[0])
            assert (tile_seqs == first).all(), (window_first, tile, tile_seqs)
            tokens = torch.arange(tile * block_t, min((tile + 1) * block_t, num_tokens))
            assert ((local_cu[first] <= tokens) & (tokens < local_cu[first + 1])).all(), tile
        found.append(inside.bool())
    assert (found[1] | ~found[0]).all(), found


@pytest.mark.parametrize("tile,min_programs", [(16, 0), (192, 0), (512, 0), (2048, 0), (512, 1000)])
def test_other_launch_configs(tile, min_programs):
    """Tiles from one channel row up to several tokens (within or across batch entries and
    thd sequences), tails of the token grid, and tiles shrunk to give a big GPU enough
    programs: all give the same result."""
    rule = triton_rotary_launch.launch_rule()._replace(
        tile_bytes=tile, one_head_tile_bytes=tile, search_tile_bytes=tile, qkv_tile_bytes=tile,
        min_programs_per_sm=min_programs)
    with triton_rotary_launch.use_launch_rule(rule):
        _check_launch_configs()


def _check_launch_configs():
    torch.manual_seed(9)
    for interleaved in (False, True):
        freqs = RotaryPositionEmbedding(16, interleaved=interleaved, device=DEVICE)(7)
        for batch in (3, 4):
            t = torch.randn(7, batch, 5, 24, device=DEVICE)
            compare(apply_rotary_pos_emb, t, non_overlapping_grad, "unfused", freqs=freqs,
                     interleaved=interleaved)
        cu = torch.tensor([0, 2, 9, 13], dtype=torch.int32, device=DEVICE)
        t = torch.randn(15, 5, 24, device=DEVICE)
        compare(apply_rotary_pos_emb, t, non_overlapping_grad, "unfused", freqs=freqs, interleaved=interleaved,
                 tensor_format="thd", cu_seqlens=cu)
    # Fused QKV: multi-head (key programs' kv heads cut down to a query tile's size) and
    # grouped-query with a narrow v.
    for kv_heads, split in ((5, [16, 16, 40]), (3, [48, 16, 8])):
        qkv = torch.randn(7, 3, kv_heads, sum(split), device=DEVICE)
        compare_qkv(qkv, freqs, freqs * 0.5, split)


def test_program_grid_orders_head_programs_next_to_each_other():
    """One program per token block: the 2-D grid, no division in the kernel; several: one axis,
    the head programs of a token block adjacent; more programs than a launch takes: ValueError."""
    assert triton_rotary_launch._program_grid(7, 1) == ((7, 1), False)
    assert triton_rotary_launch._program_grid(7, 3) == ((21, 1), True)
    with pytest.raises(ValueError, match="^t needs 2147483648 programs; a launch takes at most"):
        triton_rotary_launch._program_grid(2**30, 2)
    with pytest.raises(ValueError, match="^qkv needs"):
        triton_rotary_launch._program_grid(2**30, 2, "qkv")


def test_repeated_calls_and_misaligned_views():
    """Calls with the same metadata reuse one launch plan (on a GPU: the compiled kernel called
    directly), and a view whose data starts off 16-byte alignment gets a kernel of its own:
    every call matches the unfused formula, forward and backward, QKV included."""
    torch.manual_seed(21)
    shape, split = (8, 2, 3, 16), [32, 16, 16]
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(8)
    storage = torch.empty(8 * 2 * 3 * 64 + 1, device=DEVICE)
    for offset in (0, 1, 0, 1, 1, 0):
        storage.normal_()
        t = storage[offset:offset + 8 * 2 * 3 * 16].view(shape)
        compare(apply_rotary_pos_emb, t, non_overlapping_grad, "unfused", freqs=freqs)
        qkv = storage[offset:offset + 8 * 2 * 3 * 64].view(8, 2, 3, 64)
        compare_qkv(qkv, freqs, freqs, split)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter launches through Triton's JIT only")
def test_launches_after_the_first_use_the_compiled_kernels_launcher():
    """After a plan's first launch, later calls go to the compiled kernel's C launcher directly
    (the fast path), and their results equal the first call's; while a launch hook is
    registered (as profilers do) they go through Triton's runner, which calls it."""
    from triton import knobs
    torch.manual_seed(23)
    t = torch.randn(9, 2, 3, 32, device=DEVICE)
    freqs = RotaryPositionEmbedding(32, device=DEVICE)(9)
    first = set_rotary_kernel(t, freqs)
    runners = [r for p in triton_rotary_launch._PLANS.values() if p.launch is not None
               and p.launch.kernel is triton_rotary_kernel.rotary_kernel for r in p.launch.runners.values()]
    assert runners, "no plan holds a launcher: every launch went through Triton's JIT"
    assert all(r.direct for r in runners), "the direct launch did not engage"
    assert torch.equal(set_rotary_kernel(t, freqs), first)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(set_rotary_kernel(t, freqs), first)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["rotary_kernel"], seen
    assert torch.equal(set_rotary_kernel(t, freqs), first)
    assert len(seen) == 1


def _run_probe(*args):
    """rope_sass_probe.py's JSON lines for `args`, from a process without TRITON_INTERPRET (the
    probe compiles the kernels for sm_90; no GPU needed)."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(here, "rope_sass_probe.py"), *args],
                         capture_output=True, text=True, cwd=here, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def _compile_tiles(*tiles):
    """rope_sass_probe.py's result for each tile (dicts of constexprs)."""
    return _run_probe(*map(json.dumps, tiles))


def test_sin_cos_are_computed_once_per_program():
    """The angles of a tile of several heads are worked out once across the program's threads
    (`_tile_angles`' one-trip loops keep Triton from recomputing them in the tile's layout):
    for 1 token x 16 heads x 64 pairs at 4 warps (128 threads, 64 angles), at most one sin per
    thread. A one-head tile of 16 tokens x 64 pairs has 1024 angles, 8 per thread, and the
    count says so (what the count measures)."""
    heads_tile, tokens_tile = _compile_tiles(dict(BLOCK_T=1, BLOCK_H=16), dict(BLOCK_T=16, BLOCK_H=1))
    assert tokens_tile["sin"] == 8, tokens_tile
    assert heads_tile["sin"] == 1, heads_tile


def test_batch_of_one_saves_instructions():
    """A tile of a batch of one (`BATCH_OF_ONE`) finds a token's sequence without dividing by
    the runtime batch: no reciprocal (MUFU.RCP, which an integer division by a runtime value
    takes) and fewer instructions than the same tile of any batch. A one-head tile of 32
    tokens x 32 interleaved pairs (MLA's key), angles from positions; the launcher's choice of
    the flag is tested with the plans."""
    tile = dict(BLOCK_T=32, BLOCK_H=1, BLOCK_HALF=32, INTERLEAVED=True)
    any_batch, one = _compile_tiles(tile, dict(tile, BATCH_OF_ONE=True))
    assert any_batch["rcp"] >= 1 and one["rcp"] == 0, (any_batch, one)
    assert one["instructions"] < any_batch["instructions"], (one, any_batch)


def test_tiles_without_context_parallelism_fold_cp_size_away():
    """Without context parallelism (CONTEXT_PARALLEL off, cp_size 1) a tile has none of its
    arithmetic, which it would otherwise run whatever cp_size is (ptxas selects between the
    rank's position split and the plain position rather than branch): a thd search tile (4
    tokens x 8 heads, 2048 sequences) without the division of its sequences' ends by cp_size
    (one reciprocal fewer), both tiles with fewer instructions (Triton 3.6: thd 940 -> 814, the sbhd
    tile of 2 tokens x 8 heads of a batch of one 220 -> 183)."""
    thd = dict(BLOCK_T=4, BLOCK_H=8, SEQ_MAJOR=False, IS_THD=True, SEARCH_LEVELS=6)
    sbhd = dict(BLOCK_T=2, BLOCK_H=8, BATCH_OF_ONE=True)
    thd_cp, thd_one, sbhd_cp, sbhd_one = _compile_tiles(
        dict(thd, CONTEXT_PARALLEL=True), thd, dict(sbhd, CONTEXT_PARALLEL=True), sbhd)
    assert thd_one["rcp"] < thd_cp["rcp"], (thd_one, thd_cp)
    assert thd_one["instructions"] < thd_cp["instructions"], (thd_one, thd_cp)
    assert sbhd_one["instructions"] < sbhd_cp["instructions"], (sbhd_one, sbhd_cp)


def test_one_head_table_tile_issues_its_table_loads_together():
    """In a one-head tile of TE's table the check that both members of each pair share their
    angles comes before any sin/cos (`_rotation_from_table`), so that ptxas issues the table's
    loads together instead of one per sin/cos: a tile of 32 tokens x 32 interleaved pairs
    (MLA's key at 4 KiB tiles; a batch of one, bf16, 4 warps) loads 8 KiB of angles, four
    16-byte loads per thread, and 4 KiB of the tensor, two, forward and backward: the first
    four of its six loads lie within 48 instructions (12-17 in Triton 3.5.1-3.7.1, 31-39 in
    3.9). With the sin/cos of the first members before the check they lay 183-222 apart (in
    3.6 all six at 110-395, with the check first at 153-216). The launch rule plans this tile
    for no call (MLA's key takes 16 tokens, ONE_HEAD_TILE_BYTES, whose two table loads a
    thread come together in either order under Triton 3.5.1 and 3.6); a rule of larger
    one-head tiles does, and this tile is where the order shows."""
    tile = dict(BLOCK_T=32, BLOCK_H=1, BLOCK_HALF=32, INTERLEAVED=True, ANGLES_FROM_POSITIONS=False,
                BATCH_OF_ONE=True)
    for result in _compile_tiles(tile, dict(tile, BACKWARD=True)):
        assert result["loads"] == ["LDG.E.128"] * 6, result["loads"]
        first_four = result["load_at"][:4]
        assert first_four[-1] - first_four[0] <= 48, result["load_at"]


def test_table_tiles_take_the_hardware_sin_cos_in_16_bits_only():
    """With TE's table, tiles of 16-bit data take sin/cos of the table's angles from the
    hardware after the positions path's reduction (sin.approx in the PTX); float32 tiles keep
    the polynomials (`_rotation_from_table`), which have none. A one-head tile of 8 tokens
    (TP 8's key, a batch of one), forward and backward, and a tile of 16 heads of one token."""
    one_head = dict(BLOCK_T=8, BLOCK_H=1, BLOCK_HALF=64, ANGLES_FROM_POSITIONS=False,
                    BATCH_OF_ONE=True)
    many_heads = dict(BLOCK_T=1, BLOCK_H=16, BLOCK_HALF=64, ANGLES_FROM_POSITIONS=False,
                      FLAT_GRID=True, BATCH_OF_ONE=True)
    tiles = [one_head, dict(one_head, BACKWARD=True), many_heads]
    for dtype in ("bf16", "fp16", "fp32"):
        results = _compile_tiles(*[dict(tile, dtype=dtype) for tile in tiles])
        for tile, result in zip(tiles, results):
            assert (result["sin"] > 0) is (dtype != "fp32"), (dtype, tile, result)


def test_position_tiles_issue_their_loads_before_the_sin_cos(monkeypatch, tmp_path):
    """sbhd tiles with positions from the token's index issue all their loads before the first
    sin/cos (MUFU.SIN/COS), which waits for the frequencies' load: the barrier after the tile's
    loads in `_tile_rotation` keeps ptxas from issuing the frequencies' load first and the tile's
    last loads only after the sin/cos of the first. The launches the GPU rule plans on an H200
    (132 SMs) for MLA's key (a batch of one, 131072 tokens x 1 head x 32 interleaved pairs,
    bf16, forward) and quarter rotary's backward (8192 tokens x 32 heads, 16 of d 128's 64
    pairs); without the barrier (Triton 3.6 and 3.9) two of quarter rotary's five loads come
    after the first sin/cos, so that case guards the barrier. MLA's key's 2 KiB tile
    (ONE_HEAD_TILE_BYTES) keeps its two loads ahead either way (Triton 3.6); in a 4 KiB tile
    one of its three loads comes after without the barrier. With TE's table, MLA's key is the
    table tile that takes the barrier: its tensor's load and the table row's two issue within
    16 instructions."""
    L = triton_rotary_launch
    records = []
    monkeypatch.setattr(L._Launch, "__call__",
                        lambda launch, *args: records.append(_launch_record(launch, args)))
    monkeypatch.setattr(L, "_sm_count", lambda device: 132)
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    with L.use_launch_rule(L.GPU_RULE):
        set_rotary_kernel(torch.randn(131072, 1, 1, 64, **bf16),
                          RotaryPositionEmbedding(64, interleaved=True, device=DEVICE),
                          interleaved=True)
        set_rotary_kernel(torch.randn(8192, 1, 32, 128, **bf16),
                          RotaryPositionEmbedding(128, 0.25, device=DEVICE), backward=True)
        mla_table = RotaryPositionEmbedding(64, interleaved=True, device=DEVICE)(131072)
        set_rotary_kernel(torch.randn(131072, 1, 1, 64, **bf16), mla_table, interleaved=True)
    assert [r["kernel"] for r in records] == ["rotary_kernel"] * 3, records
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(records))
    # Each tile's count of global loads, its tensor's and the frequencies' or the table's
    # (Triton 3.5.1-3.9), so that a tile whose loads the probe missed fails instead of passing.
    key, quarter, key_table = _run_probe("--launch-stats", str(path))
    for name, loads, result in (("MLA's key", 2, key), ("quarter rotary, backward", 5, quarter)):
        assert len(result["load_at"]) == loads and result["sincos_at"], (name, result)
        assert max(result["load_at"]) < min(result["sincos_at"]), (name, result)
    assert len(key_table["load_at"]) == 3, key_table
    assert max(key_table["load_at"]) - min(key_table["load_at"]) <= 16, key_table


def test_thd_tiles_load_the_frequencies_before_the_search():
    """Tiles of several heads of a packed batch with angles from positions load the pairs'
    inverse frequencies before the search of cu_seqlens (`_tile_angles`), not after its chain
    of dependent loads: the tiles of the packed models points (1 token x 16 heads, mixed and
    lognormal lengths, forward and backward; 2 tokens x 8 heads, 2048 sequences of 64). The
    frequencies' load is the tile's only 32-bit load without evict_last; fewer than half of the
    search's loads (LDG.E.EL, cu_seqlens' entries) come before it (none of 17-27 in Triton
    3.5.1-3.9). Loaded inside the angles' one-trip loop, after the search's, all of them did."""
    thd = dict(SEQ_MAJOR=False, IS_THD=True)
    tiles = [dict(thd, BLOCK_T=1, BLOCK_H=16, FLAT_GRID=True, SEARCH_LEVELS=3, SEARCH_GUESS=True),
             dict(thd, BLOCK_T=1, BLOCK_H=16, SEARCH_LEVELS=4, SEARCH_GUESS=True, BACKWARD=True),
             dict(thd, BLOCK_T=2, BLOCK_H=8, SEARCH_LEVELS=6, SEARCH_GUESS=True)]
    for result in _compile_tiles(*tiles):
        loads = list(zip(result["loads"], result["load_at"]))
        (freqs_at,) = [at for op, at in loads if op == "LDG.E"]
        search_at = [at for op, at in loads if op == "LDG.E.EL"]
        assert len(search_at) >= 12, loads
        assert sum(at < freqs_at for at in search_at) < len(search_at) / 2, loads


def test_one_head_thd_tiles_load_the_frequencies_before_the_search():
    """One-head search tiles of a packed batch with angles from positions: 32 tokens of d 128
    and MLA's key (64 tokens of 32 interleaved pairs) with the guessed window, checked for one
    sequence first (as the GPU's rule plans them in bf16: SEARCH_GUESS_ONE_HEAD_TOKEN,
    SEARCH_WINDOW_FIRST) or not, and MLA's key without the window (the checked guess first),
    forward and backward, issue all their 128-bit loads, the tile's and the inverse
    frequencies', before the search of cu_seqlens (loads evict_last): with the window before
    any of its loads, without it after at most the two of the first token's checked guess.
    Loaded with the angles, after the search's code, the frequencies' loads came after every
    load of cu_seqlens (Triton 3.9)."""
    one_head = dict(BLOCK_T=32, BLOCK_H=1, BLOCK_HALF=64, SEQ_MAJOR=False, IS_THD=True,
                    SEARCH_LEVELS=6, SEARCH_GUESS=True)
    window_first = dict(SEARCH_ONE_SEQUENCE=True, SEARCH_WINDOW_FIRST=True)
    mla = dict(one_head, BLOCK_T=64, BLOCK_HALF=32, INTERLEAVED=True)
    tiles = [dict(one_head, **window_first), dict(one_head, BACKWARD=True, **window_first),
             one_head, dict(mla, **window_first), dict(mla, BACKWARD=True, **window_first),
             dict(mla, SEARCH_GUESS=False, SEARCH_ONE_SEQUENCE=True)]
    for tile, result in zip(tiles, _compile_tiles(*tiles)):
        loads = list(zip(result["loads"], result["load_at"]))
        vectors = [at for op, at in loads if op == "LDG.E.128"]
        search = [at for op, at in loads if ".EL" in op]
        # the tile's 8 KiB over 128 threads: 4 vectors a thread, and the frequencies' 1 or 2
        assert len(vectors) >= 5 and len(search) >= 12, (tile, loads)
        ahead = sum(at < max(vectors) for at in search)
        assert ahead <= (0 if tile["SEARCH_GUESS"] else 2), (tile, ahead, loads)


def test_pipelined_tiles_compute_sin_cos_once_per_program():
    """In the software-pipelined backward of a norm (`_norm_backward_tiles`), where one-trip
    loops would keep Triton from pipelining, `_own_layout` keeps the angles from being
    recomputed in the tile's layout: at most one sin per thread for 1 token x 16 heads x 64
    pairs at 4 warps, with positions from the token's index and from an M-RoPE positions
    tensor (each pair reads its axis), as for the forward's tiles above."""
    pipelined = dict(BLOCK_T=1, BLOCK_H=16, NORM=1, BACKWARD=True, PIPELINE_STAGES=3,
                     SEQ_MAJOR=False, FLAT_GRID=True)
    for tile in _compile_tiles(pipelined, dict(pipelined, POSITIONS_FROM=2)):
        assert tile["sin"] == 1, tile


def test_table_norm_backward_loads_its_tile_before_the_table():
    """In the unpipelined token loop of a norm's backward with TE's table, a tile of one token
    (8 heads, a batch of one, where ptxas put the table's loads and sin/cos first) issues all
    its loads of the gradient and the norm's input before the table row's (`_rope_tile`'s
    barrier): the loop's last loads are the table's two 32-bit ones, one per half, with and
    without BATCH_OF_ONE."""
    tile = dict(BLOCK_T=1, BLOCK_H=8, NORM=1, BACKWARD=True, ANGLES_FROM_POSITIONS=False,
                SEQ_MAJOR=False, FLAT_GRID=True)
    for result in _compile_tiles(tile, dict(tile, BATCH_OF_ONE=True)):
        loads = result["loads"]
        assert loads.count("LDG.E") == 2 and loads[-2:] == ["LDG.E", "LDG.E"], loads


def test_norm_backward_loop_keeps_out_of_shared_memory():
    """The pipelined backward of a norm over a one-head tile of 16 tokens, the tokens spread
    over its 4 warps, carries dL/dweight per token through its token loop and sums it over the
    tokens after the loop (`_norm_backward_tiles`): the loop stores nothing to shared memory
    (the pipeline's copies into it are LDGSTS). A sum over the tile's tokens inside the loop
    goes through shared memory in every trip (20 STS under Triton 3.6)."""
    tile = dict(BLOCK_T=16, BLOCK_H=1, NORM=1, BACKWARD=True, PIPELINE_STAGES=3, SEQ_MAJOR=False)
    (result,) = _compile_tiles(tile)
    assert result["loop_shared_stores"], result          # the token loop is there
    assert set(result["loop_shared_stores"]) == {0}, result


def _planned_calls():
    """Calls (functions of no argument, forward and backward) that reach every kind of launch
    the launcher plans: each angle source and format, interleaved and partial rotary, CP,
    start_positions, in place, inverse, each dtype, fused QKV, and the norms over head and
    token with each of them where it changes the kernel."""
    def rope(t, *args, grad=None, **kwargs):
        t = t.detach().requires_grad_(True)
        out = apply_rotary_pos_emb(t, *args, **kwargs)
        out.backward(torch.ones_like(out) if grad is None else grad)

    def qkv(packed, *args, **kwargs):
        packed = packed.detach().requires_grad_(True)
        sum(o.sum() for o in apply_fused_qkv_rotary_pos_emb(packed, *args, **kwargs)).backward()

    def qk(q, k, *args, **kwargs):
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        sum(o.sum() for o in apply_rotary_pos_emb_qk(q, k, *args, **kwargs)).backward()

    s, b, h, d = 64, 2, 32, 128
    bf16, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    t = torch.randn(s, b, h, d, generator=gen).to(DEVICE, bf16)
    t_thd = torch.randn(s * b, h, d, generator=gen).to(DEVICE, bf16)
    cu_seqlens = int_tensor([0, 50, s * b])
    table, exact = RotaryPositionEmbedding(d, device=DEVICE)(2 * s), RotaryPositionEmbedding(d, device=DEVICE)
    half = RotaryPositionEmbedding(d, rotary_percent=0.5, device=DEVICE)
    mrope = RotaryPositionEmbedding(d, device=DEVICE, mrope_section=[16, 24, 24])
    axis_positions = torch.arange(3 * s, device=DEVICE).view(3, s) % s
    head = dict(norm_weight=torch.ones(d, device=DEVICE, dtype=bf16))
    token = dict(norm_weight=torch.ones(h * d, device=DEVICE, dtype=bf16), norm_over="token")
    split = [4 * d, d, d]
    packed = torch.randn(s, b, 8, sum(split), generator=gen).to(DEVICE, bf16)
    qk_norm = dict(q_norm_weight=head["norm_weight"], k_norm_weight=head["norm_weight"])
    qk_token_norm = dict(q_norm_weight=token["norm_weight"], k_norm_weight=token["norm_weight"],
                         norm_over="token")
    calls = []
    interleaved = {id(table): table, id(exact): RotaryPositionEmbedding(d, interleaved=True, device=DEVICE)}
    for freqs in (table, exact):
        calls += [lambda f=freqs: rope(t, f), lambda f=freqs: rope(t.transpose(0, 1), f, "bshd"),
                  lambda f=interleaved[id(freqs)]: rope(t, f, interleaved=True),
                  lambda f=freqs: rope(t, f, start_positions=int_tensor([3, 5])),
                  lambda f=freqs: rope(t, f, cp_size=2, cp_rank=1),
                  lambda f=freqs: rope(t_thd, f, "thd", cu_seqlens=cu_seqlens),
                  lambda f=freqs: rope(t, f, inverse=True),
                  lambda f=freqs: apply_rotary_pos_emb_inplace(t.clone(), f),
                  lambda f=freqs: qkv(packed, f, f, split),
                  lambda f=freqs: rope(t, f, **head), lambda f=freqs: rope(t, f, **token),
                  lambda f=freqs: rope(t_thd, f, "thd", cu_seqlens=cu_seqlens, **head),
                  lambda f=freqs: qkv(packed, f, f, split, **qk_norm),
                  lambda f=freqs: qk(t, t[:, :, :8], f),
                  lambda f=freqs: qk(t_thd, t_thd[:, :8], f, "thd", cu_seqlens=cu_seqlens),
                  lambda f=freqs: qk(t[:, :, :4], t[:, :, :1], f, **qk_norm),
                  lambda f=freqs: qk(t[:, :, :2], t[:, :, :1], f, **qk_norm),
                  lambda f=freqs: qk(t_thd, t_thd[:, :8], f, "thd", cu_seqlens=cu_seqlens, **qk_norm),
                  lambda f=freqs: qk(t, t, f, **qk_token_norm)]
    calls += [lambda: rope(t, half), lambda: rope(t, half, **head),
              lambda: rope(t, exact, positions=torch.arange(s, device=DEVICE)),
              lambda: rope(t, mrope, positions=axis_positions),
              lambda: rope(t, mrope, positions=axis_positions, **head),
              lambda: rope(t_thd, exact, "thd", positions=torch.arange(s * b, device=DEVICE) % 50)]
    calls += [lambda dtype=dtype: rope(t.to(dtype), table) for dtype in (torch.float16, torch.float32, torch.float64)]
    # One head per token from a table: tiles whose sin/cos are worked out once where the
    # table's halves match (`SAME_HALVES_ONCE`).
    calls += [lambda: rope(t[:, :, :1], table)]
    calls += [lambda: rope(t.double(), exact, **head), lambda: rope(t[:2, :1, :3], exact, **head)]
    # One token of one head: strides of 1 wherever the fuzzer may put them (constants in the
    # kernel, which Triton 3.5.1 lost when two shared a View).
    one = torch.randn(4, generator=gen).to(DEVICE).as_strided((1, 1, 2), (1, 1, 1))
    calls += [lambda: rope(one, RotaryPositionEmbedding(2, device=DEVICE), "thd", positions=int_tensor([0]),
                           grad=one, norm_weight=torch.ones(2, device=DEVICE))]
    return calls


def _launch_record(launch, args):
    """rope_sass_probe's planned_launch_record of a `_Launch` called with `args`."""
    import rope_sass_probe
    return rope_sass_probe.planned_launch_record(launch, args)


def test_every_planned_launch_compiles_for_sm90(tmp_path, monkeypatch):
    """Every kind of launch the GPU launch rule plans (`_planned_calls`) compiles for sm_90
    with the Triton installed, as its JIT specializes the arguments. CI runs this with each
    Triton users meet; the interpreter runs none of the compiler, so this is where a Triton
    that cannot compile a variant shows up without a GPU."""
    records = {}      # JSON of a launch -> (its kind, the launch_record)

    def record(launch, *args):
        entry = _launch_record(launch, args)
        cfg = launch.constexprs[0]
        kind = (launch.kernel.fn.__name__, getattr(cfg, "NORM", None), getattr(cfg, "BACKWARD", None),
                getattr(cfg, "PIPELINE_STAGES", 0) > 0)
        records[json.dumps(entry, sort_keys=True)] = kind, entry
    monkeypatch.setattr(triton_rotary_launch._Launch, "__call__", record)
    with triton_rotary_launch.use_launch_rule(triton_rotary_launch.GPU_RULE):
        for call in _planned_calls():
            call()
    kinds = {kind for kind, _ in records.values()}
    # The RoPE kernels with and without a norm, forward and backward, pipelined or not, the
    # second pass of the norm's weight gradient, the thd positions pre-pass, and q and k
    # together forward and backward, with norms too; the fused QKV's norm backward pipelined.
    assert len(kinds) == 20, sorted(kinds)
    assert ("rotary_qk_kernel", 0, True, False) in kinds, sorted(kinds)
    assert ("rotary_qk_kernel", 1, True, True) in kinds, sorted(kinds)
    assert ("rotary_qkv_kernel", 1, True, True) in kinds, sorted(kinds)
    assert ("sequence_positions_kernel", None, None, False) in kinds, sorted(kinds)
    # Exactly the pipelined norm backwards cap their registers (NORM_BACKWARD_MAX_REGISTERS):
    # those of the plain kernel (norms over the head and over the token), of q and k in one
    # launch and of the fused QKV; their records carry the cap to the compiler.
    cap = triton_rotary_launch.NORM_BACKWARD_MAX_REGISTERS
    assert cap > 0
    assert {kind for kind in kinds if kind[3]} == {
        ("rotary_kernel", 1, True, True), ("rotary_kernel", 2, True, True),
        ("rotary_qk_kernel", 1, True, True), ("rotary_qkv_kernel", 1, True, True)}
    for (_, _, _, pipelined), entry in records.values():
        assert entry["options"].get("maxnreg") == (cap if pipelined else None), entry
    # q and k of equal tiles with norms over the token (QK_NORM_OVERLAP): the key's launches
    # are programmatic dependent launches, and exactly those wait for the launch before them.
    def flag(entry, name):
        cfg = entry["constexprs"][0]
        return cfg["group"] == "Variant" and cfg["fields"][Variant._fields.index(name)]
    early = [entry for _, entry in records.values() if entry["options"].get("launch_pdl")]
    assert early and early == [e for _, e in records.values() if flag(e, "WAITS_FOR_PREVIOUS")]
    assert any(flag(e, "LAUNCH_DEPENDENTS") for _, e in records.values())
    assert {frozenset(e["options"]) for _, e in records.values()} == {
        frozenset(), frozenset({"maxnreg"}), frozenset({"launch_pdl"}),
        frozenset({"launch_pdl", "maxnreg"})}
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([entry for _, entry in records.values()]))
    results = _run_probe("--launches", str(path))
    assert len(results) == len(records)
    failed = [(kind, res["error"]) for (kind, _), res in zip(records.values(), results) if not res["ok"]]
    assert not failed, f"{len(failed)} of {len(records)} launches fail to compile: {failed[:3]}"


def test_thd_tile_loads_are_issued_before_the_sequence_search():
    """A thd tile's own loads (16-byte vectors of bf16) come first in the SASS, ahead of the
    search of cu_seqlens for its tokens' sequences (loads evict_last), for angles from
    positions and from a table, with the guessed window (SEARCH_GUESS) or without. Without the
    barrier after them, ptxas puts them after the whole chain of the search. With angles from
    positions the pairs' inverse frequencies (the tile's one 32-bit load without evict_last)
    may come between them (test_thd_tiles_load_the_frequencies_before_the_search); that load
    alone is left out of the order checked."""
    thd = dict(BLOCK_T=4, BLOCK_H=8, BLOCK_HALF=32, IS_THD=True, SEARCH_LEVELS=6)
    table = dict(thd, ANGLES_FROM_POSITIONS=False)
    tiles = [thd, table, dict(table, SEARCH_GUESS=True),
             dict(thd, BLOCK_T=1, BLOCK_H=32, SEARCH_GUESS=True)]
    for tile, result in zip(tiles, _compile_tiles(*tiles)):
        loads = list(result["loads"])
        if tile.get("ANGLES_FROM_POSITIONS", True):
            loads.remove("LDG.E")                                   # the frequencies' load
        assert loads[:3] == ["LDG.E.128", "LDG.E.128", "LDG.E.EL"], result["loads"]


@pytest.mark.skipif(not ON_GPU, reason="the interpreter launches through Triton's JIT only")
@pytest.mark.parametrize("direct", ["1", "0"])
def test_direct_launch_switch(direct):
    """ROPE_DIRECT_LAUNCH (read at import, so in a fresh process): 1, the default, keeps a
    compiled-kernel launcher per plan after the first call; 0 launches every call through
    Triton's JIT and keeps none. The results are the same either way."""
    import subprocess
    import sys
    code = ("import torch, triton_rotary_launch as L\n"
            "from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb\n"
            "t = torch.randn(16, 2, 4, 64, device='cuda')\n"
            "freqs = RotaryPositionEmbedding(64, device='cuda')(16)\n"
            "outs = [apply_rotary_pos_emb(t, freqs) for _ in range(3)]\n"
            "ref = apply_rotary_pos_emb(t, freqs, fused=False)\n"
            "assert all(torch.equal(o, outs[0]) for o in outs)\n"
            "torch.testing.assert_close(outs[0], ref)\n"
            "print(sum(len(p.launch.runners) for p in L._PLANS.values() if p.launch is not None))\n")
    env = dict(os.environ, ROPE_DIRECT_LAUNCH=direct)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0, run.stderr[-3000:]
    runners = int(run.stdout.split()[-1])
    assert (runners > 0) if direct == "1" else (runners == 0), runners


def test_plan_cache_keeps_validation():
    """A cached launch plan must not let through what the checks reject: 16.0 == 16, True == 1
    and 1 == True hash alike, so a key of values without types would match the valid call's."""
    freqs = RotaryPositionEmbedding(8, device=DEVICE)(8)
    qkv = torch.randn(4, 2, 2, 32, device=DEVICE)
    apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [16, 8, 8])            # plans the valid call
    for bad in ([16.0, 8.0, 8.0], [16, 8, True], [16, 8.0, 8], (16, 8, True)):
        with pytest.raises(ValueError, match="qkv_split_arg_list must be three positive ints"):
            apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, bad)
    # interleaved and cp arguments, through the launchers (the public entry points check
    # interleaved before any plan, so only the launchers show what the plan cache does).
    t = torch.randn(4, 2, 3, 8, device=DEVICE)
    set_rotary_kernel(t, freqs, interleaved=True)
    set_rotary_kernel(t, freqs, cp_size=1, cp_rank=0)
    triton_rotary_launch.set_rotary_qkv_kernel(qkv, freqs, freqs, [16, 8, 8], interleaved=True)
    for kwargs, match in ((dict(interleaved=1), "interleaved must be a bool"),
                          (dict(cp_size=True), "cp_size must be an int"),
                          (dict(cp_size=1.0), "cp_size must be an int"),
                          (dict(cp_rank=False), "cp_rank must be an int"),
                          (dict(cp_rank=0.0), "cp_rank must be an int")):
        with pytest.raises(TypeError, match=match):
            set_rotary_kernel(t, freqs, **kwargs)
        with pytest.raises(TypeError, match=match):
            triton_rotary_launch.set_rotary_qkv_kernel(qkv, freqs, freqs, [16, 8, 8], **kwargs)
        with pytest.raises(TypeError, match=match):
            apply_rotary_pos_emb(t, freqs, **kwargs)


def test_eager_backward_launches_the_plan_kept_with_the_forwards(monkeypatch):
    """An eager backward launches the transposed plan kept with its forward's plan: a repeated
    round trip looks up one plan (the forward's), not two, for t alone and for q and k in one
    launch. A gradient of other strides, or a backward under another launch rule, is planned
    again, and every gradient is right."""
    L = triton_rotary_launch
    lookups = []
    cached_plan = L._cached_plan
    monkeypatch.setattr(L, "_cached_plan", lambda key: lookups.append(key) or cached_plan(key))
    torch.manual_seed(11)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    x = torch.randn(8, 2, 3, 24, device=DEVICE, requires_grad=True)
    k = torch.randn(8, 2, 1, 24, device=DEVICE, requires_grad=True)
    grad = torch.randn(8, 2, 3, 24, device=DEVICE)
    strided_grad = torch.randn(24, 3, 2, 8, device=DEVICE).permute(3, 2, 1, 0)
    small_tiles = L.launch_rule()._replace(tile_bytes=256, min_programs_per_sm=0)
    calls = {"t": lambda freqs, fused=True: (apply_rotary_pos_emb(x, freqs, fused=fused),),
             "q and k": lambda freqs, fused=True: apply_rotary_pos_emb_qk(x, k, freqs,
                                                                          fused=fused)}

    def lookups_and_gradient(call, freqs, g, rule=None):
        outs = call(freqs)
        grads = (g, torch.ones_like(k))[:len(outs)]
        lookups.clear()
        with contextlib.nullcontext() if rule is None else L.use_launch_rule(rule):
            found = torch.autograd.grad(outs, (x, k)[:len(outs)], grads)
        expected = torch.autograd.grad(call(freqs, fused=False), (x, k)[:len(outs)], grads)
        for a, b in zip(found, expected):
            torch.testing.assert_close(a, b)
        return len(lookups)

    for name, call in calls.items():
        for freqs in (module, module(8)):
            L._PLANS.clear()
            counts = [lookups_and_gradient(call, freqs, grad),      # planned: a lookup, a miss
                      lookups_and_gradient(call, freqs, grad),      # kept
                      lookups_and_gradient(call, freqs, strided_grad),
                      lookups_and_gradient(call, freqs, strided_grad),
                      lookups_and_gradient(call, freqs, grad, small_tiles),
                      lookups_and_gradient(call, freqs, grad),      # the rule in force again
                      lookups_and_gradient(call, freqs, grad)]
            assert counts == [1, 0, 1, 0, 1, 1, 0], (name, counts)


def test_module_keeps_float32_frequencies():
    """A module cast to another dtype, alone or inside a model, keeps its float32 inv_freq
    bit for bit (so its rotation, its table and its state dict are those of the module as
    built), while a move to another device applies; a YaRN module keeps its scale too."""
    torch.manual_seed(47)
    t = torch.randn(8, 2, 3, 16, device=DEVICE)
    casts = {"to(bf16)": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half(),
             "double": lambda m: m.double(), "bfloat16": lambda m: m.bfloat16(),
             "in a model": lambda m: torch.nn.Sequential(torch.nn.Linear(2, 2), m).to(torch.float16)[1]}
    for scaling in (None, YARN):
        built = RotaryPositionEmbedding(16, device=DEVICE, rope_scaling=scaling)
        for name, cast in casts.items():
            module = cast(RotaryPositionEmbedding(16, device=DEVICE, rope_scaling=scaling))
            assert module.inv_freq.dtype == torch.float32, name
            assert torch.equal(module.inv_freq, built.inv_freq), name
            assert module.state_dict()["inv_freq"].dtype == torch.float32, name
            assert module.attention_scaling == built.attention_scaling, name
            assert torch.equal(module(8), built(8)), name
            assert torch.equal(apply_rotary_pos_emb(t, module), apply_rotary_pos_emb(t, built)), name
    moved = RotaryPositionEmbedding(16, device=DEVICE).to("meta", torch.bfloat16)
    assert moved.inv_freq.is_meta and moved.inv_freq.dtype == torch.float32
    assert moved.pair_axis.is_meta


def test_module_angles_are_kept_while_the_module_is_the_same():
    """A module's AngleSource is kept (made once, not on every call: `_module_fields`) while its
    buffers are the same tensors and its fields the same values, and the rotation follows what
    the module holds now: inv_freq changed in place, a new inv_freq, another attention scaling,
    an M-RoPE module's pair_axis replaced (each against the unfused formula), a position
    interpolation set afterwards (named, as when built with it); inv_freq swapped
    for float64 under the same tensor object is named, not read as float32."""
    L = triton_rotary_launch
    torch.manual_seed(5)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    t = torch.randn(8, 2, 3, 16, device=DEVICE)

    def check(freqs, **options):
        torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, **options),
                                   apply_rotary_pos_emb(t, freqs, fused=False, **options))

    first = L.angle_source(module)
    assert L.angle_source(module) is first
    check(module)
    with torch.no_grad():
        module.inv_freq.mul_(0.5)                   # the same tensor, other values
    assert L.angle_source(module) is first
    check(module)
    module.inv_freq = module.inv_freq * 3           # another tensor
    second = L.angle_source(module)
    assert second is not first and second.angles is module.inv_freq
    check(module)
    module.attention_scaling = 0.5
    assert L.angle_source(module).scale == 0.5
    check(module)
    module.seq_len_interpolation_factor = 2         # its table now divides the positions
    with pytest.raises(ValueError, match="interpolates positions"):
        apply_rotary_pos_emb(t, module)
    module.seq_len_interpolation_factor = None
    check(module)

    mrope = RotaryPositionEmbedding(16, mrope_section=[2, 3, 3], device=DEVICE)
    positions = torch.randint(0, 40, (3, 2, 8), device=DEVICE)
    check(mrope, positions=positions)
    mrope.pair_axis = mrope.pair_axis.flip(0).contiguous()
    assert L.angle_source(mrope).pair_axis is mrope.pair_axis
    check(mrope, positions=positions)

    module.inv_freq.data = module.inv_freq.data.double()
    with pytest.raises(TypeError, match="float32"):
        apply_rotary_pos_emb(t, module)


def _plans_without_launches(monkeypatch):
    """For tests that read plans: every planned launch left out."""
    monkeypatch.setattr(triton_rotary_launch._Launch, "__call__", lambda launch, *args: None)


def _plans_without_launches_d16(monkeypatch):
    """`_plans_without_launches`, and angle sources of 16 channels (the module and its table
    of 64 positions)."""
    _plans_without_launches(monkeypatch)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    return module, module(64)


def _plan_of_call(t, freqs, **options):
    """The one plan a set_rotary_kernel call makes (the plans cleared first)."""
    triton_rotary_launch._PLANS.clear()
    triton_rotary_launch.set_rotary_kernel(t, freqs, **options)
    (plan,) = triton_rotary_launch._PLANS.values()
    return plan


def _plans_of_qk_call(q, k, freqs, **options):
    """The plans a set_rotary_qk_kernel call makes (the plans cleared first)."""
    triton_rotary_launch._PLANS.clear()
    triton_rotary_launch.set_rotary_qk_kernel(q, k, freqs, **options)
    return list(triton_rotary_launch._PLANS.values())


def test_norm_calls_take_the_norms_tiles_and_warps(monkeypatch):
    """A QK-norm forward takes the plain tile in rule.norm_warps warps, in
    rule.norm_one_head_warps where its tile holds one head; with angles from positions and 2
    to rule.norm_positions_max_heads heads, a tile of rule.norm_positions_tile_bytes in
    rule.norm_positions_warps (the fused QKV: its own tile in those warps). Its backward takes tiles of
    rule.norm_backward_rows rows (angles from a table: rule.norm_table_backward_rows), the
    fused QKV's query tiles too, in as many warps as give each thread
    rule.norm_backward_thread_elements elements, and rule.norm_backward_warps_per_sm warps per
    SM along the tokens. A call without a norm keeps rule.num_warps (rule.table_warps from a
    table: test_table_and_search_tiles_take_their_warps). Only the plans are read:
    the launches are left out (the tiles' results are tested with the norms' other tests)."""
    L = triton_rotary_launch
    module, _ = _plans_without_launches_d16(monkeypatch)
    x = torch.randn(64, 2, 4, 16, device=DEVICE, requires_grad=True)
    inputs = {"4 heads": (x, module),
              "1 head": (torch.randn(64, 2, 1, 16, device=DEVICE, requires_grad=True), module),
              "8 heads": (torch.randn(64, 2, 8, 16, device=DEVICE, requires_grad=True), module),
              "table": (x, module(64))}
    qkv = torch.randn(64, 2, 2, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(16, device=DEVICE, requires_grad=True)
    # A row is 16 float32 channels, 64 bytes: 256 bytes hold 4 rows, 512 hold 8; 16 rows hold
    # 256 elements, 2 warps of 4 each; 8 warps per SM are 4 programs of 2 warps. One head
    # without a norm: 128 bytes, 2 rows.
    rule = L.launch_rule()._replace(tile_bytes=256, one_head_tile_bytes=128, qkv_tile_bytes=256,
                                    num_warps=4, table_warps=2,
                                    table_warps_min_heads=4, norm_warps=1,
                                    norm_one_head_warps=8, norm_positions_tile_bytes=512,
                                    norm_positions_warps=2, norm_positions_max_heads=4,
                                    norm_backward_rows=16,
                                    norm_table_backward_rows=8, norm_backward_thread_elements=4,
                                    norm_backward_warps_per_sm=8, min_programs_per_sm=0)
    found = {}
    with L.use_launch_rule(rule):
        for name, (t, freqs) in inputs.items():
            L._PLANS.clear()
            apply_rotary_pos_emb(t, freqs, norm_weight=weight).sum().backward()
            with torch.no_grad():
                apply_rotary_pos_emb(t, freqs)
            for plan in L._PLANS.values():
                launch = plan.launch
                key = (name, "norm" if launch.cfg.NORM else "plain",
                       "backward" if launch.cfg.BACKWARD else "forward")
                found[key] = (launch.num_warps, launch.cfg.BLOCK_T, launch.cfg.BLOCK_H,
                              launch.grid[0])
        for name, freqs in (("qkv", module), ("qkv table", module(64))):
            L._PLANS.clear()
            apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16], q_norm_weight=weight,
                                           k_norm_weight=weight)[0].sum().backward()
            for plan in L._PLANS.values():
                launch = plan.launch
                found[(name, "backward" if launch.cfg.BACKWARD else "forward")] = (
                    launch.num_warps, launch.cfg.BLOCK_T, launch.cfg.BLOCK_H)
    sms = L._sm_count(torch.device(DEVICE))
    # 128 tokens; forward tiles of 8 rows from positions (64 blocks of 2 tokens x 4 heads),
    # of 4 rows from the table and of one head (1 token x 4 heads; 4 tokens x 1 head);
    # backward tiles of 16 rows (32 blocks of 4 tokens x 4 heads, or 8 blocks of 16 tokens x
    # 1 head), 4 programs per SM; from the table, 8 rows (64 blocks of 2 tokens x 4 heads) in
    # 1 warp, 8 programs per SM.
    assert found == {
        ("4 heads", "norm", "forward"): (2, 2, 4, 64),
        ("4 heads", "norm", "backward"): (2, 4, 4, min(32, 4 * sms)),
        ("4 heads", "plain", "forward"): (4, 1, 4, 128),
        ("table", "norm", "forward"): (1, 1, 4, 128),
        ("table", "norm", "backward"): (1, 2, 4, min(64, 8 * sms)),
        ("table", "plain", "forward"): (2, 1, 4, 128),      # rule.table_warps
        ("1 head", "norm", "forward"): (8, 4, 1, 32),
        ("1 head", "norm", "backward"): (2, 16, 1, min(8, 4 * sms)),
        ("1 head", "plain", "forward"): (4, 2, 1, 64),      # rule.one_head_tile_bytes
        # more heads than rule.norm_positions_max_heads: the plain tile (1 token x 4 heads, two
        # programs per token); backward 2 tokens x 8 heads
        ("8 heads", "norm", "forward"): (1, 1, 4, 256),
        ("8 heads", "norm", "backward"): (2, 2, 8, min(64, 4 * sms)),
        ("8 heads", "plain", "forward"): (4, 1, 4, 256),
        # 4 query heads of d 16: forward tiles of 256 bytes (1 token x 4 heads), 2 warps from
        # positions, 1 from the table; backward tiles of 16 rows (4 tokens x 4 heads, 2 warps),
        # from the table 8 (2 tokens x 4 heads, 1 warp)
        ("qkv", "forward"): (2, 1, 4),
        ("qkv", "backward"): (2, 4, 4),
        ("qkv table", "forward"): (1, 1, 4),
        ("qkv table", "backward"): (1, 2, 4),
    }, found


def test_table_and_search_tiles_take_their_warps(monkeypatch):
    """Without a norm, a tile of TE's table whose angles serve rule.table_warps_min_heads heads
    or more takes rule.table_warps warps, forward and backward, alone and with q and k in one
    launch; a thd tile whose tokens search cu_seqlens takes rule.search_warps with angles from
    positions, and with TE's table rule.table_warps where its tokens are rule.search_wide_token
    bytes or wider, rule.num_warps where they are narrower; a table tile of fewer heads and
    every other tile with angles from positions keep rule.num_warps. Only the plans are
    read."""
    L = triton_rotary_launch
    module, table = _plans_without_launches_d16(monkeypatch)
    # A row is 16 float32 channels, 64 bytes (32: 128 bytes): a token of 4 heads is 256 bytes
    # (512), which 512-byte tiles and 256-byte search tiles hold whole.
    rule = L.launch_rule()._replace(tile_bytes=512, search_tile_bytes=256, num_warps=4,
                                    search_warps=8, table_warps=2, table_warps_min_heads=4,
                                    search_wide_token=512, min_programs_per_sm=0)
    cu_seqlens = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEVICE)
    thd = dict(tensor_format="thd", cu_seqlens=cu_seqlens)
    calls = {
        "4 heads, table": (torch.randn(64, 1, 4, 16, device=DEVICE), table, {}),
        "4 heads, positions": (torch.randn(64, 1, 4, 16, device=DEVICE), module, {}),
        "2 heads, table": (torch.randn(64, 1, 2, 16, device=DEVICE), table, {}),
        "thd search, table": (torch.randn(64, 4, 16, device=DEVICE), table, thd),
        "thd search, positions": (torch.randn(64, 4, 16, device=DEVICE), module, thd),
        "thd search, table, wide": (torch.randn(64, 4, 32, device=DEVICE), table, thd),
        "thd search, positions, wide": (torch.randn(64, 4, 32, device=DEVICE), module, thd),
        "thd positions given": (torch.randn(64, 4, 16, device=DEVICE), module,
                                dict(tensor_format="thd", positions=torch.arange(64, device=DEVICE))),
    }
    found = {}
    with L.use_launch_rule(rule):
        for name, (t, freqs, options) in calls.items():
            for backward in (False, True):
                plan = _plan_of_call(t, freqs, backward=backward, **options)
                found[(name, backward)] = plan.launch.num_warps
                assert plan.launch.cfg.BLOCK_H == t.shape[-2], name
        q, k = torch.randn(64, 1, 4, 16, device=DEVICE), torch.randn(64, 1, 1, 16, device=DEVICE)
        found[("q, k, table", False)] = [p.launch.num_warps for p in _plans_of_qk_call(q, k, table)]
    assert found == {
        ("4 heads, table", False): 2, ("4 heads, table", True): 2,
        ("4 heads, positions", False): 4, ("4 heads, positions", True): 4,
        ("2 heads, table", False): 4, ("2 heads, table", True): 4,
        ("thd search, table", False): 4, ("thd search, table", True): 4,
        ("thd search, positions", False): 8, ("thd search, positions", True): 8,
        ("thd search, table, wide", False): 2, ("thd search, table, wide", True): 2,
        ("thd search, positions, wide", False): 8, ("thd search, positions, wide", True): 8,
        ("thd positions given", False): 4, ("thd positions given", True): 4,
        ("q, k, table", False): [2],
    }, found


def test_one_head_tokens_take_the_one_head_tile(monkeypatch):
    """A call of one head per token without a norm, of either angle source, sbhd, bshd or thd
    with positions given, takes rule.one_head_tile_bytes, forward and backward; two heads,
    a norm, a thd call that searches cu_seqlens and q and k in one launch keep their own
    tiles. Only the plans are read."""
    L = triton_rotary_launch
    module, table = _plans_without_launches_d16(monkeypatch)
    # A row is 16 float32 channels, 64 bytes: one-head tiles of 2 tokens, plain ones of 8 rows,
    # search tiles of 4.
    rule = L.launch_rule()._replace(tile_bytes=512, one_head_tile_bytes=128,
                                    search_tile_bytes=256, search_wide_token=0,
                                    min_programs_per_sm=0)
    thd = dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 30, 64], dtype=torch.int32,
                                                             device=DEVICE))
    one, two = torch.randn(64, 1, 1, 16, device=DEVICE), torch.randn(64, 1, 2, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)
    calls = {
        "sbhd, table": (one, table, {}),
        "sbhd, positions": (one, module, {}),
        "bshd, positions": (one.transpose(0, 1), module, dict(tensor_format="bshd")),
        "thd, positions given": (one[:, 0], module, dict(tensor_format="thd",
                                                         positions=torch.arange(64, device=DEVICE))),
        "two heads": (two, module, {}),
        "norm": (one, module, dict(norm=L.RMSNorm(weight, 1e-6, 0.0, "head"))),
        "thd search": (one[:, 0], module, thd),
    }
    rows = {}
    with L.use_launch_rule(rule):
        for name, (t, freqs, options) in calls.items():
            for backward in (False, True):
                if backward and "norm" in options:
                    continue
                plan = _plan_of_call(t, freqs, backward=backward, **options)
                rows[name, backward] = plan.launch.cfg.BLOCK_T * plan.launch.cfg.BLOCK_H
        rows["q and k", False] = [p.launch.cfg[0].BLOCK_T
                                  for p in _plans_of_qk_call(one, one.clone(), module)]
    assert rows == {
        **{(name, backward): 2 for name in ("sbhd, table", "sbhd, positions", "bshd, positions",
                                            "thd, positions given") for backward in (False, True)},
        ("two heads", False): 8, ("two heads", True): 8, ("norm", False): 8,
        ("thd search", False): 4, ("thd search", True): 4, ("q and k", False): [8],
    }, rows


def test_thd_tiles_inside_one_sequence_give_the_searched_result(tmp_path, monkeypatch):
    """The launch rule's search_one_sequence (SEARCH_ONE_SEQUENCE, on in both rules) plans
    Variant.SEARCH_ONE_SEQUENCE for lone thd calls of narrow tokens that search cu_seqlens:
    with angles from positions where they go without the guessed window, with TE's table at
    one head, and (search_window_first, SEARCH_WINDOW_FIRST) 16-bit calls of one head that
    read the window, which then find the first token's sequence in it. Their results are bit
    for bit those of the rule without it, forward and backward, in tiles of one head and of
    two, at lengths where small tiles lie inside one sequence, lengths where they do not, and
    tokens outside every sequence. TE's table at two heads, the forward of a norm, pair tiles
    of q and k, calls whose positions come from a tensor and calls without a search never
    plan it. The GPU rule plans it, in bf16, for one head of d 64 (MLA's key's width) and of
    d 128 (from the window, with TE's table or angles from positions), not for 8 heads (wide
    tokens); in float32 for one head of d 64 (from the window), not of d 128; and the
    launches it plans compile for sm_90."""
    L = triton_rotary_launch
    torch.manual_seed(67)
    module = RotaryPositionEmbedding(16, device=DEVICE)
    table = module(40)
    assert L.GPU_RULE.search_one_sequence and L.launch_rule().search_one_sequence
    # Tiles of 512 bytes (8 tokens of one head of 16 float32 channels, 4 of two heads), every
    # token narrow.
    small = L.launch_rule()._replace(tile_bytes=512, search_tile_bytes=512, search_wide_token=0,
                                     min_programs_per_sm=0)
    off, on = (small._replace(search_one_sequence=flag) for flag in (False, True))
    norm = L.RMSNorm(torch.randn(16, device=DEVICE), 1e-6, 0.0, "head")
    cases = {"uniform": [0, 8, 16, 24, 32, 40], "mixed": [0, 3, 11, 12, 12, 29, 40],
             "outside": [2, 10, 18, 26, 33]}
    forward, backward, normed = dict(backward=False), dict(backward=True), dict(norm=norm)
    # (heads, freqs, options, whether `on` plans it)
    calls = [(1, module, forward, True), (1, module, backward, True), (1, table, forward, True),
             (1, table, backward, True), (2, module, forward, True), (2, module, backward, True),
             (2, table, forward, False), (1, module, normed, False), (2, table, normed, False)]
    planned = 0
    for name, cu in cases.items():
        thd = dict(tensor_format="thd", cu_seqlens=int_tensor(cu))
        for heads, freqs, options, plans_it in calls:
            # No tokens past the sequences but where the case puts them, so that the guess
            # of uniform lengths hits.
            t = torch.randn(44 if name == "outside" else cu[-1], heads, 16, device=DEVICE)
            results = {}
            for rule in (off, on):
                with L.use_launch_rule(rule):
                    plan = _plan_of_call(t, freqs, **options, **thd)
                    results[rule.search_one_sequence] = L.set_rotary_kernel(t, freqs, **options,
                                                                            **thd)
                assert plan.launch.cfg.SEARCH_ONE_SEQUENCE is (rule is on and plans_it), (
                    name, heads, options)
                planned += plan.launch.cfg.SEARCH_ONE_SEQUENCE
            # Where `on` plans as `off` does, both ran one launch: only the plan is checked.
            if plans_it:
                assert torch.equal(results[True], results[False]), (name, heads, options)
    assert planned == 6 * len(cases)
    # One head reading the guessed window, in tiles of 8 tokens of one head (4 of two): bf16
    # (32-byte tokens) with angles from positions or TE's table, float32 (64 bytes, at the
    # rule's float32 bound) with angles from positions only. For each, the rule without the
    # shortcut, the one without the window first, and the rule itself.
    for dtype, tile in ((torch.bfloat16, 256), (torch.float32, 512)):
        window_rule = small._replace(tile_bytes=tile, search_tile_bytes=tile,
                                    search_guess_one_head_token=32,
                                    search_window_first_float32_token=64)
        window_rules = (window_rule._replace(search_one_sequence=False),
                        window_rule._replace(search_window_first=False), window_rule)
        table_window = (False, False, dtype == torch.bfloat16)
        # (heads, freqs, options, SEARCH_ONE_SEQUENCE under each rule, SEARCH_WINDOW_FIRST)
        window_calls = [(1, module, forward, (False, False, True), (False, False, True)),
                        (1, module, backward, (False, False, True), (False, False, True)),
                        (1, table, forward, (False, True, True), table_window),
                        (1, table, backward, (False, True, True), table_window),
                        (2, module, forward, (False, True, True), (False, False, False)),
                        (2, table, forward, (False, False, False), (False, False, False))]
        windows = 0
        for name, cu in cases.items():
            thd = dict(tensor_format="thd", cu_seqlens=int_tensor(cu))
            for heads, freqs, options, one_sequence, window_first in window_calls:
                t = torch.randn(44 if name == "outside" else cu[-1], heads, 16, device=DEVICE,
                                dtype=dtype)
                results = []
                for rule, one, window in zip(window_rules, one_sequence, window_first):
                    with L.use_launch_rule(rule):
                        cfg = _plan_of_call(t, freqs, **options, **thd).launch.cfg
                        results.append(L.set_rotary_kernel(t, freqs, **options, **thd))
                    assert (cfg.SEARCH_ONE_SEQUENCE, cfg.SEARCH_WINDOW_FIRST) == (one, window), (
                        name, dtype, heads, options, rule.search_one_sequence,
                        rule.search_window_first)
                    windows += cfg.SEARCH_WINDOW_FIRST
                # Only where a rule planned otherwise than the one without the shortcut.
                for result, one in zip(results[1:], one_sequence[1:]):
                    if one:
                        assert torch.equal(result, results[0]), (name, dtype, heads, options)
        assert windows == (4 if dtype == torch.bfloat16 else 2) * len(cases), dtype
    # q (2 heads) and k (1) in one launch of pair tiles.
    q, k = torch.randn(40, 2, 16, device=DEVICE), torch.randn(40, 1, 16, device=DEVICE)
    with L.use_launch_rule(on):
        (plan,) = _plans_of_qk_call(q, k, module, tensor_format="thd",
                                    cu_seqlens=int_tensor(cases["uniform"]))
        assert not plan.launch.cfg[0].SEARCH_ONE_SEQUENCE
    # The uniform case's tiles (8 tokens of one head, 4 of two; from the window, 8 tokens of
    # one bf16 head) all take the shortcut, so the comparisons above ran it.
    for block_t, window_first in ((8, False), (4, False), (8, True)):
        tiles = triton.cdiv(40, block_t)
        inside = torch.full((tiles,), -1, dtype=torch.int32, device=DEVICE)
        _tile_in_one_sequence_probe[(tiles,)](int_tensor(cases["uniform"]), inside, 40, 5, 1,
                                              block_t, window_first)
        assert inside.cpu().tolist() == [1] * tiles, (block_t, inside)
    with L.use_launch_rule(on):
        t = torch.randn(40, 2, 16, device=DEVICE)
        positions = int_tensor(list(range(40)))
        assert not _plan_of_call(t, module, tensor_format="thd",
                                 positions=positions).launch.cfg.SEARCH_ONE_SEQUENCE
        assert not _plan_of_call(torch.randn(8, 5, 2, 16, device=DEVICE),
                                 module).launch.cfg.SEARCH_ONE_SEQUENCE
    records = []
    monkeypatch.setattr(L._Launch, "__call__",
                        lambda launch, *args: records.append(_launch_record(launch, args)))
    monkeypatch.setattr(L, "_sm_count", lambda device: 132)
    cu = int_tensor([64 * i for i in range(2049)])
    module_128 = RotaryPositionEmbedding(128, device=DEVICE)
    module_64 = RotaryPositionEmbedding(64, device=DEVICE)
    bf16, fp32 = torch.bfloat16, torch.float32
    with L.use_launch_rule(L.GPU_RULE):
        for heads, d, freqs, dtype in ((1, 128, module_128, bf16), (1, 128, module_128(64), bf16),
                                       (1, 64, module_64, bf16), (8, 128, module_128, bf16),
                                       (1, 64, module_64, fp32), (1, 128, module_128, fp32)):
            t = torch.randn(2048 * 64, heads, d, dtype=dtype, device=DEVICE)
            set_rotary_kernel(t, freqs, tensor_format="thd", cu_seqlens=cu)
    flag = Variant._fields.index("SEARCH_ONE_SEQUENCE")
    window = Variant._fields.index("SEARCH_WINDOW_FIRST")
    takes_it = [r["constexprs"][0]["fields"][flag] for r in records]
    # float32: MLA's key (256 bytes) from the window, one head of d 128 (512) with neither
    assert takes_it == [True, True, True, False, True, False], records
    assert ([r["constexprs"][0]["fields"][window] for r in records]
            == [True, True, True, False, True, False])
    path = tmp_path / "launches.json"
    path.write_text(json.dumps([r for r, on_ in zip(records, takes_it) if on_]))
    assert _run_probe("--launches", str(path)) == [{"ok": True}] * 4


def test_thd_search_tiles_by_token_width_and_guess(monkeypatch):
    """Without a norm, a thd call that searches cu_seqlens with angles from positions takes
    search tiles (rule.search_tile_bytes) where a token is narrower than
    rule.search_wide_token, and plain tiles (rule.tile_bytes) from there on, or
    always where that is 0; so does TE's table, except that its tokens in a 16-bit dtype of
    rule.table_search_token_16bit bytes or more keep search tiles. The guessed window
    (Variant.SEARCH_GUESS) is on where rule.search_guess says so for TE's table and for the
    plain tiles of wide tokens, and for search tiles with angles from positions only where a
    token is one head of rule.search_guess_one_head_token bytes or more; never with a norm.
    Only the plans are read."""
    L = triton_rotary_launch
    module, table = _plans_without_launches_d16(monkeypatch)
    # A head is 16 float32 channels, 64 bytes: a token of 4 heads is 256 bytes.
    rule = L.launch_rule()._replace(tile_bytes=256, search_tile_bytes=1024,
                                    search_wide_token=256, search_guess=True,
                                    min_programs_per_sm=0)
    thd = dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 30, 64], dtype=torch.int32,
                                                            device=DEVICE))
    wide, narrow = torch.randn(64, 4, 16, device=DEVICE), torch.randn(64, 2, 16, device=DEVICE)
    norm = L.RMSNorm(torch.ones(16, device=DEVICE), 1e-6, 0.0, "head")

    def tile(rule, t, freqs, **options):
        with L.use_launch_rule(rule):
            plan = _plan_of_call(t, freqs, **thd, **options)
        return plan.launch.cfg.BLOCK_T, plan.launch.cfg.BLOCK_H, plan.launch.cfg.SEARCH_GUESS

    assert tile(rule, wide, module) == (1, 4, True)            # 256-byte tokens: plain tiles
    assert tile(rule, narrow, module) == (8, 2, False)         # 128-byte tokens: 1024 bytes
    # One head of 64 bytes: the guess from rule.search_guess_one_head_token = 64 bytes on, not
    # at 128, nor at 0, nor at two heads (above) nor without rule.search_guess.
    one_head = torch.randn(64, 1, 16, device=DEVICE)
    one_head_rule = rule._replace(search_guess_one_head_token=64)
    assert tile(one_head_rule, one_head, module) == (16, 1, True)
    assert tile(one_head_rule._replace(search_guess_one_head_token=128), one_head,
                module) == (16, 1, False)
    assert tile(one_head_rule._replace(search_guess_one_head_token=0), one_head,
                module) == (16, 1, False)
    assert tile(one_head_rule._replace(search_guess=False), one_head, module) == (16, 1, False)
    assert tile(one_head_rule, narrow, module) == (8, 2, False)
    assert tile(one_head_rule, one_head, module, norm=norm)[2] is False
    # Nor where q and k share the launch (one head each).
    with L.use_launch_rule(one_head_rule):
        (pair,) = _plans_of_qk_call(one_head, one_head.clone(), module, **thd)
    pair_cfg, _ = pair.launch.cfg                       # (cfg, k_cfg): k_cfg None here
    assert pair_cfg.SEARCH_GUESS is False and pair_cfg.BLOCK_H == 1, pair_cfg
    assert tile(rule._replace(search_wide_token=0), wide, module) == (4, 4, False)
    assert tile(rule._replace(search_guess=False), wide, module) == (1, 4, False)
    assert tile(rule, wide, table) == (1, 4, True)
    assert tile(rule, narrow, table) == (8, 2, True)
    assert tile(rule._replace(search_wide_token=0), wide, table) == (4, 4, True)
    assert tile(rule._replace(search_guess=False), wide, table) == (1, 4, False)
    assert tile(rule, wide, table, norm=norm)[2] is False
    assert tile(rule, wide, module, norm=norm)[2] is False
    # bf16 tokens of 4 heads, 128 bytes, all wide: TE's table keeps 1024-byte search tiles of
    # 8 tokens where they are table_search_token_16bit bytes or more, else 256-byte plain
    # tiles of 2; angles from positions and float32 tokens take plain tiles either way.
    wide16 = wide.to(torch.bfloat16)
    rule16 = rule._replace(search_wide_token=128, table_search_token_16bit=128)
    assert tile(rule16, wide16, table) == (8, 4, True)
    assert tile(rule16._replace(table_search_token_16bit=256), wide16, table) == (2, 4, True)
    assert tile(rule16._replace(table_search_token_16bit=0), wide16, table) == (2, 4, True)
    assert tile(rule16, wide16, module) == (2, 4, True)
    assert tile(rule16._replace(table_search_token_16bit=64), wide, table) == (1, 4, True)


def test_gpu_rule_tiles_and_guess_of_packed_tokens(monkeypatch):
    """Under the GPU's rule (132 SMs, as an H200), a packed call that searches cu_seqlens takes
    the plain 4 KiB tile with the guessed window where a token (all its heads) is 1 KiB or more,
    as SEARCH_WIDE_TOKEN's measurements have it: 8 heads of d 128 in bf16 (2 tokens a tile), 4
    heads in bf16 (4 tokens) and in float32 (2); TE's table there in 2 warps, but in 4 where the
    tile holds fewer than 4 heads (2 of d 256 in bf16). Narrower tokens keep 8 KiB search tiles,
    with the guess for TE's table and, as SEARCH_GUESS_ONE_HEAD_TOKEN's measurements have it,
    for one head of 128 bytes or more: one head of d 128 in bf16 (256 bytes, 32 tokens a tile)
    and in float32 (512 bytes, 16) and one of d 64 in bf16 (128 bytes; 32 tokens, the tile
    halved for 4 programs per SM) and in float32 (256 bytes, 32) take it; two of d 64 in bf16
    (256 bytes, 32) and three of d 128 in bf16 (768 bytes, 8 tokens x 4 heads) do not. Only
    the plans are read."""
    L = triton_rotary_launch
    _plans_without_launches(monkeypatch)
    monkeypatch.setattr(L, "_sm_count", lambda device: 132)
    tokens = 32768
    thd = dict(tensor_format="thd", cu_seqlens=torch.arange(0, tokens + 1, 64, dtype=torch.int32,
                                                            device=DEVICE))
    found = {}
    with L.use_launch_rule(L.GPU_RULE):
        for heads, d, dtype, name in ((8, 128, torch.bfloat16, "8 x 128 bf16"),
                                      (4, 128, torch.bfloat16, "4 x 128 bf16"),
                                      (4, 128, torch.float32, "4 x 128 fp32"),
                                      (2, 256, torch.bfloat16, "2 x 256 bf16"),
                                      (1, 128, torch.bfloat16, "1 x 128 bf16"),
                                      (2, 64, torch.bfloat16, "2 x 64 bf16"),
                                      (1, 64, torch.bfloat16, "1 x 64 bf16"),
                                      (1, 64, torch.float32, "1 x 64 fp32"),
                                      (1, 128, torch.float32, "1 x 128 fp32"),
                                      (3, 128, torch.bfloat16, "3 x 128 bf16")):
            t = torch.empty(tokens, heads, d, dtype=dtype, device=DEVICE)
            module = RotaryPositionEmbedding(d, device=DEVICE)
            for source, freqs in (("positions", module), ("table", module(64))):
                launch = _plan_of_call(t, freqs, **thd).launch
                found[name, source] = (launch.cfg.BLOCK_T, launch.cfg.BLOCK_H,
                                       launch.cfg.SEARCH_GUESS, launch.num_warps)
    assert found == {
        ("8 x 128 bf16", "positions"): (2, 8, True, 4), ("8 x 128 bf16", "table"): (2, 8, True, 2),
        ("4 x 128 bf16", "positions"): (4, 4, True, 4), ("4 x 128 bf16", "table"): (4, 4, True, 2),
        ("4 x 128 fp32", "positions"): (2, 4, True, 4), ("4 x 128 fp32", "table"): (2, 4, True, 2),
        ("2 x 256 bf16", "positions"): (4, 2, True, 4), ("2 x 256 bf16", "table"): (4, 2, True, 4),
        ("1 x 128 bf16", "positions"): (32, 1, True, 4), ("1 x 128 bf16", "table"): (32, 1, True, 4),
        ("2 x 64 bf16", "positions"): (32, 2, False, 4), ("2 x 64 bf16", "table"): (32, 2, True, 4),
        ("1 x 64 bf16", "positions"): (32, 1, True, 4), ("1 x 64 bf16", "table"): (32, 1, True, 4),
        ("1 x 64 fp32", "positions"): (32, 1, True, 4), ("1 x 64 fp32", "table"): (32, 1, True, 4),
        ("1 x 128 fp32", "positions"): (16, 1, True, 4), ("1 x 128 fp32", "table"): (16, 1, True, 4),
        ("3 x 128 bf16", "positions"): (8, 4, False, 4), ("3 x 128 bf16", "table"): (8, 4, True, 4),
    }, found


def _norm_forward_plans(t, freqs, **options):
    """The forward plans of a call with a norm under the GPU's rule on one SM, as the
    interpreter plans it (its tiles are then a GPU's)."""
    L = triton_rotary_launch
    L._PLANS.clear()
    with L.use_launch_rule(L.GPU_RULE):
        out = apply_rotary_pos_emb(t, freqs, **options)
    return out, [p.launch.cfg for p in L._PLANS.values()
                 if p.launch is not None and not p.launch.cfg.BACKWARD]


def test_norm_forward_after_the_angles_where_the_rule_says(monkeypatch):
    """The forward of a per-head norm normalizes after working out the angles
    (Variant.NORM_AFTER_ANGLES) in tiles of several heads that hold one token or take their
    angles from a table, where no tile searches cu_seqlens; every other forward, and every
    backward, normalizes first (`_norm_after_angles`)."""
    monkeypatch.setattr(triton_rotary_launch, "_sm_count", lambda device: 1)
    module = RotaryPositionEmbedding(128, device=DEVICE)
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    weight = torch.ones(128, **bf16)
    cases = {   # name: (t, freqs, options, whether its forward normalizes after the angles)
        # More heads than the positions tile takes: the plain tile, 1 token x 16 heads.
        "32 heads, exact": (torch.randn(8, 1, 32, 128, **bf16), module, {}, True),
        # The positions tile: 8 tokens x 4 heads.
        "4 heads, exact": (torch.randn(64, 1, 4, 128, **bf16), module, {}, False),
        "4 heads, table": (torch.randn(64, 1, 4, 128, **bf16), module(64), {}, True),
        "1 head, table": (torch.randn(64, 1, 1, 128, **bf16), module(64), {}, False),
        "over the token": (torch.randn(8, 1, 32, 128, **bf16), module,
                           dict(norm_over="token", norm_weight=torch.ones(32 * 128, **bf16)),
                           False),
        "thd, cu_seqlens": (torch.randn(16, 32, 128, **bf16), module,
                            dict(tensor_format="thd", cu_seqlens=int_tensor([0, 5, 16])), False),
    }
    found, expected = {}, {}
    for name, (t, freqs, options, late) in cases.items():
        options = dict(dict(norm_weight=weight), **options)
        out, cfgs = _norm_forward_plans(t.requires_grad_(True), freqs, **options)
        found[name] = [cfg.NORM_AFTER_ANGLES for cfg in cfgs]
        expected[name] = [late]
        out.sum().backward()
        backward = [p.launch.cfg.NORM_AFTER_ANGLES for p in triton_rotary_launch._PLANS.values()
                    if p.launch is not None and p.launch.cfg.BACKWARD]
        assert backward == [False], (name, backward)
    assert found == expected


_NORM_AFTER_ANGLES_CASES = {
    # name: (t's shape, format, angles, dtype, options)
    "bf16, exact": ((4, 2, 8, 32), "sbhd", "module", torch.bfloat16, {}),
    "bf16, table, offset": ((4, 2, 8, 32), "sbhd", "table", torch.bfloat16, {"norm_offset": 1.0}),
    "fp16, interleaved": ((4, 2, 8, 32), "sbhd", "interleaved", torch.float16, {}),
    "bf16, partial rotary, bshd": ((2, 4, 8, 32), "bshd", "half", torch.bfloat16, {}),
    "fp32, table, inverse": ((4, 2, 8, 32), "sbhd", "table", torch.float32, {"inverse": True}),
    "bf16, in place": ((4, 2, 8, 32), "sbhd", "module", torch.bfloat16, {"in_place": True}),
}


@pytest.mark.parametrize("name", list(_NORM_AFTER_ANGLES_CASES))
def test_norm_after_the_angles_gives_the_same_bits(name, monkeypatch):
    """A forward with a norm gives the same bits whether it normalizes before or after the
    angles (the same arithmetic, in another order of instructions): forced both ways, with
    the late one checked to be the one planned. The weight is bf16 where t is float32, so
    both are read in their own dtypes."""
    shape, fmt, angles, dtype, options = _NORM_AFTER_ANGLES_CASES[name]
    torch.manual_seed(75)
    freqs = _norm_case_angles(angles)
    options = dict(options, interleaved=angles == "interleaved", tensor_format=fmt)
    in_place = options.pop("in_place", False)
    t = torch.randn(shape, device=DEVICE, dtype=dtype)
    weight = (1 + 0.2 * torch.randn(32, device=DEVICE)).to(
        torch.bfloat16 if dtype == torch.float32 else dtype)
    monkeypatch.setattr(triton_rotary_launch, "_sm_count", lambda device: 1)
    outs = {}
    for late in (False, True):
        monkeypatch.setattr(triton_rotary_launch, "_norm_after_angles",
                            lambda *args, late=late: late)
        if in_place:
            triton_rotary_launch._PLANS.clear()
            out = apply_rotary_pos_emb_inplace(t.clone(), freqs, norm_weight=weight, **options)
            cfgs = [p.launch.cfg for p in triton_rotary_launch._PLANS.values()]
        else:
            out, cfgs = _norm_forward_plans(t, freqs, norm_weight=weight, **options)
        assert [cfg.NORM_AFTER_ANGLES for cfg in cfgs] == [late]
        outs[late] = out
    assert torch.equal(outs[False], outs[True])
    # And both are the norm and the rotation: against the unfused formula in float64.
    wide = t.double()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
    normed = normed * (weight.double() + options.get("norm_offset", 0.0))
    expected = apply_rotary_pos_emb(normed, freqs, fused=False,
                                    **{k: v for k, v in options.items() if k != "norm_offset"})
    torch.testing.assert_close(outs[True].double(), expected, **_TOLERANCE_OF[dtype])


_TOLERANCE_OF = {torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
                 torch.float16: dict(rtol=2e-3, atol=4e-3),
                 torch.float32: dict(rtol=2e-5, atol=2e-5)}


def test_launch_rule_changes_make_new_plans():
    """test_other_launch_configs plans calls under other launch rules and expects new tiles:
    the plan key must hold the rule. Every change of a rule field plans anew (and a repeated
    call does not), the new tile shapes still give the right result, and leaving
    use_launch_rule plans with the rule in force again."""
    L = triton_rotary_launch
    freqs = RotaryPositionEmbedding(16, device=DEVICE)(4)
    t = torch.randn(4, 2, 2, 24, device=DEVICE)
    expected = apply_rotary_pos_emb(t, freqs, fused=False)

    def plans_after_two_calls():
        for _ in range(2):
            torch.testing.assert_close(apply_rotary_pos_emb(t, freqs), expected)
        return {key: plan for key, plan in L._PLANS.items() if plan.launch is not None}

    L._PLANS.clear()
    first = plans_after_two_calls()
    assert len(first) == 1
    rule = L.launch_rule()
    changes = [("tile_bytes", 512), ("tile_bytes", 256), ("min_programs_per_sm", 1000),
               ("search_tile_bytes", 512), ("qkv_tile_bytes", 512), ("num_warps", 1)]
    cfg = next(iter(first.values())).launch.cfg
    tiles = {(cfg.BLOCK_T, cfg.BLOCK_H)}
    for number, (field, value) in enumerate(changes, start=2):
        rule = rule._replace(**{field: value})
        with L.use_launch_rule(rule):
            plans = plans_after_two_calls()
        assert len(plans) == number, (field, value, len(plans))
        new_plan = [p for key, p in plans.items() if key not in first][0]
        first = plans
        tiles.add((new_plan.launch.cfg.BLOCK_T, new_plan.launch.cfg.BLOCK_H))
        if field == "num_warps":
            assert new_plan.launch.num_warps == 1
    # Back outside: the plan of the rule in force serves the call again, no new one.
    assert len(plans_after_two_calls()) == len(changes) + 1
    if not ON_GPU:
        # The first three rules changed the tiles themselves, not only the key (on a GPU a
        # shape this small is shrunk to one-token tiles by the SM count already).
        assert len(tiles) >= 4, tiles


# =================================================================================================
# == 9. Fuzzing
#    Random layouts, strides, dtypes and angle sources against the unfused formula in float64
#    (strategies in rope_fuzz_strategies.py).
# =================================================================================================


@fuzz(rope_calls)
def test_fuzz_rope(call, data):
    """apply_rotary_pos_emb forward and backward through autograd, then the launcher writing
    into a poisoned out view (forward or backward, drawn): every element written, nothing
    around it touched."""
    t, freqs, kwargs, grad, in_seq, _ = call
    ref_out, ref_dx = fuzz_reference(t, freqs, kwargs, grad, in_seq)
    x = t.detach().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, **kwargs)
    assert out.is_contiguous() and out.dtype == t.dtype
    assert_fuzz_close(out.detach(), ref_out, "forward")
    (dx,) = torch.autograd.grad(out, x, grad)
    assert_fuzz_close(dx, ref_dx, "backward")
    backward = data.draw(st.booleans())
    buffer, target, inside = poisoned_view(data.draw, t.shape, t.dtype)
    around = buffer.clone()
    result = set_rotary_kernel(grad if backward else t, freqs, backward=backward, out=target, **kwargs)
    assert result is target
    assert_fuzz_close(target, ref_dx if backward else ref_out, "out= (backward)" if backward else "out=")
    assert torch.equal(buffer[~inside], around[~inside]), "written outside out"


@fuzz(rope_calls)
def test_fuzz_rope_inplace(call, data):
    """apply_rotary_pos_emb_inplace on a view inside a larger buffer (transposed, sliced or
    offset storage): its first d2 channels rotated, everything else in the buffer untouched."""
    t, freqs, kwargs, _, _, d2 = call
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    # A view that does not overlap itself and has no negative bit (both refused in place).
    view = laid_out(data.draw, gen, t.shape, t.dtype, ("contiguous", "transposed", "sliced", "offset"))
    base = view._base if view._base is not None else view
    before, start = base.clone(), view.clone()
    expected = apply_rotary_pos_emb(start.double(), freqs, fused=False, **kwargs)
    with torch.no_grad():
        assert apply_rotary_pos_emb_inplace(view, freqs, **kwargs) is view
    assert_fuzz_close(view[..., :d2], expected[..., :d2], "rotated channels")
    assert torch.equal(view[..., d2:], start[..., d2:]), "channels past d2 changed"
    # Everything of the storage outside the view: compare through a marker copy.
    marker = torch.zeros_like(base, dtype=torch.bool)
    marker.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(True)
    assert torch.equal(base[~marker], before[~marker]), "written outside the view"


def _qk_norm_reference(t, freqs, kwargs, norm, grad, in_seq=None):
    """(output, input gradient, weight gradient) of the QK-norm call from the norm's definition
    and the unfused formula on float64 copies; tokens outside every thd sequence (in_seq
    False) are normalized, not rotated, their gradient passed through the rotation."""
    x64 = t.resolve_neg().double().requires_grad_(True)
    w64 = norm["norm_weight"].double().requires_grad_(True)
    normed = _norm64(x64, w64, norm["norm_eps"], norm["norm_offset"], norm["norm_over"])
    y = normed.detach().requires_grad_(True)
    out = apply_rotary_pos_emb(y, freqs, fused=False, **kwargs)
    (dy,) = torch.autograd.grad(out, y, grad.resolve_neg().double())
    if in_seq is not None:
        dy[~in_seq] = grad.resolve_neg()[~in_seq].double()
    return (out.detach(), *torch.autograd.grad(normed, (x64, w64), dy))


def _check_qk_norm_call(t, freqs, kwargs, norm, grad, in_seq=None):
    """The fused QK-norm call through autograd against `_qk_norm_reference`."""
    ref_out, ref_dx, ref_dw = _qk_norm_reference(t, freqs, kwargs, norm, grad, in_seq)
    x = t.detach().requires_grad_(True)
    w = norm["norm_weight"].detach().requires_grad_(True)
    out = apply_rotary_pos_emb(x, freqs, **kwargs, **{**norm, "norm_weight": w})
    assert out.is_contiguous() and out.dtype == t.dtype
    assert_fuzz_close(out.detach(), ref_out, "forward")
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    assert_fuzz_close(dx, ref_dx, "input gradient")
    assert dw.dtype == w.dtype
    assert_fuzz_close(dw, ref_dw, "weight gradient")


@fuzz(rope_calls)
def test_fuzz_qk_norm(call, data):
    """The drawn call with a drawn QK-norm (`_check_qk_norm_call`)."""
    t, freqs, kwargs, grad, in_seq, _ = call
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    _check_qk_norm_call(t, freqs, kwargs, fuzz_norm(data.draw, gen, *t.shape[-2:]), grad, in_seq)


@fuzz(rope_calls)
def test_fuzz_qk_norm_pair(call, data):
    """apply_rotary_pos_emb_qk of the drawn call with drawn norms (k: the drawn tensor's first
    heads, a view; q: all of them) against a fused call for each: outputs and input gradients
    bit for bit, the weights' gradients to float32 rounding (their partial sums add up in
    another grouping)."""
    t, freqs, kwargs, grad, _, _ = call
    if t.shape[-2] == 0:           # no heads to draw a per-head weight from
        return
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    k_heads = data.draw(st.integers(1, t.shape[-2]))
    q, k = t, t[..., :k_heads, :]
    norm = fuzz_norm(data.draw, gen, *q.shape[-2:])
    k_norm = fuzz_norm(data.draw, gen, *k.shape[-2:])
    norm.update(norm_over="head", norm_weight=norm["norm_weight"][:q.shape[-1]])
    k_weight = k_norm["norm_weight"][:k.shape[-1]].to(norm["norm_weight"].dtype)
    wq = norm.pop("norm_weight").detach().requires_grad_(True)
    wk = k_weight.detach().requires_grad_(True)
    qx, kx = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    outs = apply_rotary_pos_emb_qk(qx, kx, freqs, **kwargs, **norm, q_norm_weight=wq, k_norm_weight=wk)
    grads = (grad, grad[..., :k_heads, :])
    got = torch.autograd.grad(outs, (qx, kx, wq, wk), grads)
    for i, (x, w) in enumerate(((q, wq), (k, wk))):
        x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        ref = apply_rotary_pos_emb(x2, freqs, **kwargs, **norm, norm_weight=w2)
        dx, dw = torch.autograd.grad(ref, (x2, w2), grads[i])
        assert torch.equal(outs[i].detach(), ref.detach()) or torch.equal(outs[i].isnan(), ref.isnan())
        torch.testing.assert_close(got[i], dx, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got[2 + i], dw, rtol=1e-4, atol=1e-4, equal_nan=True)


@fuzz(qkv_calls)
def test_fuzz_qkv(call, data):
    """apply_fused_qkv_rotary_pos_emb forward and packed gradient against the unfused formula
    on float64 copies."""
    qkv, q_freqs, k_freqs, split, kwargs, grads = call
    x64 = qkv.resolve_neg().double().requires_grad_(True)
    if qkv.shape[0] * qkv.shape[1]:
        refs = apply_fused_qkv_rotary_pos_emb(x64, q_freqs, k_freqs, split, fused=False, **kwargs)
        (ref_dx,) = torch.autograd.grad(refs, x64, [g.resolve_neg().double() for g in grads])
    else:           # no tokens: empty results (the unfused path fails, test_unfused_qkv_without_tokens)
        refs, ref_dx = [torch.zeros(g.shape, dtype=torch.float64, device=DEVICE) for g in grads], torch.zeros_like(x64)
    x = qkv.detach().requires_grad_(True)
    outs = apply_fused_qkv_rotary_pos_emb(x, q_freqs, k_freqs, split, **kwargs)
    for name, out, ref in zip("qkv", outs, refs):
        assert out.is_contiguous() and out.dtype == qkv.dtype
        assert_fuzz_close(out.detach(), ref.detach(), name)
    (dx,) = torch.autograd.grad(outs, x, grads)
    assert_fuzz_close(dx, ref_dx, "packed gradient")


# =================================================================================================
# == 10. GPU only: sanitizer cases and large tensors
#    `make sanitize` runs the -m sanitize tests under compute-sanitizer.
# =================================================================================================


# Odd shapes `make sanitize` runs under compute-sanitizer (they also run in `make test`).
SANITIZE_CASES = [
    dict(shape=(13, 3, 5, 72)), dict(shape=(13, 3, 5, 80), rotary_dim=40, margin=7),
    dict(shape=(9, 2, 7, 96), rotary_dim=72, interleaved=True), dict(shape=(5, 2, 3, 128), rotary_dim=6),
    dict(shape=(3, 11, 5, 96), tensor_format="bshd", transpose=(0, 1)),
    dict(shape=(11, 3, 5, 80), transpose=(2, 3), interleaved=True),
    dict(shape=(10, 2, 4, 72), cp_size=2, cp_rank=1, rotary_dim=64),
    dict(shape=(9, 2, 3, 96), start_positions=[4, 11], margin=16),
    dict(shape=(57, 5, 80), tensor_format="thd", cu_seqlens=[0, 1, 1, 17, 40, 52], rotary_dim=40),
    dict(shape=(24, 3, 72), tensor_format="thd", cu_seqlens=[0, 12, 16, 40], cp_size=2, cp_rank=1, interleaved=True),
]


@pytest.mark.sanitize
@pytest.mark.parametrize("case", SANITIZE_CASES, ids=_case_id)
def test_sanitize_cases(case):
    torch.manual_seed(14)
    case = dict(case)
    shape, transpose = case.pop("shape"), case.pop("transpose", None)
    rotary_dim, margin = case.pop("rotary_dim", shape[-1]), case.pop("margin", 0)
    for key in ("cu_seqlens", "start_positions"):
        if key in case:
            case[key] = int_tensor(case[key])
    t = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    if transpose:
        t = t.transpose(*transpose).contiguous().transpose(*transpose)
    fmt = case.get("tensor_format", "sbhd")
    seq = shape[0] if fmt != "bshd" else shape[1]
    freqs = RotaryPositionEmbedding(rotary_dim, interleaved=case.get("interleaved", False),
                                    device=DEVICE)(seq * case.get("cp_size", 1) + margin)
    compare(apply_rotary_pos_emb, t, overlapping_grad, "unfused", freqs=freqs, **case)


@pytest.mark.sanitize
@pytest.mark.parametrize("split,kv_heads,rotary_percent", [([3 * 80, 80, 48], 3, 0.5), ([2 * 72, 72, 72], 5, 1.0)])
def test_sanitize_qkv(split, kv_heads, rotary_percent):
    torch.manual_seed(13)
    qkv = torch.randn(7, 3, kv_heads, sum(split), device=DEVICE, dtype=torch.bfloat16)
    freqs = RotaryPositionEmbedding(split[1], rotary_percent, device=DEVICE)(9)
    compare_qkv(qkv, freqs, freqs * 2, split)


# QK-norm calls with odd shapes: a norm's tiles hold whole heads (or whole tokens), and its
# backward loops over token blocks and writes partial sums of dL/dweight.
SANITIZE_NORM_CASES = [
    dict(shape=(13, 3, 5, 72), rotary_dim=40, norm_over="head"),
    dict(shape=(9, 2, 7, 96), interleaved=True, norm_over="token", norm_offset=1.0),
    dict(shape=(3, 11, 5, 80), tensor_format="bshd", norm_over="head", norm_offset=1.0),
    dict(shape=(57, 5, 80), tensor_format="thd", cu_seqlens=[0, 1, 1, 17, 40, 52], rotary_dim=40,
         norm_over="token"),
    dict(shape=(24, 3, 72), tensor_format="thd", cu_seqlens=[0, 12, 16, 40], cp_size=2, cp_rank=1,
         interleaved=True, norm_over="head"),
]


@pytest.mark.sanitize
@pytest.mark.parametrize("case", SANITIZE_NORM_CASES, ids=_case_id)
def test_sanitize_qk_norm(case):
    """Output and the gradients of the input and the weight (`_check_qk_norm_call`)."""
    torch.manual_seed(15)
    case = dict(case)
    shape, rotary_dim = case.pop("shape"), case.pop("rotary_dim", None)
    norm = dict(norm_over=case.pop("norm_over"), norm_offset=case.pop("norm_offset", 0.0), norm_eps=1e-6)
    in_seq = None
    if "cu_seqlens" in case:
        in_seq = tokens_in_sequences(case["cu_seqlens"], shape[0], case.get("cp_size", 1))
        case["cu_seqlens"] = int_tensor(case["cu_seqlens"])
    t = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)
    norm["norm_weight"] = torch.randn(shape[-1] * (1 if norm["norm_over"] == "head" else shape[-2]),
                                      device=DEVICE, dtype=torch.bfloat16)
    freqs = RotaryPositionEmbedding(rotary_dim or shape[-1], interleaved=case.get("interleaved", False),
                                    device=DEVICE)(64)
    _check_qk_norm_call(t, freqs, case, norm, torch.randn_like(t), in_seq)


@pytest.mark.sanitize
def test_sanitize_qk_norm_qkv():
    torch.manual_seed(16)
    split = [3 * 80, 80, 48]
    qkv = torch.randn(7, 3, 3, sum(split), device=DEVICE, dtype=torch.bfloat16)
    freqs = RotaryPositionEmbedding(40, device=DEVICE)(9)
    weights = [torch.randn(80, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    compare_qkv(qkv, freqs, freqs * 2, split, q_norm_weight=weights[0], k_norm_weight=weights[1])


@pytest.mark.slow
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with >= 20 GB free")
def test_more_than_2_pow_31_elements():
    """TE 2.20 hits an illegal memory access here (bf16 17000 x 16 x 64 x 128 = 2.2e9 elements)."""
    torch.manual_seed(12)
    s, b, h, d = 17000, 16, 64, 128
    assert s * b * h * d > 2**31
    t = torch.empty(s, b, h, d, dtype=torch.bfloat16, device=DEVICE).normal_()
    freqs = RotaryPositionEmbedding(d, device=DEVICE)(s)
    rows = [0, 1, s // 2, s - 2, s - 1]
    for backward in (False, True):
        out = set_rotary_kernel(t, freqs, backward=backward)
        for r in rows:
            expected = set_rotary_kernel(t[r:r + 1].clone(), freqs[r:], backward=backward)
            assert torch.equal(out[r:r + 1], expected), (backward, r)
        del out
    expected_last = unfused_reference(t[-1:].float(), freqs=freqs[s - 1:]).to(torch.bfloat16)
    torch.testing.assert_close(set_rotary_kernel(t, freqs)[-1:], expected_last)


# =================================================================================================
# == 11. Accuracy study and benchmark report
#    The study's story, the summaries, plots and stamps of rope_bench_report.py.
# =================================================================================================


def test_accuracy_vs_position(tmp_path):
    """The study's story. Float32 input: the table's error grows with the position (float32
    angles lose absolute precision as they grow) and passes 1e-4 by 2^20, as does every
    method built on float32 angles (transformers, flash-attn), while the exact path stays
    below 2e-6 everywhere up to 2^24 - 1. bfloat16 input: the exact path's error is the
    output's rounding and no more (< 2^-8), transformers' is above it at every position
    (bfloat16 tables and arithmetic), and every float32-angle method is far above it at 2^24."""
    rows = accuracy_vs_position()
    err = {(d, m): [r[report.accuracy_column(d, m)] for r in rows]
           for d in ACCURACY_INPUTS for m in list(report.ACCURACY_METHODS) + ["store_rounding"]}
    table = err["fp32", "table"]
    assert all(e < EXACT_REL_TOL for e in err["fp32", "exact"]), err["fp32", "exact"]
    assert table[20] > 1e-4
    # every four octaves the table's error grows (about 16x: one float32 ulp of the angle)
    assert all(table[k + 4] > 4 * table[k] for k in range(8, 21)), table
    assert table[24] > 1e-3 and table[4] < EXACT_REL_TOL
    for method in ("transformers", "flash_attn"):
        assert err["fp32", method][20] > 1e-4 and err["fp32", method][4] < EXACT_REL_TOL, method
        assert err["bf16", method][24] > 10 * err["bf16", "exact"][24], method
    exact, floor = err["bf16", "exact"], err["bf16", "store_rounding"]
    assert all(e < 2.0**-8 for e in exact), exact
    assert all(e <= 1.02 * f for e, f in zip(exact, floor)), (exact, floor)
    # above the rounding to nearest at every position, so above ours on a GPU (ours is that
    # rounding there); the interpreter's truncating stores make ours larger, hence the floor
    assert all(hf > 1.2 * f for hf, f in zip(err["bf16", "transformers"], err["bf16", "rounding"])), err
    if ON_GPU:
        assert all(hf >= e for hf, e in zip(err["bf16", "transformers"], exact)), err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    plot_accuracy(tmp_path / "accuracy_vs_position.png", rows)
    assert (tmp_path / "accuracy_vs_position.png").stat().st_size > 0
    assert (tmp_path / "accuracy_vs_position.csv").read_text().count("\n") == 1 + len(rows)


def _model_tokens(point):
    return point["seqs"] * point["seq_len"] if "seqs" in point else point["tokens"]


def test_models_points_are_large_enough_and_their_lines_agree():
    """Every `models` point holds at least 16 MiB in bf16 (so that launch latency does not
    decide its timings), and, built with a few dozen tokens, our table and positions lines
    compute the same forward and backward (the rotation by minus the angles), to float32
    rounding, in its own layout (sbhd, thd, Hugging Face's view, fused QKV, M-RoPE; partial
    and interleaved)."""
    import rope_bench
    for point in report.MODEL_POINTS:
        width = point["kv"] * (point["q_per_kv"] + 2) if point["layout"] == "qkv" else point["heads"]
        assert _model_tokens(point) * width * point["d"] * 2 >= rope_bench.MIN_MODEL_INPUT_BYTES, point
        work = rope_bench._model_workload(point, torch.float32, shrink=_model_tokens(point) // 48)
        assert 0 < work["x"].numel() // (width * point["d"]) <= 128, (point["name"], work["x"].shape)
        table, positions = work["lines"]["triton"], work["lines"]["triton_positions"]
        for mode in ("forward", "backward"):
            ours = [getattr(line, mode)() for line in (table, positions)]
            a, b = ((o,) if isinstance(o, torch.Tensor) else o for o in ours)
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=point["name"])
        if point["layout"] in ("sbhd", "hf") and "mrope" not in point:
            # And the unfused formula, where the point's call is this simple.
            x, interleaved = work["x"], point.get("interleaved", False)
            fmt = "sbhd" if point["layout"] == "sbhd" else "bshd"
            freqs = RotaryPositionEmbedding(point["d"], point.get("rotary_percent", 1.0),
                                            interleaved=interleaved, device=DEVICE)(x.shape[1 if fmt == "bshd" else 0])
            torch.testing.assert_close(
                table.forward(), unfused_reference(x, freqs=freqs, tensor_format=fmt, interleaved=interleaved),
                msg=point["name"])
        if point["layout"] == "hf":
            assert not work["x"].is_contiguous() and work["x"].transpose(1, 2).is_contiguous()


def test_models_rotating_sets_are_distinct_and_move_enough_bytes(monkeypatch):
    """A models point is timed over independent input sets that together move at least
    ROTATING_BYTES per pass (so that no call reads what the one before left in L2), capped at
    MAX_SETS; each set has its own input."""
    import rope_bench
    point = report.MODEL_POINT_BY_NAME["8B-TP1-k-8K"]
    shrink = _model_tokens(point) // 16
    per_set = 2 * rope_bench._model_workload(point, torch.float32, shrink)["x"].nbytes
    monkeypatch.setattr(rope_bench, "ROTATING_BYTES", 5 * per_set - 1)
    works = rope_bench._rotating_workloads(point, torch.float32, shrink)
    assert len(works) == 5
    assert len({w["x"].data_ptr() for w in works}) == 5
    assert not any(torch.equal(works[0]["x"], w["x"]) for w in works[1:])
    monkeypatch.setattr(rope_bench, "MAX_SETS", 3)
    assert len(rope_bench._rotating_workloads(point, torch.float32, shrink)) == 3


class _CallsAsGraph:
    """rope_bench.graphed's stand-in on a CPU: `replay()` calls the captured step again."""

    def __init__(self, step):
        self.step = step
        step()

    def replay(self):
        self.step()


def test_models_copies_move_the_bytes_they_are_compared_with(monkeypatch):
    """Each of the two reference copies reads and writes `moved` bytes per input set: after a
    replay every set's destination holds its source (random data, not zeros), whichever
    copy made it."""
    import rope_bench
    monkeypatch.setattr(rope_bench, "graphed", _CallsAsGraph)
    moved, sets = 2 * 3000 * 2, 3                   # 3000 bf16 elements read and written per set
    for name, graph in rope_bench._copy_graphs(moved, torch.bfloat16, sets).items():
        srcs, dsts = graph.buffers
        assert len(srcs) == len(dsts) == sets and all(s.nbytes == moved // 2 for s in srcs)
        for d in dsts:
            d.fill_(0)
        graph.replay()
        for s, d in zip(srcs, dsts):
            assert s.abs().sum() > 0 and torch.equal(s, d), name


class _FakeClock:
    """CUDA events on a clock that only runners advance: `replay_ms` on a CPU."""
    now = 0.0

    def __init__(self, **_):
        self.at = None

    def record(self):
        self.at = _FakeClock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


class _FakeRunner:
    def __init__(self, costs):
        self.costs, self.replays = iter(costs), 0

    def replay(self):
        self.replays += 1
        _FakeClock.now += next(self.costs)


def test_replay_ms_gives_median_and_percentiles_per_call(monkeypatch):
    """`replay_ms` times each runner `replays` times per round, round-robin, and reports per
    call (a replay makes `calls_per_replay` calls) the median and the 20th and 80th
    percentiles over the rounds."""
    import rope_bench
    monkeypatch.setattr(torch.cuda, "Event", _FakeClock)
    # Round r costs r ms per replay of a; b costs 7 ms per replay throughout.
    a = _FakeRunner(r for r in range(1, 6) for _ in range(2))
    b = _FakeRunner([7.0] * 10)
    timed = rope_bench.replay_ms({"a": a, "b": b}, calls_per_replay=4, replays=2, rounds=5)
    assert a.replays == b.replays == 10
    # Per call: round r's 2 replays of r ms over 8 calls: r / 4 ms, r = 1..5.
    median, p20, p80 = timed["a"]
    assert median == pytest.approx(3 / 4) and p20 == pytest.approx(1.8 / 4) and p80 == pytest.approx(4.2 / 4)
    assert timed["b"] == pytest.approx((7 / 4,) * 3)


def test_models_rows_take_the_faster_copy_and_count_two_passes_forward_backward():
    """Each row's reference is the faster of the two copies of the bytes its provider moves
    (Liger: q and k), doubled for the forward+backward modes (two passes); the copy rows are
    of x's bytes; a provider whose runner failed has no row; rows say how they were timed."""
    import rope_bench
    x_bytes, qk_bytes = 100, 160
    modes = ["forward_kernel", "forward+backward (CUDA graph)"]
    timed = {("copy", x_bytes): (2.0, 1.9, 2.1), ("triton_copy", x_bytes): (1.8, 1.7, 1.9),
             ("copy", qk_bytes): (3.0, 2.9, 3.1), ("triton_copy", qk_bytes): (3.3, 3.2, 3.4),
             ("triton", "forward_kernel"): (2.0, 1.95, 2.05),
             ("triton", "forward+backward (CUDA graph)"): (4.5, 4.4, 4.6),
             ("liger", "forward_kernel"): (4.0, 3.9, 4.1)}
    rows = rope_bench._models_rows("p", "bf16", modes, timed, {"triton": x_bytes, "liger": qk_bytes},
                                   x_bytes, sets=3)
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert sorted(by) == sorted([(p, m) for p in ("copy", "triton_copy", "triton") for m in modes]
                                + [("liger", "forward_kernel")])
    assert all(r["timing"] == report.MODELS_TIMING and r["sets"] == 3 and r["x"] == "p" for r in rows)
    fwd, step = "forward_kernel", "forward+backward (CUDA graph)"
    assert (by["copy", fwd]["ms"], by["copy", fwd]["copy_ms"], by["copy", fwd]["bytes"]) == (1.8, 1.8, 100)
    assert (by["copy", step]["ms"], by["copy", step]["p80"], by["copy", step]["bytes"]) == (3.6, 3.8, 200)
    assert (by["triton_copy", step]["ms"], by["triton_copy", step]["copy_ms"]) == (3.6, 3.6)
    assert report.fraction(by["triton", fwd]) == pytest.approx(0.9)
    assert (by["triton", step]["copy_ms"], by["triton", step]["bytes"]) == (3.6, 200)
    assert (by["liger", fwd]["copy_ms"], by["liger", fwd]["bytes"]) == (3.0, 160)


def test_models_time_fp16_and_parameter_sweeps_do_not(monkeypatch):
    """`--dtypes` names bf16, fp16 and fp32 by default: the models sweep times each, the
    parameter sweeps (TE's comparisons, in bf16 and fp32) skip fp16."""
    import rope_bench
    timed = []
    monkeypatch.setattr(rope_bench, "_run_sweep", lambda sweep, dtype, mode, *_: timed.append((sweep, dtype)))
    monkeypatch.setattr(rope_bench, "_run_models", lambda dtypes, *_, **__: timed.extend(("models", d) for d in dtypes))
    dtypes = rope_bench._parse_list(rope_bench._parser().parse_args([]).dtypes, rope_bench.BENCH_DTYPES, "dtypes")
    rope_bench._timed_rows(["seq_length", "models"], dtypes, ["forward"], ["forward_kernel"], {})
    assert sorted(set(timed)) == [("models", "bf16"), ("models", "fp16"), ("models", "fp32"),
                                  ("seq_length", "bf16"), ("seq_length", "fp32")]


def test_models_points_option_times_the_named_points_only(monkeypatch):
    """`--points` hands the named models points to the models sweep (and only to it), which
    runs alone unless --sweeps names others; a name it does not know, or points with sweeps
    that leave out models, stop the run before any timing."""
    import rope_bench

    def requested(*argv):
        sweeps, _, _, _, points = rope_bench._requested(rope_bench._parser().parse_args(argv))
        return sweeps, points and [p["name"] for p in points]
    assert requested("--points", "MLA-k-rope-128K") == (["models"], ["MLA-k-rope-128K"])
    assert requested("--sweeps", "seq_length,models", "--points", "h2-d64-64K") == (
        ["seq_length", "models"], ["h2-d64-64K"])
    assert requested() == (list(report.SWEEPS), None)
    asked = []
    monkeypatch.setattr(rope_bench, "_run_sweep", lambda *_: None)
    monkeypatch.setattr(rope_bench, "_run_models", lambda *_, points=None, **__: asked.append(points))
    names = ["thd-mixed-16K-h32", "MLA-k-rope-128K"]
    points = [report.MODEL_POINT_BY_NAME[n] for n in names]
    rope_bench._timed_rows(["seq_length", "models"], ["bf16"], ["forward"], ["forward_kernel"], {}, points)
    assert [[p["name"] for p in a] for a in asked] == [names]
    with pytest.raises(SystemExit, match="unknown models points: no-such-point"):
        rope_bench.run_benchmarks(["--sweeps", "models", "--points", "MLA-k-rope-128K,no-such-point"])
    with pytest.raises(SystemExit, match="add models to --sweeps"):
        rope_bench.run_benchmarks(["--sweeps", "seq_length", "--points", "MLA-k-rope-128K"])


def test_bench_saves_its_rows_as_it_goes(monkeypatch, tmp_path):
    """A bench run saves after each parameter sweep's dtype and mode and each models point's
    dtype (`_timed_rows`' checkpoint), every row stamped, so that a run stopped midway keeps
    what it timed: `_save_results` merges the rows so far over the earlier ones of the same
    points, keeps earlier restamp notes, and keeps the earlier run's host extras, marked as
    such, until the final save brings this run's; a save is whole or absent (no temporary
    file left)."""
    import rope_bench
    monkeypatch.setattr(rope_bench, "_run_sweep", lambda sweep, dtype, mode, results, _: results.append(
        dict(sweep=sweep, x=1, dtype=dtype, mode=mode, provider="triton", ms=1.0)))

    def models(dtypes, modes, results, stamp, points=None, progress="", point_done=None):
        for p in points:
            for d in dtypes:
                results.append(dict(sweep="models", x=p["name"], dtype=d, mode=modes[0],
                                    provider="triton", ms=2.0) | stamp)
                point_done()
    monkeypatch.setattr(rope_bench, "_run_models", models)
    stamp = dict(kernel="k1", device_code="d1", date="today")
    saved = []
    points = [report.MODEL_POINT_BY_NAME[n] for n in ("MLA-k-rope-128K", "h2-d64-64K")]
    rows = rope_bench._timed_rows(["seq_length", "models"], ["bf16", "fp32"], ["forward"],
                                  ["forward_kernel"], stamp, points,
                                  checkpoint=lambda r: saved.append([dict(x) for x in r]))
    # two parameter parts, then four models parts
    assert [len(s) for s in saved] == [1, 2, 3, 4, 5, 6]
    assert all(r["device_code"] == "d1" and r["date"] == "today" for s in saved for r in s)
    assert saved[-1] == rows

    old = dict(sweep="seq_length", x=1, dtype="bf16", mode="forward", provider="triton", ms=9.0,
               device_code="d0")
    kept = dict(old, x=2)
    note = [dict(kernel="k0", device_code="d0", rows=1, note="n", date="before")]
    env = {"GPU": "g", "Transformer Engine": "TE x"}
    earlier = {"restamped": note, "extras": {"host overhead": "h0"}}
    rope_bench._save_results(tmp_path, env, stamp, [old, kept], earlier, rows[:1])
    merged = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["x"], r["ms"]) for r in merged) == [(1, 1.0), (2, 9.0)]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["restamped"] == note and run["device_code"] == "d1"
    assert run["extras"] == {"host overhead": "h0" + rope_bench.EARLIER_EXTRAS}
    rope_bench._save_results(tmp_path, env, stamp, [old, kept], run, rows[:1])     # marked once
    assert json.loads((tmp_path / "run.json").read_text())["extras"] == run["extras"]
    rope_bench._save_results(tmp_path, env, stamp, [old, kept], earlier, rows,
                             extras={"host overhead": "h"})
    assert len(json.loads((tmp_path / "results.json").read_text())) == len(rows) + 1
    assert json.loads((tmp_path / "run.json").read_text())["extras"] == {"host overhead": "h"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "run.json"]


def test_table_bound_counts_the_table_rows_the_path_must_read():
    """The table path's own bound: a copy's bytes over those plus the float32 table rows read
    (d2 angles each, per pass): one row per token for one sequence (one head of d 128: as many
    bytes as the copy in bf16, half as many in fp32), one per position for packed sequences,
    a quarter of the row with a quarter of d rotated, twice the rows forward + backward."""
    def row(x, dtype, mode="forward_kernel"):
        point = report.MODEL_POINT_BY_NAME[x]
        size = {"bf16": 2, "fp32": 4}[dtype]
        moved = (2 * _model_tokens(point) * point["heads"] * point["d"] * size
                 * (2 if mode == "forward+backward" else 1))
        return dict(sweep="models", x=x, dtype=dtype, mode=mode, bytes=moved)
    assert report.table_bound(row("8B-TP8-k-64K", "bf16")) == 0.5
    assert report.table_bound(row("8B-TP8-k-64K", "fp32")) == pytest.approx(2 / 3)
    assert report.table_bound(row("8B-TP8-k-64K", "bf16", "forward+backward")) == 0.5
    assert report.table_bound(row("8B-TP1-q-8K", "bf16")) == pytest.approx(32 / 33)  # 32 heads
    assert report.table_bound(row("partial-quarter-h32-8K", "bf16")) == pytest.approx(128 / 129)
    # 2048 sequences of 64 tokens: 64 rows of 512 bytes against 512 MiB moved
    assert report.table_bound(row("thd-2048x64-h8", "bf16")) == pytest.approx(2**29 / (2**29 + 2**15))
    assert report.table_bound(dict(row("8B-TP8-k-64K", "bf16"), sweep="seq_length")) is None


def _model_row(ms, copy_ms, **extra):
    return dict(ms=ms, copy_ms=copy_ms, **extra)


def test_kernels_overview_counts_kernel_modes_only():
    """The short table's models rows: kernels-alone modes only, fractions from each row's own
    copy time, the best peer compared where there is one, TE where a point has a TE row."""
    table = {("a", "bf16", "forward_kernel"): dict(triton_positions=_model_row(1.0, 0.99),
                                                    triton=_model_row(2.0, 1.0),
                                                    flash_attn=_model_row(1.0, 0.95),
                                                    te=_model_row(1.5, 1.0)),
             ("a", "bf16", "backward_kernel"): dict(triton_positions=_model_row(1.0, 0.96)),
             ("a", "bf16", "forward+backward"): dict(triton_positions=_model_row(10.0, 1.0))}
    overview = report.kernels_overview(table)
    positions, table_path = overview["triton_positions"], overview["triton"]
    assert positions[:6] == (2, 1, pytest.approx(0.975), pytest.approx(0.96), 1, 1)
    assert (positions.with_te, positions.at_te, positions.min_te_speedup) == (1, 1, 1.5)
    assert table_path[:6] == (1, 0, pytest.approx(0.5), pytest.approx(0.5), 1, 0)
    assert (table_path.with_te, table_path.at_te, table_path.min_te_speedup) == (1, 0, 0.75)
    only_eager = {("a", "bf16", "forward+backward"): dict(triton=_model_row(1.0, 1.0))}
    assert report.kernels_overview(only_eager)["triton"] is None


def test_models_summary_counts_host_bound_eager_steps_apart():
    """The models summary counts kernel time (kernels alone, the CUDA-graph step) apart from
    the eager steps, and flags an eager step as host-bound, not as below the target, where it
    runs below HOST_BOUND_SHARE of its CUDA-graph twin's speed; an eager step near its twin's
    speed but below the target keeps that flag."""
    def rows(mode, point, ours_ms, copy_ms=1.0):
        return [dict(sweep="models", x=point, dtype="bf16", mode=mode, provider="triton_positions",
                     ms=ours_ms, copy_ms=copy_ms)]
    results = (rows("forward_kernel", "a", 1.0 / 0.99) + rows("backward_kernel", "a", 1.0 / 0.95)
               + rows(report.EAGER_STEP, "a", 1.0 / 0.30) + rows(report.GRAPHED_STEP, "a", 1.0 / 0.99)
               + rows(report.EAGER_STEP, "b", 1.0 / 0.93) + rows(report.GRAPHED_STEP, "b", 1.0 / 0.96))
    lines = report._models_summary(results)
    summary = next(line for line in lines if line.startswith("- Triton (positions):"))
    assert summary == ("- Triton (positions): kernel time: min 0.950 of copy over 4 point-modes, "
                       "2 below 0.97. Eager forward+backward: 1 of 2 host-bound; of the others, "
                       "1 below 0.97."), summary
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines
             if line.startswith(("| a |", "| b |"))]
    flags = {(row[0], row[2]): row[-1] for row in cells}       # (point, mode): flags
    assert flags["a", "forward+backward"] == "triton_positions host-bound (CUDA graph: 0.990)"
    assert flags["b", "forward+backward"] == "triton_positions < 0.97"
    assert flags["a", "backward_kernel"] == "triton_positions < 0.97"
    assert flags["a", "forward_kernel"] == ""
    assert "- flagged point-modes: 2 of 4 of kernel time, 2 of 2 eager steps" in lines


def _edited_copy(tmp_path, path, name, edit):
    """A copy of the file at `path` with `edit` (text -> text) applied."""
    with open(path) as f:
        text = f.read()
    copy = tmp_path / f"{name}.py"
    copy.write_text(edit(text))
    return str(copy)


def _replace_line(pattern, new):
    """An edit replacing the one line that matches `pattern` (a regex) with `new`."""
    def edit(text):
        edited, count = re.subn(pattern, new, text, count=1, flags=re.MULTILINE)
        assert count == 1, f"no line matches {pattern!r}"
        return edited
    return edit


def test_device_code_stamp_ignores_host_code(tmp_path):
    """The stamp changes with the device code (a @triton.jit function, a
    @triton.constexpr_function, a tl.constexpr global of triton_rotary_kernel.py) and the
    launch rule (a constant launch_config reads in triton_rotary_launch.py), and not with host
    code (a new host function, a host check's limit, the plan cache's size)."""
    stamp = report.device_code_stamp

    def kernel_edit(name, edit):
        return stamp(kernel_file=_edited_copy(tmp_path, report.KERNEL_FILE, "kernel_" + name, edit))

    def launch_edit(name, edit):
        return stamp(launch_file=_edited_copy(tmp_path, report.LAUNCH_FILE, "launch_" + name, edit))

    base = kernel_edit("same", lambda text: text)
    assert base == stamp() == launch_edit("same", lambda text: text)
    assert re.fullmatch(r"[0-9a-f]{12}", base)
    host_edits = {
        "host_function": lambda text: text + "\n\ndef _host_only_helper():\n    return 1\n",
        "host_check": _replace_line(r"^MAX_SEQUENCES = .*$", "MAX_SEQUENCES = 2**25"),
        "plan_cache": _replace_line(r"^_MAX_PLANS = .*$", "_MAX_PLANS = 17"),
    }
    for name, edit in host_edits.items():
        assert launch_edit(name, edit) == base, name
    comment = lambda text: text.replace("# out1 = x1*cos1", "# the rotation: out1 = x1*cos1")  # noqa: E731
    assert kernel_edit("comment", comment) == base
    device_edits = {
        "jit_function": lambda text: text + "\n\n@triton.jit\ndef _new_device_helper(x):\n    return x + 1\n",
        "constexpr_function": lambda text: text.replace(
            "return tl.float64 if dtype == tl.float64 else tl.float32",
            "return tl.float64 if dtype == tl.float64 else tl.float16"),
        "constexpr": _replace_line(r"^SEARCH_FAN = tl\.constexpr\(.*$", "SEARCH_FAN = tl.constexpr(2)"),
    }
    for name, edit in device_edits.items():
        assert kernel_edit(name, edit) != base, name
    launch_rule_edits = {
        "launch_constant": _replace_line(r"^TILE_BYTES = .*$", "TILE_BYTES = 2048"),
        "qkv_tile": _replace_line(r"^QKV_TILE_BYTES = .*$", "QKV_TILE_BYTES = 4096"),
    }
    for name, edit in launch_rule_edits.items():
        assert launch_edit(name, edit) != base, name


def test_device_code_stamp_is_the_gpu_processes_stamp():
    """The stamp is the same with and without the interpreter: it takes the constexpr values
    of a GPU process (the interpreter turns _HARDWARE_SINCOS off in the kernel module it
    imports, not in the copy the stamp reads)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import rope_bench_report as r; print(r.device_code_stamp())"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(report.KERNEL_FILE), env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == report.device_code_stamp()


def _fake_sweep_rows(sweep, x, dtype, mode, ms, **stamp):
    """Result rows of one parameter-sweep point: {provider: ms}."""
    return [dict(sweep=sweep, x=x, dtype=dtype, mode=mode, provider=p, ms=v, bytes=2**20, **stamp)
            for p, v in ms.items()]


def _fake_models_rows(point, dtype, mode, ms, copy_ms, **stamp):
    return [dict(sweep="models", x=point, dtype=dtype, mode=mode, provider=p, ms=v, p20=v, p80=v,
                 bytes=2**27, copy_ms=copy_ms, **stamp) for p, v in ms.items()]


def _fake_artifacts(tmp_path, monkeypatch, rows):
    """An artifacts root in tmp_path with one GPU folder "gpu" holding `rows`."""
    monkeypatch.setattr(report, "ARTIFACTS_ROOT", str(tmp_path))
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "results.json").write_text(json.dumps(rows))
    env = {"GPU": "Test GPU 80GB", "driver": "1", "torch": "2.x", "triton": "3.x",
           "Transformer Engine": "TE test", "date": "today"}
    (tmp_path / "gpu" / "run.json").write_text(json.dumps({"environment": env}))
    return tmp_path / "gpu"


def _fake_results(stamp):
    rows = []
    for x, triton_ms in ((512, 1.0), (1024, 2.0)):
        for mode in ("forward", "forward+backward"):
            rows += _fake_sweep_rows("seq_length", x, "bf16", mode,
                                dict(torch=4 * x / 512, te=1.5 * x / 512, triton=triton_ms, copy=0.99 * x / 512),
                                **stamp)
    for mode in report.MODEL_MODES:
        rows += _fake_models_rows("8B-TP1-q-8K", "bf16", mode, dict(copy=1.0, triton=1.25, triton_positions=1.0,
                                                                 flash_attn=1.1), 1.0, **stamp)
    return rows


def test_report_regenerates_every_plot_and_the_page(tmp_path, monkeypatch):
    """regenerate() from results.json alone: the short table leads SUMMARY.md with the numbers
    of the rows, every plot is on results.html, the sweep CSV holds fractions of copy, and the
    forward+backward plot is one figure (eager beside CUDA graph)."""
    pytest.importorskip("matplotlib")
    out = _fake_artifacts(tmp_path, monkeypatch, _fake_results(dict(kernel="k", device_code="old")))
    report.regenerate()
    summary = (out / "SUMMARY.md").read_text().splitlines()
    table_start = next(i for i, line in enumerate(summary) if line.startswith("| scope |"))
    assert all(not line.startswith("## ") for line in summary[:table_start])    # the table leads
    kernels = summary[table_start + 2:table_start + 6]
    assert kernels[0].startswith("| models, kernels alone | Triton (freqs table) | 2 | 0 / 2 | 0.800 |")
    # 8B-TP1-q-8K in bf16 moves 2**27 bytes and reads 2**22 of table: bound 32/33 of copy speed
    assert kernels[1].startswith("| models, kernels alone | Triton (freqs table), of its own bound | "
                                 "2 | 0 / 2 | 0.825 |")
    assert kernels[2].startswith("| models, kernels alone | Triton (positions) | 2 | 2 / 2 | 1.000 |")
    assert kernels[3] == ("| parameter sweeps, all modes | Triton (freqs table) | 4 | 4 / 4 | 0.990 | 0.990 | "
                          "no peer measured | 4 / 4 (1.50x) |")
    assert "of the current device code" in "\n".join(summary) and " 0 of " in "\n".join(summary)
    pngs = {p.name for p in out.glob("*.png")}
    page = (out / "results.html").read_text()
    assert pngs and all(f'src="{name}"' in page for name in pngs)
    assert {"models_bf16_forward_kernel.png", "models_bf16_forward_backward_eager_vs_cuda_graph.png",
            "rope_forward_bf16_seq_length.png"} <= pngs
    assert "models_bf16_forward_backward.png" not in pngs and "Test GPU 80GB" in page
    csv_rows = (out / "rope_forward_bf16_seq_length.csv").read_text().splitlines()
    header = csv_rows[0].split(",")
    assert csv_rows[1].split(",")[header.index("Triton (fraction of copy)")] == "0.9900"
    assert (tmp_path / "SUMMARY.md").read_text().startswith("# Benchmarks across GPUs")


def test_report_fraction_axis_holds_every_value():
    """One y range for every fraction plot: FRACTION_TOP while the values fit under it, else
    a top above the largest value, for all plots alike."""
    fits = _fake_sweep_rows("seq_length", 512, "bf16", "forward", dict(triton=1.0, copy=1.05))
    assert report._fraction_top([fits]) == report.FRACTION_TOP
    beyond = _fake_sweep_rows("seq_length", 512, "bf16", "forward", dict(triton=1.0, copy=1.3))
    assert report._fraction_top([fits, beyond]) > 1.3


def test_restamp_marks_rows_and_the_summary_says_so(tmp_path, monkeypatch):
    """restamp gives the rows of one kernel-sources hash the device-code stamp, leaves other
    rows alone, and those its `leave` picks, records the note in run.json, and the summaries
    count those rows as current and print the note."""
    current = report.device_code_stamp()
    rows = _fake_results(dict(kernel="aaaa")) + _fake_sweep_rows("margin", 0, "bf16", "forward",
                                                            dict(triton=1.0, copy=1.0), kernel="bbbb")
    rows[0]["device_code"] = "old"
    out = _fake_artifacts(tmp_path, monkeypatch, rows)
    assert report.restamp(["gpu"], "aaaa", current, "generated code compared: identical",
                          leave=lambda r: r.get("device_code") == "old") == {
        "gpu": len(rows) - 3}
    stored = json.loads((out / "results.json").read_text())
    assert [r.get("device_code") for r in stored] == ["old"] + [current] * (len(rows) - 3) + [None, None]
    assert json.loads((out / "run.json").read_text())["restamped"][0]["note"] == "generated code compared: identical"
    report.regenerate()
    for summary in (out / "SUMMARY.md", tmp_path / "SUMMARY.md"):
        text = summary.read_text()
        assert f"gpu {len(rows) - 3} of {len(rows)}" in text and "generated code compared: identical" in text


def test_rows_line_counts_models_rows_by_timing():
    """The summaries' provenance line counts, per GPU, the models rows timed over rotating
    sets apart from the others (timed after an L2 flush), parameter-sweep rows left out."""
    rotating = _fake_models_rows("8B-TP1-q-8K", "bf16", "forward_kernel", dict(triton=1.0), 1.0)
    for r in rotating:
        r["timing"] = report.MODELS_TIMING
    flushed = _fake_models_rows("8B-TP1-k-8K", "bf16", "forward_kernel", dict(triton=1.0), 1.0)
    sweep = _fake_sweep_rows("margin", 0, "bf16", "forward", dict(triton=1.0, copy=1.0))
    line = report.current_rows_line({"a": rotating + flushed + sweep, "b": flushed})
    n, m = len(rotating), len(rotating) + len(flushed)
    assert f"rotating input sets (docs/benchmarks.md): a {n} of {m}, b 0 of {len(flushed)};" in line


def test_partial_run_without_te_keeps_the_te_of_kept_te_rows():
    """A part run without TE (the models sweep has no TE rows) after one with it: run.json's
    environment keeps the TE the kept rows were timed against, through further parts without
    TE too; without TE rows left, or with TE timed now, the run's own environment stands."""
    with_te = {"GPU": "g", "Transformer Engine": "TE C API (at /tmp/te)"}
    without = {"GPU": "g", "Transformer Engine": "not available (no TE)"}
    te_rows = _fake_sweep_rows("margin", 0, "bf16", "forward", dict(triton=1.0, te=2.0))
    models = _fake_models_rows("8B-TP1-q-8K", "bf16", "forward_kernel", dict(triton=1.0), 1.0)
    after = report.environment_with_kept_te(without, with_te, models, te_rows + models)
    assert after == without | {report.TE_OF_KEPT_ROWS: "TE C API (at /tmp/te)"}
    assert report.environment_with_kept_te(without, after, models, te_rows + models) == after
    assert report.environment_with_kept_te(without, with_te, models, models) == without
    assert report.environment_with_kept_te(with_te, without, te_rows, te_rows + models) == with_te
    assert report.environment_with_kept_te(with_te, with_te, models, te_rows + models) == with_te
    assert report.environment_with_kept_te(without, without, models, te_rows + models) == without
    assert report.te_of_rows(after).startswith("TE C API (at /tmp/te)")
    assert report.te_of_rows(with_te) == "TE C API (at /tmp/te)"


if __name__ == "__main__":
    run_benchmarks()
