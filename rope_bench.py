"""The benchmarks: `python pytest_benchmark_cuda_triton_comparison.py` (make bench) runs
`run_benchmarks`. Per sweep a workload (inputs and, per provider, the function a line times),
timed with triton.testing.do_bench or replayed from a CUDA graph; rope_bench_report.py writes the
summaries and plots from the stored rows.
"""

import functools
import itertools
import math
import os
import re
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

import rope_bench_report as report
from rope_bench_report import (
    ARTIFACTS_ROOT,
    BENCH_DEFAULTS,
    DTYPE_NAMES,
    KERNEL_MODES,
    MODEL_MODES,
    MODEL_POINTS,
    MODELS_TIMING,
    MODES,
    PEERS,
    PROVIDERS,
    SWEEPS,
)
from rope_test_support import ACCURACY_PATH, DEVICE, ON_GPU, plot_accuracy
from te_comparator import load_te_qkv_rope, load_te_rope
from triton_rotary_launch import set_rotary_kernel, set_rotary_qkv_kernel
from triton_rotary_main import RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb

BENCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

MIN_MODEL_INPUT_BYTES = 16 * 2 ** 20

_BENCH_CALLS = [0]


def _bench_ms(fn):
    """Median, 20th and 80th percentile in ms (CUDA events, L2 flushed between runs)."""
    import triton.testing
    _BENCH_CALLS[0] += 1
    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])


def _bench_input(params, dtype):
    s, b, h, d = (params["seq_length"] - params["margin"], params["batch_size"], params["head_num"],
                  params["hidden_size"])
    shape = (s, b, h, d) if params["tensor_format"] == "sbhd" else (b, s, h, d)
    t = torch.randn(shape, dtype=dtype, device=DEVICE)
    freqs = RotaryPositionEmbedding(d, params["rotary_percent"], interleaved=params["interleaved"],
                                    device=DEVICE)(params["seq_length"])
    return t, freqs


_COMPILED = {}


def _compiled(name, fn):
    """One torch.compile'd function per kind of call; dynamic shapes keep recompiles few."""
    if name not in _COMPILED:
        # The backward mode replays one graph's backward (retain_graph=True), which AOT
        # autograd's donated buffers forbid.
        import torch._functorch.config
        torch._functorch.config.donated_buffer = False
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


def _workload(sweep, params, dtype):
    """Input tensor of one benchmark point and, per provider, the function a line times
    (x -> output or tuple of outputs, autograd-aware), None where unavailable."""
    copy = lambda x: torch.empty_like(x).copy_(x)          # noqa: E731  the memory roofline
    if sweep == "qkv_seq_length":
        # GQA projection: 8 kv heads, 4 query heads each, d = hidden_size; v passes through.
        d, kv_heads = params["hidden_size"], 8
        split = [4 * d, d, d]
        x = torch.randn(params["qkv_seq_length"], params["batch_size"], kv_heads, sum(split), dtype=dtype,
                        device=DEVICE)
        freqs = RotaryPositionEmbedding(d, device=DEVICE)(params["qkv_seq_length"])
        te_qkv = load_te_qkv_rope()[0]
        unfused = lambda x, f: apply_fused_qkv_rotary_pos_emb(x, f, f, split, fused=False)  # noqa: E731
        return x, {"triton": lambda x: apply_fused_qkv_rotary_pos_emb(x, freqs, freqs, split),
                   "torch": lambda x: unfused(x, freqs),
                   "compile": lambda x: _compiled("qkv", unfused)(x, freqs),
                   "te": None if te_qkv is None else (lambda x: te_qkv(x, freqs, freqs, split)),
                   "copy": copy}
    if sweep == "thd_empty_sequences":
        # 16 packed sequences of seq_length / 2 tokens, then that many empty sequences, as
        # CUDA-graph users pad cu_seqlens: the cost should follow the tokens, not the slots.
        seq, full = params["seq_length"] // 2, 16
        cu = [i * seq for i in range(full + 1)] + [full * seq] * params["thd_empty_sequences"]
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        x = torch.randn(full * seq, params["head_num"], params["hidden_size"], dtype=dtype, device=DEVICE)
        freqs = RotaryPositionEmbedding(params["hidden_size"], device=DEVICE)(seq)
        kwargs = dict(tensor_format="thd", cu_seqlens=cu_seqlens)
        unfused = lambda x, f, cu: apply_rotary_pos_emb(x, f, "thd", cu_seqlens=cu, fused=False)  # noqa: E731
    else:
        x, freqs = _bench_input(params, dtype)
        kwargs = dict(tensor_format=params["tensor_format"], interleaved=params["interleaved"])
        fmt, inter = params["tensor_format"], params["interleaved"]
        unfused = lambda x, f, _: apply_rotary_pos_emb(x, f, fmt, interleaved=inter, fused=False)  # noqa: E731
    te_fn = load_te_rope()[0]
    cu_seqlens = kwargs.get("cu_seqlens")
    return x, {"triton": lambda x: apply_rotary_pos_emb(x, freqs, **kwargs),
               "torch": lambda x: unfused(x, freqs, cu_seqlens),
               "compile": lambda x: _compiled(f"rope-{sorted(kwargs)}-{kwargs.get('tensor_format')}-"
                                              f"{kwargs.get('interleaved')}", unfused)(x, freqs, cu_seqlens),
               "te": None if te_fn is None else (lambda x: te_fn(x, freqs, **kwargs)),
               "copy": copy}


def _time_point(fn, mode, t, is_copy):
    def as_tuple(out):
        return out if isinstance(out, tuple) else (out,)

    if mode == "forward":
        with torch.no_grad():
            return _bench_ms(lambda: fn(t))
    if is_copy:   # the roofline of a backward is one more copy
        return _bench_ms(lambda: fn(t)) if mode == "backward" else _bench_ms(lambda: (fn(t), fn(t)))
    x = t.detach().requires_grad_(True)
    grads = [torch.randn_like(o) for o in as_tuple(fn(x))]
    if mode == "backward":
        out = as_tuple(fn(x))
        return _bench_ms(lambda: torch.autograd.grad(out, x, grads, retain_graph=True))
    return _bench_ms(lambda: torch.autograd.grad(as_tuple(fn(x)), x, grads))


def _run_sweep(sweep, dtype_name, mode, results, progress):
    """Time one parameter sweep in one dtype and mode: at each of its points every provider
    (TE where it loads), one row each in `results`. `progress` ("[sweep i/N] name") starts
    the line printed per point."""
    te_loader = load_te_qkv_rope if sweep == "qkv_seq_length" else load_te_rope
    providers = [p for p in PROVIDERS if p != "te" or te_loader()[0] is not None]
    values = SWEEPS[sweep]
    for j, value in enumerate(values, 1):
        print(f"{progress}, {dtype_name}, {mode}, point {j}/{len(values)}: {sweep}={value}", flush=True)
        params = {**BENCH_DEFAULTS, sweep: value}
        for provider in providers:
            _time_sweep_point(sweep, params, dtype_name, mode, provider, results)


def _time_sweep_point(sweep, params, dtype_name, mode, provider, results):
    t, fns = _workload(sweep, params, BENCH_DTYPES[dtype_name])
    try:
        timing = _time_point(fns[provider], mode, t, is_copy=provider == "copy")
    except Exception as err:  # e.g. torch.compile failing on this torch: leave the point out
        print(f"  {PROVIDERS[provider]} failed: {err!r}", flush=True)
        return
    moved = 2 * t.numel() * t.element_size() * (2 if mode == "forward+backward" else 1)
    results.append(dict(sweep=sweep, x=params[sweep], dtype=dtype_name, mode=mode, provider=provider,
                        ms=timing[0], p20=timing[1], p80=timing[2], bytes=moved))
    print(f"  {PROVIDERS[provider]}: {timing[0]:.4f} ms ({moved / timing[0] / 1e6:.0f} GB/s)", flush=True)


def _environment():
    import datetime
    import subprocess

    import triton
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        driver = "unknown"
    te_fn, te_desc = load_te_rope()
    return {"GPU": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__,
            "Transformer Engine": (te_desc if te_fn is not None
                                   else f"{report.TE_NOT_AVAILABLE} ({te_desc})"),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


class _Line(NamedTuple):
    """One provider at one models point: kernels alone, a factory of the autograd step (built
    on first use, so that a provider failing to build it fails only the modes that need it),
    and the bytes one pass reads plus writes."""
    forward: Callable
    backward: Callable
    make_step: Callable
    moved: int


@functools.lru_cache(maxsize=None)
def _peers():
    """The peers importable here ({name: entry points}) and why the others are not."""
    found, missing = {}, {}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction, rope_backward, rope_forward
        found["liger"] = (LigerRopeFunction, rope_forward, rope_backward)
    except Exception as err:  # not installed, or a release that does not import on this Triton
        missing["liger"] = f"liger_kernel.ops.rope: {err!r}"
    try:
        from liger_kernel.ops.qwen2vl_mrope import (
            LigerQwen2VLMRopeFunction,
            qwen2vl_mrope_backward,
            qwen2vl_mrope_forward,
        )
        found["liger_mrope"] = (LigerQwen2VLMRopeFunction, qwen2vl_mrope_forward,
                                qwen2vl_mrope_backward)
    except Exception as err:
        missing["liger_mrope"] = f"liger_kernel.ops.qwen2vl_mrope: {err!r}"
    try:
        from flash_attn.ops.triton.rotary import apply_rotary
        found["flash_attn"] = apply_rotary
    except Exception as err:
        missing["flash_attn"] = f"flash_attn.ops.triton.rotary: {err!r}"
    return found, missing


@functools.lru_cache(maxsize=None)
def _flash_rope_function(apply_rotary, interleaved=False):
    """flash-attn's forward and backward (the conjugate rotation) as one autograd function,
    the way its own layer wires them, minus the layer's other imports (einops)."""
    class FlashRope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cos, sin, cu_seqlens, max_seqlen):
            ctx.save_for_backward(cos, sin, cu_seqlens)
            ctx.max_seqlen = max_seqlen
            return apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                interleaved=interleaved)

        @staticmethod
        def backward(ctx, grad):
            cos, sin, cu_seqlens = ctx.saved_tensors
            return (apply_rotary(grad, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=ctx.max_seqlen,
                                 interleaved=interleaved, conjugate=True), None, None, None, None)
    return FlashRope


def _autograd_step(fn, inputs):
    """One forward + backward of fn(*inputs) -> tuple of outputs through autograd. The incoming
    gradients are clones of the outputs, so they have the strides a real upstream gradient
    has (liger's backward copies a gradient that is not in its layout)."""
    leaves = tuple(x.detach().requires_grad_(True) for x in inputs)
    grads = tuple(o.detach().clone() for o in fn(*leaves))
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grads)


def _thd_lengths(point, shrink=1):
    """Sequence lengths of a thd point: `seqs` of `seq_len`, or seeded draws until `tokens`,
    uniform in [min_len, max_len] or, with `lognormal` (mu, sigma of the log), exp(N(mu, sigma))
    clipped to that range. `shrink` divides the number of sequences, then their length."""
    if "seq_len" in point:
        if point["seqs"] >= shrink:
            return [point["seq_len"]] * (point["seqs"] // shrink)
        return [max(point["seq_len"] * point["seqs"] // shrink, 1)]
    gen = torch.Generator().manual_seed(point["seed"])
    total, lengths = max(point["tokens"] // shrink, 1), []
    while sum(lengths) < total:
        if "lognormal" in point:
            mu, sigma = point["lognormal"]
            draw = math.exp(mu + sigma * float(torch.randn((), generator=gen)))
            lengths.append(min(max(round(draw), point["min_len"]), point["max_len"]))
        else:
            lengths.append(int(torch.randint(point["min_len"], point["max_len"] + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return lengths


def _flash_line(apply_rotary, x, freqs, cu_seqlens=None, max_seqlen=None, interleaved=False):
    """flash-attn on x [b, s, h, d] (or thd [t, h, d] with cu_seqlens): its cos/sin tables are
    [s, rotary_dim/2] in x's dtype, as its own rotary layer caches them (the angle of each
    pair, read from our table's layout)."""
    rows = freqs.view(freqs.shape[0], -1)
    half = rows[:, 0::2] if interleaved else rows[:, :rows.shape[1] // 2]
    cos, sin = half.cos().to(x.dtype), half.sin().to(x.dtype)
    flash = _flash_rope_function(apply_rotary, interleaved)
    return _Line(
        lambda: apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             interleaved=interleaved),
        lambda: apply_rotary(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                             interleaved=interleaved, conjugate=True),
        lambda: _autograd_step(lambda t: (flash.apply(t, cos, sin, cu_seqlens, max_seqlen),), (x,)),
        2 * x.nbytes)


def _liger_line(entry, q_storage, k_storage, angles, *extra):
    """Liger (its rope, or its qwen2vl_mrope with extra = (mrope_section,)) on q and k given as
    [b, s, h, d] storage. Its layout is Hugging Face's: [b, h, s, d] views of that storage (a
    contiguous [b, h, s, d] would cost it a copy), cos/sin of `angles` in q's dtype ([1, s, d],
    or [3, b, s, d] for M-RoPE: each axis' angles at that axis' positions). It rotates q and k
    in place, forward and backward, in one launch."""
    liger, forward, backward = entry
    q, k = q_storage.transpose(1, 2), k_storage.transpose(1, 2)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return _Line(
        lambda: forward(q, k, cos, sin, *extra), lambda: backward(q, k, cos, sin, *extra),
        lambda: _autograd_step(lambda a, b: tuple(liger.apply(a, b, cos, sin, *extra)), (q, k)),
        2 * (q.nbytes + k.nbytes))


def _ours_line(x, freqs, **kwargs):
    """Our kernel on x with `freqs` (a table or the module) and the call's other arguments."""
    return _Line(lambda: set_rotary_kernel(x, freqs, **kwargs),
                 lambda: set_rotary_kernel(x, freqs, backward=True, **kwargs),
                 lambda: _autograd_step(lambda t: (apply_rotary_pos_emb(t, freqs, **kwargs),), (x,)),
                 2 * x.nbytes)


def _model_workload(point, dtype, shrink=1):
    """Input of one models point (`x`, the tensor our kernel takes) and per provider its
    _Line; `skipped` says why a provider has none. `shrink` divides the token counts (so
    that a CPU check can build every point under the interpreter)."""
    d, layout = point["d"], point["layout"]
    new = functools.partial(torch.randn, dtype=dtype, device=DEVICE)
    peers, missing = _peers()
    lines, skipped = {}, dict(missing)
    if layout == "qkv":
        rope = RotaryPositionEmbedding(d, device=DEVICE)
        tokens, kv, per_kv = max(point["tokens"] // shrink, 1), point["kv"], point["q_per_kv"]
        split = [per_kv * d, d, d]
        x = new(tokens, 1, kv, sum(split))
        freqs = rope(tokens)
        grads = (new(tokens, 1, kv * per_kv, d), new(tokens, 1, kv, d), new(tokens, 1, kv, d))

        def ours(f):
            return _Line(lambda: set_rotary_qkv_kernel(x, f, f, split),
                         lambda: set_rotary_qkv_kernel(x, f, f, split, grads=grads),
                         lambda: _autograd_step(
                             lambda t: tuple(apply_fused_qkv_rotary_pos_emb(t, f, f, split)), (x,)),
                         2 * x.nbytes)
        lines["triton"], lines["triton_positions"] = ours(freqs), ours(rope)
        for name in PEERS:
            skipped.setdefault(name, "no fused-QKV entry point")
        return dict(x=x, lines=lines, skipped=skipped)

    if "mrope" in point:
        return _mrope_workload(point, dtype, shrink, peers, skipped)
    heads, interleaved = point["heads"], point.get("interleaved", False)
    partial = point.get("rotary_percent", 1.0) < 1
    rope = RotaryPositionEmbedding(d, point.get("rotary_percent", 1.0), interleaved=interleaved,
                                   device=DEVICE)
    if layout == "thd":
        lengths = _thd_lengths(point, shrink)
        tokens = sum(lengths)
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=DEVICE)
        x = new(tokens, heads, d)
        freqs = rope(max(lengths))
        fmt = dict(tensor_format="thd", cu_seqlens=cu)
    elif layout == "hf":
        # Hugging Face's layout: contiguous [b, h, s, d] (b = 1), passed as its bshd view.
        tokens = max(point["tokens"] // shrink, 1)
        x = new(1, heads, tokens, d).transpose(1, 2)
        freqs = rope(tokens)
        fmt = dict(tensor_format="bshd")
    else:
        tokens = max(point["tokens"] // shrink, 1)
        x = new(tokens, 1, heads, d)
        freqs = rope(tokens)
        fmt = dict(tensor_format="sbhd")
    if interleaved:
        fmt["interleaved"] = True

    lines["triton"], lines["triton_positions"] = _ours_line(x, freqs, **fmt), _ours_line(x, rope, **fmt)

    if "flash_attn" in peers:
        if layout == "thd":
            lines["flash_attn"] = _flash_line(peers["flash_attn"], x, freqs, cu, max(lengths),
                                              interleaved=interleaved)
        else:
            lines["flash_attn"] = _flash_line(peers["flash_attn"], x.view(1, tokens, heads, d)
                                              if layout == "sbhd" else x, freqs,
                                              interleaved=interleaved)
    if layout == "thd":
        skipped.setdefault("liger", "no varlen (cu_seqlens) entry point")
    elif "kv" not in point:
        skipped.setdefault("liger", "key tensor: liger rotates it with the query, at the query point")
    elif interleaved or partial:
        skipped.setdefault("liger", "no interleaved or partial rotary")
    elif "liger" in peers:
        # Liger takes [b, h, s, d] views of the bshd storage it is given: for the hf points,
        # x's own storage (contiguous [b, h, s, d]).
        k = new(1, point["kv"], tokens, d).transpose(1, 2) if layout == "hf" else new(1, tokens, point["kv"], d)
        q = x if layout == "hf" else new(1, tokens, heads, d)
        lines["liger"] = _liger_line(peers["liger"], q, k, freqs.view(1, freqs.shape[0], -1))
    return dict(x=x, lines=lines, skipped=skipped)


def _vlm_positions(tokens):
    """3-axis (time, height, width) positions [3, tokens] of one VLM sequence, as Qwen2-VL
    builds them: text tokens on the diagonal (all axes equal), then an image of a square grid
    of patches at one time step, its rows and columns counted from where the text stopped,
    then text again from past the image's largest position."""
    text = tokens // 8
    side = max(int(((tokens - 2 * text) ** 0.5)), 1)
    image = side * side
    head = torch.arange(text).expand(3, text)
    grid = torch.stack([torch.full((image,), text), text + torch.arange(image) // side,
                        text + torch.arange(image) % side])
    rest = tokens - text - image
    tail = (text + side + torch.arange(rest)).expand(3, rest)
    return torch.cat([head, grid, tail], dim=1)


def _mrope_workload(point, dtype, shrink, peers, skipped):
    """A models point of M-RoPE (`point["mrope"]` the section): ours from the module and
    3-axis positions, and from a table of each token's mixed angles (row = token); Liger's
    qwen2vl_mrope at the single-sequence query point (it rotates q and k together)."""
    d, heads = point["d"], point["heads"]
    new = functools.partial(torch.randn, dtype=dtype, device=DEVICE)
    rope = RotaryPositionEmbedding(d, mrope_section=point["mrope"], device=DEVICE)
    if point["layout"] == "thd":
        lengths = _thd_lengths(point, shrink)
        pos = torch.cat([_vlm_positions(n) for n in lengths], dim=1).to(DEVICE)
        fmt = dict(tensor_format="thd")
    else:
        pos = _vlm_positions(max(point["tokens"] // shrink, 1)).to(DEVICE)
        fmt = dict(tensor_format="sbhd")
    tokens = pos.shape[1]
    x = new(tokens, heads, d) if point["layout"] == "thd" else new(tokens, 1, heads, d)
    # Row i of the table: token i's angles, each pair at the position of its own axis.
    angles = pos.T[:, rope.pair_axis.long()] * rope.inv_freq                # [t, d/2]
    table = torch.cat([angles, angles], dim=-1).float()[:, None, None, :]
    row_of_token = dict(positions=torch.arange(tokens, device=DEVICE)) if point["layout"] == "thd" else {}

    lines = {"triton": _ours_line(x, table, **fmt, **row_of_token),
             "triton_positions": _ours_line(x, rope, **fmt, positions=pos)}
    for name in ("liger", "flash_attn"):
        skipped.setdefault(name, "no M-RoPE")
    if point["layout"] == "thd":
        skipped.setdefault("liger_mrope", "no varlen (cu_seqlens) entry point")
    elif "liger_mrope" in peers:
        angles = pos[:, None, :, None].float() * rope.inv_freq              # [3, 1, s, d/2]
        lines["liger_mrope"] = _liger_line(peers["liger_mrope"], x.view(1, tokens, heads, d),
                                           new(1, tokens, point["kv"], d),
                                           torch.cat([angles, angles], dim=-1), list(point["mrope"]))
    return dict(x=x, lines=lines, skipped=skipped)


def graphed(step):
    """`step` captured in a CUDA graph, after a warm-up on a side stream (compiles kernels and
    plans, and lets autograd set up its streams outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@triton.jit
def _triton_copy_kernel(OUT, X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(OUT + offs, tl.load(X + offs, mask=mask), mask=mask)


# A plain Triton copy: what a Triton kernel with the least work per byte reaches on this GPU.
# Small programs (1024 elements, 4 warps: 16 or 32 bytes per thread and access): the fastest
# of the block sizes tried on the H200.
TRITON_COPY_BLOCK, TRITON_COPY_WARPS = 1024, 4

# The models sweep times every provider as a model runs it: back to back, each call on inputs
# that are not in L2. Per point and dtype, as many input sets as move ROTATING_BYTES per pass
# (several times the 50-60 MB L2 of an H100 or H200), at most MAX_SETS; a provider's calls on
# every set are captured in one CUDA graph, replayed REPLAYS times between two events, and the
# graphs of all providers and modes are replayed round-robin ROUNDS times, so that a drift of
# the GPU's clocks falls on all of them. Timed instead one call at a time after an L2 flush
# (triton.testing.do_bench), the plain Triton copy reads 0.93-1.02 of an eager copy at the
# 16 MiB points on the H200, and our rows 0.044 lower to 0.063 higher (docs/benchmarks.md).
ROTATING_BYTES = 512 << 20
MAX_SETS = 32
REPLAYS, ROUNDS = 4, 25


def _rotating_workloads(point, dtype, shrink=1):
    """`_model_workload` of `point` once per input set: enough sets to move ROTATING_BYTES per
    pass (each set's x read and written once), at most MAX_SETS."""
    works = [_model_workload(point, dtype, shrink)]
    per_set = 2 * works[0]["x"].nbytes
    while len(works) < MAX_SETS and per_set * len(works) < ROTATING_BYTES:
        works.append(_model_workload(point, dtype, shrink))
    return works


def _over_sets(calls):
    """One call of each of `calls` (one per input set), in order: what a graph captures. The
    results are kept until the last call returns, so that inside a capture no call's output
    reuses the memory of the one before (each set writes its own output, as it reads its own
    input)."""
    return lambda: [call() for call in calls]


class _GraphWithBuffers:
    """A CUDA graph and the tensors it reads and writes that nothing else holds (a graph keeps
    their addresses, not the tensors)."""

    def __init__(self, step, buffers):
        self.graph, self.buffers = graphed(step), buffers

    def replay(self):
        self.graph.replay()


def _copy_graphs(moved, dtype, sets):
    """Per input set, `moved` bytes (read + written) copied into a buffer allocated once, as
    graphs: {"copy": torch's copy_ (memcpy nodes), "triton_copy": the plain Triton copy
    kernel}. A provider's fraction of copy speed is against the faster of the two."""
    n = moved // 2 // dtype.itemsize
    srcs = [torch.randn(n, device=DEVICE).to(dtype) for _ in range(sets)]
    dsts = [torch.empty_like(src) for src in srcs]

    def triton_copy(src, dst):
        return lambda: _triton_copy_kernel[(triton.cdiv(n, TRITON_COPY_BLOCK),)](
            dst, src, n, BLOCK=TRITON_COPY_BLOCK, num_warps=TRITON_COPY_WARPS)
    buffers = (srcs, dsts)
    return {"copy": _GraphWithBuffers(
                _over_sets([functools.partial(d.copy_, s) for s, d in zip(srcs, dsts)]), buffers),
            "triton_copy": _GraphWithBuffers(
                _over_sets([triton_copy(s, d) for s, d in zip(srcs, dsts)]), buffers)}


class EagerSteps:
    """Calls made eagerly, one per input set, replayed as a graph is (`replay()`): the
    forward+backward mode's autograd steps, whose host work is part of what that mode
    measures (and rope_qknorm_bench's lines that a graph cannot capture)."""

    def __init__(self, steps):
        self.steps = steps

    def replay(self):
        for step in self.steps:
            step()


def _provider_runner(lines, mode):
    """What one replay of `mode` runs for one provider (`lines`: its _Line per input set):
    a graph of the kernels alone or of the autograd step, or the eager steps."""
    if mode in KERNEL_MODES:
        with torch.no_grad():
            return graphed(_over_sets([ln.forward if mode == "forward_kernel" else ln.backward
                                       for ln in lines]))
    if mode == "forward+backward":
        return EagerSteps([ln.make_step() for ln in lines])
    return graphed(_over_sets([ln.make_step() for ln in lines]))


def replay_ms(runners, calls_per_replay, replays=REPLAYS, rounds=ROUNDS):
    """{key: (median, p20, p80) ms per call} of each of `runners` (anything with `replay()`
    that makes `calls_per_replay` calls), replayed `replays` times between two events,
    round-robin over `rounds` rounds."""
    times = {key: [] for key in runners}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for key, runner in runners.items():
            start.record()
            for _ in range(replays):
                runner.replay()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / (replays * calls_per_replay))
    _BENCH_CALLS[0] += len(runners)
    return {key: _median_p20_p80(v) for key, v in times.items()}


def _median_p20_p80(values):
    """(median, 20th, 80th percentile) of `values`, as do_bench's quantiles give them."""
    ordered = sorted(values)

    def at(q):      # linear interpolation between the closest ranks
        pos = q * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
    return at(0.5), at(0.2), at(0.8)


def _run_models(dtype_names, modes, results, stamp, shrink=1, points=None, progress="[models]",
                point_done=None):
    """Time every models point over rotating input sets (ROTATING_BYTES says how): per
    provider and mode its ms per call, and the ms of the faster device copy of the same bytes
    (one copy per pass; two for forward+backward). Inputs are built once per point and dtype
    and freed before the next. `progress` starts the line printed per point and dtype;
    `point_done()`, if given, is called after each point's dtype."""
    import gc
    points = points or MODEL_POINTS
    for j, point in enumerate(points, 1):
        for dtype_name in dtype_names:
            print(f"{progress}, {dtype_name}, modes {'/'.join(modes)}, point {j}/{len(points)}: "
                  f"{point['name']}", flush=True)
            works = _rotating_workloads(point, BENCH_DTYPES[dtype_name], shrink)
            x = works[0]["x"]
            if shrink == 1 and x.numel() * 2 < MIN_MODEL_INPUT_BYTES:
                raise ValueError(f"models point {point['name']}: input {x.numel() * 2} bytes in bf16, "
                                 f"below {MIN_MODEL_INPUT_BYTES}")
            for name, why in works[0]["skipped"].items():
                print(f"  models {point['name']} {dtype_name}: {name} left out: {why}", flush=True)
            # The kernels alone and the copies, round-robin; then each provider's autograd
            # steps on their own, right after their capture (the comment above `_built` says why).
            runners, moved_by, steps = {}, {}, {}
            for provider in works[0]["lines"]:
                lines = [w["lines"][provider] for w in works]
                moved_by[provider] = lines[0].moved
                for mode in modes:
                    into = runners if mode in KERNEL_MODES else steps
                    into[(provider, mode)] = lambda lines=lines, mode=mode: _provider_runner(lines, mode)
            runners = _built(runners, point["name"], dtype_name)
            for moved in sorted({2 * x.nbytes, *moved_by.values()}):
                for name, graph in _copy_graphs(moved, x.dtype, len(works)).items():
                    runners[(name, moved)] = graph
            timed = replay_ms(runners, len(works))
            del runners
            for key, build in steps.items():
                timed.update(replay_ms(_built({key: build}, point["name"], dtype_name), len(works)))
            for row in _models_rows(point["name"], dtype_name, modes, timed, moved_by,
                                    2 * x.nbytes, len(works)):
                results.append(row | stamp)
                print(f"  models {point['name']} {dtype_name} {row['mode']} {row['provider']}: "
                      f"{row['ms']:.4f} ms, {row['copy_ms'] / row['ms']:.3f} of copy "
                      f"({row['bytes'] / row['ms'] / 1e6:.0f} GB/s)", flush=True)
            del works, x, steps, timed
            gc.collect()
            if point_done is not None:
                point_done()
            if ON_GPU:
                torch.cuda.empty_cache()


# The autograd steps are timed one provider at a time, each right after its capture and
# before the next provider's: on the H200, replaying the CUDA graph of our autograd step after
# Liger's autograd step had been captured faulted (an illegal address; cause not found), while
# the graphs of the kernels alone replay in any order. So the steps' rows are not interleaved
# with the copies they are compared with.

def _built(builders, name, dtype_name):
    """{key: runner} of `builders` ({(provider, mode): function making the runner}), leaving
    out, with a line saying why, each one that fails to build."""
    runners = {}
    for (provider, mode), build in builders.items():
        try:
            runners[(provider, mode)] = build()
        except Exception as err:  # e.g. a path not written yet: leave the point out
            print(f"  models {name} {dtype_name} {mode}: {provider} failed: {err!r}"[:400], flush=True)
            try:   # let a failed launch or capture surface here, not in the timing
                if ON_GPU:
                    torch.cuda.synchronize()
            except Exception as sync_err:
                print(f"  after that failure: {sync_err!r}", flush=True)
    return runners


def _models_rows(name, dtype_name, modes, timed, moved_by, copy_bytes, sets):
    """The rows of one models point and dtype from `replay_ms`'s timings: keyed (provider,
    mode) for the providers (`moved_by`: the bytes one pass of each reads and writes), and
    ("copy", bytes) and ("triton_copy", bytes) for the copies of those bytes. The copy rows
    are of `copy_bytes` (x read and written): "copy" the faster of the two copies, the
    reference of every row. A forward+backward step is two passes: two copies."""
    rows = []
    for provider, moved in {"copy": copy_bytes, "triton_copy": copy_bytes, **moved_by}.items():
        fastest = min(timed[("copy", moved)], timed[("triton_copy", moved)])
        for mode in modes:
            passes = 2 if mode.startswith("forward+backward") else 1
            if provider in ("copy", "triton_copy"):
                timing = tuple(passes * t for t in (fastest if provider == "copy" else
                                                    timed[("triton_copy", moved)]))
            elif (provider, mode) in timed:
                timing = timed[(provider, mode)]
            else:           # its runner failed to build (said where it failed)
                continue
            rows.append(dict(sweep="models", x=name, dtype=dtype_name, mode=mode, provider=provider,
                             ms=timing[0], p20=timing[1], p80=timing[2], bytes=passes * moved,
                             copy_ms=passes * fastest[0], sets=sets, timing=MODELS_TIMING))
    return rows


def _autograd_overhead():
    """Forward + backward through apply_rotary_pos_emb vs the two kernel launches alone."""
    t, freqs = _bench_input(BENCH_DEFAULTS, torch.bfloat16)
    grad = torch.randn_like(t)
    x = t.detach().requires_grad_(True)
    kernels = _bench_ms(lambda: (set_rotary_kernel(t, freqs), set_rotary_kernel(grad, freqs, backward=True)))[0]
    autograd = _bench_ms(lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad))[0]
    return (f"autograd round trip at the defaults (bf16): {autograd:.4f} ms vs kernels alone "
            f"{kernels:.4f} ms: {100 * (autograd / kernels - 1):+.1f}% (target <= +5%)")


class _AllocateOnly(torch.autograd.Function):
    """The do-nothing autograd function the host target is measured against."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


def _cpu_us_per_call(fn, calls=2000):
    import time
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return elapsed * 1e6


def _host_overhead():
    """CPU time of eager calls on a small shape (launch-bound), in one process: one forward,
    Triton vs TE; the autograd round trip (forward + grad), ours vs an autograd function that
    only allocates (the target: at most 40 us more)."""
    t = torch.randn(128, 1, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    freqs = RotaryPositionEmbedding(64, device=DEVICE)(128)
    fns = {"Triton": lambda: apply_rotary_pos_emb(t, freqs)}
    te_fn, te_name = load_te_rope()
    if te_fn is not None:
        fns[f"TE ({te_name})"] = lambda: te_fn(t, freqs)
    report = [f"{name} {_cpu_us_per_call(fn):.1f} us" for name, fn in fns.items()]
    x, grad = t.detach().requires_grad_(True), torch.randn_like(t)
    empty = _cpu_us_per_call(lambda: torch.autograd.grad(_AllocateOnly.apply(x), x, grad))
    ours = _cpu_us_per_call(lambda: torch.autograd.grad(apply_rotary_pos_emb(x, freqs), x, grad))
    return ("CPU time per eager call, [128, 1, 8, 64] bf16: " + ", ".join(report)
            + f"; autograd round trip: Triton {ours:.1f} us, an allocate-only autograd.Function "
            f"{empty:.1f} us: {ours - empty:+.1f} us (target <= +40)")


WARM_UP_SECONDS = 2.0


def _warm_up():
    """Copies for WARM_UP_SECONDS before the first timing: a fresh process's first timing
    runs on a cold GPU (docs/benchmarks.md), and when it is a copy, every provider of that
    point reads as faster than the copy."""
    import time
    src = torch.empty(2 ** 27, dtype=torch.float32, device=DEVICE)      # 512 MB
    dst = torch.empty_like(src)
    deadline = time.perf_counter() + WARM_UP_SECONDS
    while time.perf_counter() < deadline:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()


def _parse_list(text, known, what):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def _parse_modes(text):
    """Requested modes, matched on letters and digits only (so `forward+backward_cuda_graph`
    names the graphed mode) and split into the parameter sweeps' and the models sweep's."""
    norm = lambda m: re.sub(r"[^a-z0-9]", "", m.lower())        # noqa: E731
    wanted = {norm(m) for m in text.split(",") if m.strip()}
    known = {norm(m) for m in MODES + MODEL_MODES}
    if wanted - known:
        raise SystemExit(f"unknown modes in {text!r} (known: {', '.join(MODES + MODEL_MODES)})")
    return [m for m in MODES if norm(m) in wanted], [m for m in MODEL_MODES if norm(m) in wanted]


def _parser():
    import argparse
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Results go to artifacts/<gpu>/ (h100, h200, else the device name); a run merges its "
               "points into that folder's results.json and regenerates its summary, plots and "
               "results.html, and artifacts/SUMMARY.md.")
    parser.add_argument("--sweeps",
                        help=f"comma-separated sweeps (default all: {','.join(SWEEPS)}; with "
                             f"--points, models alone)")
    parser.add_argument("--dtypes", default=",".join(BENCH_DTYPES),
                        help=f"comma-separated (default all: {','.join(BENCH_DTYPES)}); the parameter "
                             f"sweeps take {', '.join(DTYPE_NAMES)} of them, models all")
    parser.add_argument("--modes", default=",".join(MODES + MODEL_MODES),
                        help=f"comma-separated; {', '.join(MODES)} apply to the parameter sweeps, "
                             f"{', '.join(MODEL_MODES)} to models (default: all)")
    parser.add_argument("--points", default="",
                        help="comma-separated models points by name (default all; rope_bench_report's "
                             "MODEL_POINTS), to time again a few of them: the rows of the others stay")
    parser.add_argument("--summary-only", action="store_true",
                        help="only regenerate the summaries, every plot and CSV, and results.html from "
                             "artifacts/*/results.json (no GPU needed)")
    parser.add_argument("--accuracy", nargs="?", const=ACCURACY_PATH, metavar="PNG",
                        help="only run the accuracy study and write it to PNG and the .csv beside it "
                             f"(default {os.path.relpath(ACCURACY_PATH)}; the committed one comes from a GPU)")
    return parser


def _run_accuracy(path):
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--accuracy needs a CUDA GPU, or TRITON_INTERPRET=1 (numpy's sin/cos then "
                         "stand in for the GPU's: not for the committed plot)")
    rows = plot_accuracy(path)
    print(f"wrote {path} and its .csv ({len(rows)} positions)")


def _timed_rows(sweeps, dtypes, modes, model_modes, stamp, points=None, checkpoint=None):
    """Every requested sweep, dtype and mode, timed (the models sweep at `points`, default all):
    the result rows, each with `stamp`. `checkpoint(rows)`, if given, gets the rows so far
    (stamped) after each parameter sweep's dtype and mode and after each models point's
    dtype."""
    results = []

    def stamped():
        for r in results:
            r.update({k: v for k, v in stamp.items() if k not in r})
        return results

    def done_part():
        if checkpoint is not None:
            checkpoint(stamped())
    for i, sweep in enumerate(sweeps, 1):
        progress = f"[sweep {i}/{len(sweeps)}] {sweep}"
        if sweep != "models":
            for dtype_name in (d for d in dtypes if d in DTYPE_NAMES):
                for mode in modes:
                    _run_sweep(sweep, dtype_name, mode, results, progress)
                    done_part()
        elif model_modes:
            _run_models(dtypes, model_modes, results, stamp, points=points, progress=progress,
                        point_done=done_part)
        else:
            print(f"{progress} skipped: none of its modes ({', '.join(MODEL_MODES)}) requested", flush=True)
    return stamped()


EARLIER_EXTRAS = " (of an earlier run: the last run stopped before measuring it)"


def _save_results(out_dir, env, stamp, previous, previous_run, results, extras=None):
    """Merges `results` into out_dir's results.json, replacing the same points of earlier
    (partial) runs, and writes run.json: this run's environment and stamps, `extras` (the
    host measurements taken at the end; until then the earlier run's, marked
    EARLIER_EXTRAS), and the earlier runs' restamp notes (rows this run does not replace keep
    their stamps)."""
    if extras is None:
        extras = {k: v if v.endswith(EARLIER_EXTRAS) else v + EARLIER_EXTRAS
                  for k, v in previous_run.get("extras", {}).items()}
    fresh = {report.row_key(r) for r in results}
    merged = [r for r in previous if report.row_key(r) not in fresh] + results
    report.write_json(os.path.join(out_dir, "results.json"), merged)
    restamped = previous_run.get("restamped", [])
    env = report.environment_with_kept_te(env, previous_run.get("environment", {}), results, merged)
    report.write_json(os.path.join(out_dir, "run.json"),
                      {"environment": env} | ({"extras": extras} if extras else {})
                      | {"kernel": stamp["kernel"], "device_code": stamp["device_code"]}
                      | ({"restamped": restamped} if restamped else {}))


def _requested(args):
    """(sweeps, dtypes, modes, model modes, models points or None for all) of parsed
    arguments; --points without --sweeps times those points alone."""
    points = [report.MODEL_POINT_BY_NAME[n]
              for n in _parse_list(args.points, report.MODEL_POINT_BY_NAME, "models points")]
    default_sweeps = "models" if points else ",".join(SWEEPS)
    sweeps = _parse_list(args.sweeps or default_sweeps, SWEEPS, "sweeps")
    if points and "models" not in sweeps:
        raise SystemExit("--points names models points: add models to --sweeps")
    dtypes = _parse_list(args.dtypes, BENCH_DTYPES, "dtypes")
    return sweeps, dtypes, *_parse_modes(args.modes), points or None


def run_benchmarks(argv=None):
    import time
    args = _parser().parse_args(argv)
    if args.summary_only:
        report.regenerate()
        print(open(os.path.join(ARTIFACTS_ROOT, "SUMMARY.md")).read())
        return
    if args.accuracy:
        _run_accuracy(args.accuracy)
        return
    sweeps, dtypes, modes, model_modes, points = _requested(args)
    if not ON_GPU:
        raise SystemExit("make bench needs a CUDA GPU (the Triton interpreter is for correctness, not timing)")
    started = time.perf_counter()
    gpu = report.gpu_slug(torch.cuda.get_device_name())
    out_dir = os.path.join(ARTIFACTS_ROOT, gpu)
    os.makedirs(out_dir, exist_ok=True)
    env = _environment()
    print("environment:", env, "->", out_dir, flush=True)
    print("peers:", {k: "ok" for k in _peers()[0]}, _peers()[1], flush=True)
    stamp = dict(kernel=report.source_hash(), device_code=report.device_code_stamp(), date=env["date"])
    previous = report.load_json(os.path.join(out_dir, "results.json"), [])
    previous_run = report.load_json(os.path.join(out_dir, "run.json"), {})
    _warm_up()
    # Saved as the run goes: a run stopped midway keeps what it timed (`--summary-only` then
    # writes its summaries).
    results = _timed_rows(sweeps, dtypes, modes, model_modes, stamp, points,
                          checkpoint=lambda rows: _save_results(out_dir, env, stamp, previous,
                                                                previous_run, rows))
    extras = {"autograd overhead": _autograd_overhead(), "host overhead": _host_overhead()}
    _save_results(out_dir, env, stamp, previous, previous_run, results, extras)
    report.regenerate([gpu])
    print(open(os.path.join(out_dir, "SUMMARY.md")).read())
    print(f"{_BENCH_CALLS[0]} timings (do_bench calls and replay_ms runners), "
          f"{time.perf_counter() - started:.0f} s in all", flush=True)

