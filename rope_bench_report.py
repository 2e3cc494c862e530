"""The benchmark's report: what it measures, the stamp of its rows, its summaries and plots.

pytest_benchmark_cuda_triton_comparison.py times the points defined here and stores one row
per point, dtype, mode and provider in artifacts/<gpu>/results.json (its environment in
run.json). Everything else is made from those two files by `regenerate()`, without a GPU
(`python pytest_benchmark_cuda_triton_comparison.py --summary-only`):

- artifacts/<gpu>/SUMMARY.md, led by a short table (`headline`), then the details;
- artifacts/<gpu>/rope_<mode>_<dtype>_<sweep>.png and .csv: the parameter sweeps;
- artifacts/<gpu>/models_<dtype>_<mode>.csv, models_<dtype>_<kernel mode>.png and
  models_<dtype>_forward_backward_eager_vs_cuda_graph.png: the models sweep (real shapes);
- artifacts/<gpu>/results.html: every plot of the folder, grouped;
- artifacts/SUMMARY.md: the GPUs side by side.

Every plot shows speed as a fraction of copy speed: the ms of a device copy of the same bytes
over the provider's ms, so 1.0 is the memory roofline whatever the size of the point.
"""

import ast
import datetime
import functools
import hashlib
import html
import importlib.util
import inspect
import json
import math
import os
import re
import statistics
import sys
import textwrap
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ARTIFACTS_ROOT = os.path.join(HERE, "artifacts")
KERNEL_FILE = os.path.join(HERE, "triton_rotary_kernel.py")
LAUNCH_FILE = os.path.join(HERE, "triton_rotary_launch.py")
API_FILE = os.path.join(HERE, "triton_rotary_main.py")

# --- What the benchmark measures (the timing code in the test file reads these too) -----------

BENCH_DEFAULTS = dict(seq_length=4096, hidden_size=128, rotary_percent=1.0, batch_size=16,
                      head_num=32, margin=0, interleaved=False, tensor_format="sbhd")

# Per-GPU shapes of real models, one sequence (b = 1) per GPU unless packed (thd). Llama-3
# style heads: 8B = 32 query / 8 key heads, 70B = 64 / 8, d 128; at tensor parallelism 8 a GPU
# holds 1/8 of them. `kv` is the layer's key heads that go with a query tensor: liger rotates
# q and k in one call, so it runs at the query points with k of that many heads; the key
# points are our kernel's second call of the same layer. Every input is >= 16 MiB in bf16,
# so that launch latency does not decide the timings (checked when the sweep runs).
MODEL_POINTS = [
    dict(name="8B-TP1-q-8K", layout="sbhd", tokens=8192, heads=32, d=128, kv=8),
    dict(name="8B-TP1-k-8K", layout="sbhd", tokens=8192, heads=8, d=128),
    dict(name="70B-TP1-q-8K", layout="sbhd", tokens=8192, heads=64, d=128, kv=8),
    dict(name="8B-TP8-q-64K", layout="sbhd", tokens=65536, heads=4, d=128, kv=1),
    dict(name="8B-TP8-k-64K", layout="sbhd", tokens=65536, heads=1, d=128),
    dict(name="70B-TP8-q-128K", layout="sbhd", tokens=131072, heads=8, d=128, kv=1),
    dict(name="70B-TP8-k-128K", layout="sbhd", tokens=131072, heads=1, d=128),
    # Other head dims: a 1B-class model (32 q / 8 kv, d 64), phi-2-like (32 heads, no GQA,
    # d 80: not a power of two), Gemma-2B-like (8 q / 1 kv, d 256).
    dict(name="d64-h32-16K", layout="sbhd", tokens=16384, heads=32, d=64, kv=8),
    dict(name="d80-h32-16K", layout="sbhd", tokens=16384, heads=32, d=80, kv=32),
    dict(name="d256-h8-16K", layout="sbhd", tokens=16384, heads=8, d=256, kv=1),
    # Packed sequences: many short ones, and a seeded mix of lengths 16-1024 (SFT-style packing).
    dict(name="thd-2048x64-h8", layout="thd", seqs=2048, seq_len=64, heads=8, d=128),
    dict(name="thd-mixed-16K-h32", layout="thd", tokens=16384, min_len=16, max_len=1024, seed=0,
         heads=32, d=128),
    # Fused QKV [s, 1, kv, (q_per_kv + 2) * d]: 8B at TP1 (8 kv x 4 q), 70B at TP8 (1 kv x 8 q).
    dict(name="qkv-8B-TP1-8K", layout="qkv", tokens=8192, kv=8, q_per_kv=4, d=128),
    dict(name="qkv-70B-TP8-32K", layout="qkv", tokens=32768, kv=1, q_per_kv=8, d=128),
    # M-RoPE of a 7B vision-language model (Qwen2-VL-7B: 28 query / 4 key heads, d 128,
    # mrope_section 16/24/24), 3-axis positions of text around an image (_vlm_positions): one
    # sequence of 8K tokens (its key heads alone are under 16 MiB: they are the thd key point),
    # and thd with 8 such sequences. The table path reads a per-token table of the mixed angles.
    dict(name="VLM-7B-q-8K", layout="sbhd", tokens=8192, heads=28, d=128, kv=4, mrope=(16, 24, 24)),
    dict(name="VLM-7B-q-thd-8x8K", layout="thd", seqs=8, seq_len=8192, heads=28, d=128,
         mrope=(16, 24, 24)),
    dict(name="VLM-7B-k-thd-8x8K", layout="thd", seqs=8, seq_len=8192, heads=4, d=128,
         mrope=(16, 24, 24)),
    # Other model families: a head count that is not a power of two (Qwen2.5-14B: 40 query / 8
    # key heads), head dim 96 (Phi-3-mini: 32 heads), Hugging Face's contiguous [b, h, s, d]
    # passed as its bshd view (`hf`), partial rotary (GPT-NeoX / Pythia: a quarter of d 128),
    # interleaved partial rotary (ChatGLM: half of d 128), MLA's RoPE parts (DeepSeek-V3: 128
    # query heads and one shared key head of 64 interleaved channels) and two heads of d 64.
    dict(name="h40-q-8K", layout="sbhd", tokens=8192, heads=40, d=128, kv=8),
    dict(name="d96-h32-16K", layout="sbhd", tokens=16384, heads=32, d=96, kv=32),
    dict(name="hf-view-q-8K", layout="hf", tokens=8192, heads=32, d=128, kv=8),
    dict(name="partial-quarter-h32-8K", layout="sbhd", tokens=8192, heads=32, d=128, kv=32,
         rotary_percent=0.25),
    dict(name="interleaved-half-h32-8K", layout="sbhd", tokens=8192, heads=32, d=128, kv=2,
         rotary_percent=0.5, interleaved=True),
    dict(name="MLA-q-rope-4K", layout="sbhd", tokens=4096, heads=128, d=64, kv=1, interleaved=True),
    dict(name="MLA-k-rope-128K", layout="sbhd", tokens=131072, heads=1, d=64, interleaved=True),
    dict(name="h2-d64-64K", layout="sbhd", tokens=65536, heads=2, d=64),
    # Packed batches: lognormal lengths (median e^5.5, about 245 tokens; SFT-like) over 16
    # heads, thousands of 32-token sequences, and a TP 8 key packed (one head per token).
    dict(name="thd-lognormal-32K-h16", layout="thd", tokens=32768, min_len=8, max_len=4096,
         lognormal=(5.5, 1.0), seed=0, heads=16, d=128),
    dict(name="thd-4096x32-h8", layout="thd", seqs=4096, seq_len=32, heads=8, d=128),
    dict(name="thd-2048x64-h1", layout="thd", seqs=2048, seq_len=64, heads=1, d=128),
]

MODEL_POINT_BY_NAME = {p["name"]: p for p in MODEL_POINTS}

SWEEPS = {
    "seq_length": [512, 1024, 2048, 4096],
    "hidden_size": [128, 256, 512],
    "rotary_percent": [0.5, 1.0],
    "batch_size": [2, 4, 8, 16],
    "head_num": [8, 16, 32, 64],
    "margin": [0, 10, 33, 77],
    "interleaved": [False, True],
    "tensor_format": ["sbhd", "bshd"],
    "thd_empty_sequences": [0, 16, 48, 112],
    "qkv_seq_length": [1024, 2048, 4096],
    "models": [p["name"] for p in MODEL_POINTS],
}
PARAMETER_SWEEPS = [s for s in SWEEPS if s != "models"]
DTYPE_NAMES = ("bf16", "fp32")            # the parameter sweeps
# The models sweep also times fp16 (the half precision TE and inference stacks serve).
MODEL_DTYPE_NAMES = ("bf16", "fp16", "fp32")
MODES = ("forward", "backward", "forward+backward")
# The models sweep times the kernels alone (replayed from a CUDA graph), the eager autograd
# step, and the same step replayed from a CUDA graph: eager minus graph is what the host costs
# per step.
KERNEL_MODES = ("forward_kernel", "backward_kernel")
EAGER_STEP, GRAPHED_STEP = "forward+backward", "forward+backward (CUDA graph)"
MODEL_MODES = KERNEL_MODES + (EAGER_STEP, GRAPHED_STEP)
# The `timing` field of a models row timed over rotating input sets (rope_bench.ROTATING_BYTES);
# rows without it were timed one call at a time after an L2 flush (docs/benchmarks.md says how
# the two compare).
MODELS_TIMING = "rotating sets"

PROVIDERS = {"torch": "Torch Native", "compile": "torch.compile", "te": "Transformer Engine",
             "triton": "Triton", "copy": "Device copy"}
MODEL_PROVIDERS = {"triton": "Triton (freqs table)", "triton_positions": "Triton (positions)",
                   "liger": "Liger", "flash_attn": "flash-attn (Triton)",
                   "liger_mrope": "Liger M-RoPE (qwen2vl_mrope)", "triton_copy": "Triton copy"}
MODEL_COLORS = {"triton": "tab:blue", "triton_positions": "tab:cyan", "liger": "tab:red",
                "flash_attn": "tab:purple", "liger_mrope": "tab:brown", "triton_copy": "tab:gray"}
OURS = ("triton", "triton_positions")
PEERS = ("liger", "flash_attn", "liger_mrope")
TARGET_FRACTION = 0.97

# The y axis of every fraction-of-copy plot (sweeps and models alike): 0 to FRACTION_TOP, so
# that plots compare at a glance and a bar's height is its speed. Every fraction measured so
# far is below 1.06; should one exceed FRACTION_TOP, `regenerate` raises the top of all
# plots together to hold it (`_fraction_top`).
FRACTION_TOP = 1.15

# Sweep lines: ours last and on top (zorder), thick with filled markers; the device copy is
# the reference line at 1.0, thin and dashed underneath.
SWEEP_STYLES = {
    "torch": dict(color="tab:gray", marker="s", lw=1.5, ms=5, zorder=3),
    "compile": dict(color="tab:orange", marker="^", lw=1.5, ms=5, zorder=3),
    "te": dict(color="tab:green", marker="D", lw=1.8, ms=5, zorder=4),
    "triton": dict(color="tab:blue", marker="o", lw=2.8, ms=8, zorder=6),
}
COPY_STYLE = dict(color="black", ls="--", lw=1.0, zorder=2)


# --- The stamp of a row: the device code and the launch rule that timed it ---------------------

def source_hash():
    """Short hash of the whole kernel, launcher and API sources (the `kernel` field of a row). Any edit
    changes it, host code included: it says which sources ran, not whether timing could
    have changed (that is `device_code_stamp`)."""
    digest = hashlib.sha256()
    for path in (KERNEL_FILE, LAUNCH_FILE, API_FILE):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def device_code_stamp(kernel_file=KERNEL_FILE, launch_file=LAUNCH_FILE):
    """Short hash of what decides a timing (the `device_code` field of a row):

    (a) the code of every @triton.jit and @triton.constexpr_function function defined in
        `kernel_file` (by default triton_rotary_kernel.py), in name order, decorator included
        (its arguments, e.g. do_not_specialize, shape the compiled variants);
    (b) that module's tl.constexpr globals, name and value (the kernels read them as
        compile-time constants);
    (c) the launch rule: the code of `launch_config` in `launch_file` (by default
        triton_rotary_launch.py), the values of the plain module constants it reads, and the
        module's LaunchRule values (GPU_RULE, INTERPRETER_RULE: the tile sizes and warps it is
        given).

    The values are those of a GPU process: both modules are loaded afresh with the interpreter
    off, so the stamp computed here (TRITON_INTERPRET=1, where _HARDWARE_SINCOS is false) is
    the one the benchmark stamped.

    Code is hashed as its syntax tree (`_code`): comments, docstrings and layout are left out.
    Left out on purpose, because they cannot change what the GPU runs or how it is launched,
    only whether and when it runs: the host checks (check_rope_args and the other checks,
    error messages), the plan cache (_PLANS, _cached_plan: a hit and a miss launch the same
    kernel), the launcher wrapper, and the API (triton_rotary_main.py: autograd functions,
    RotaryPositionEmbedding's tables, custom ops). Host time per call is a separate figure
    (run.json extras), and eager timings include it: a host-only change can move the eager
    forward+backward rows, which SUMMARY.md calls host-bound for that reason. Also left out,
    though they shape a launch, are the choices made around launch_config: which tile size a
    plan builder asks it for (inside _make_plan, among the checks) and the grid order
    (_program_grid); a change there must be judged by hand before rows are restamped."""
    kernel, launch = _modules_as_on_gpu(kernel_file, launch_file)
    digest = hashlib.sha256()
    for part in _device_code_parts(kernel, launch):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def _modules_as_on_gpu(kernel_file, launch_file):
    """Fresh copies of the kernel and launch modules, loaded with TRITON_INTERPRET=0 (Triton's
    @jit then builds JITFunctions; nothing is compiled, so no GPU is needed). The launch copy
    imports the kernel copy; the process's own modules are left as they are."""
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_kernel = sys.modules.get("triton_rotary_kernel")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        kernel = _load_module("_rope_kernel_for_stamp", kernel_file)
        sys.modules["triton_rotary_kernel"] = kernel
        launch = _load_module("_rope_launch_for_stamp", launch_file)
    finally:
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_kernel is None:
            sys.modules.pop("triton_rotary_kernel", None)
        else:
            sys.modules["triton_rotary_kernel"] = saved_kernel
    return kernel, launch


def _load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jit_types():
    """Types of the kernel module's device code: @triton.jit functions (JITFunction, or the
    interpreter's InterpretedFunction) and @triton.constexpr_function's (ConstexprFunction,
    Triton 3.5 and later), which work out compile-time values such as the compute dtype."""
    from triton.runtime import jit
    types = [jit.JITFunction, jit.ConstexprFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        types.append(InterpretedFunction)
    except ImportError:
        pass
    return tuple(types)


def _device_code_parts(kernel, launch):
    """The texts device_code_stamp hashes, in a fixed order."""
    import triton.language as tl
    names = vars(kernel)
    jit = [n for n in sorted(names) if isinstance(names[n], _jit_types())
           and getattr(names[n].fn, "__module__", None) == kernel.__name__]
    for name in jit:
        yield f"jit {name}\n{_code(names[name].fn)}"
    for name in sorted(n for n in names if isinstance(names[n], tl.constexpr)):
        yield f"constexpr {name} = {names[name].value!r}"
    yield f"launch_config\n{_code(launch.launch_config)}"
    for name, value in _launch_constants(launch):
        yield f"constant {name} = {value!r}"


def _code(fn):
    """A function's code as its syntax tree, without docstrings, comments or layout: editing
    an explanation does not make rows of the same code look stale."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return _canonical(tree)


def _canonical(node):
    """A syntax tree as text without its empty fields: the same on every Python the project
    runs on (ast.dump differs between versions: 3.12 adds FunctionDef.type_params, and
    ast.unparse quotes f-strings differently), so a stamp computed here matches the one the
    benchmark computed on the GPU machine's Python."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(v) for v in node) + "]"
    return repr(node)


def _code_names(fn):
    """Global names a function's code reads, its nested functions' included."""
    found, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        found.update(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    return found


def _launch_constants(module):
    """(name, value) of the plain module constants launch_config reads, and of the module's
    LaunchRule values (the constants of the launch rule, as launch_config takes them)."""
    names = _code_names(module.launch_config)
    plain = (bool, int, float, str)
    rule_type = getattr(module, "LaunchRule", None)
    return [(n, getattr(module, n)) for n in sorted(set(names) | set(vars(module)))
            if (n in names and isinstance(getattr(module, n, None), plain))
            or (rule_type is not None and isinstance(getattr(module, n, None), rule_type))]


def restamp(gpu_dirs, old_kernel_hash, new_stamp, note, leave=None):
    """Give the rows measured with kernel sources `old_kernel_hash` the device-code stamp
    `new_stamp`, for when the device code and launch rule of those sources were checked to be
    the ones `new_stamp` stands for; `note` says how that was checked. `leave`, if given, picks
    the rows among them whose launches the change does touch: they keep their stamp (and so
    count as measured with other device code). Each folder's run.json records it (field
    `restamped`), and the summaries print it. `gpu_dirs`: folder names under artifacts/ or
    paths. Returns {folder: rows restamped}."""
    done = {}
    for gpu_dir in gpu_dirs:
        folder = os.path.join(ARTIFACTS_ROOT, gpu_dir)
        results_path, run_path = os.path.join(folder, "results.json"), os.path.join(folder, "run.json")
        results = load_json(results_path, [])
        matching = [r for r in results if r.get("kernel") == old_kernel_hash
                    and not (leave and leave(r))]
        for r in matching:
            r["device_code"] = new_stamp
        done[gpu_dir] = len(matching)
        if not matching:
            continue
        write_json(results_path, results)
        run = load_json(run_path, {})
        run.setdefault("restamped", []).append(dict(
            kernel=old_kernel_hash, device_code=new_stamp, rows=len(matching), note=note,
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
        write_json(run_path, run)
    return done


# --- Reading the results ------------------------------------------------------------------------

def load_json(path, default):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def write_json(path, value):
    """Writes `value` to `path` whole or not at all (through a temporary file beside it): a
    run stopped while saving keeps the file it had."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


TE_OF_KEPT_ROWS = "TE of the TE rows"
TE_NOT_AVAILABLE = "not available"      # how run.json's "Transformer Engine" begins without TE


def _ran_without_te(env):
    return env.get("Transformer Engine", TE_NOT_AVAILABLE).startswith(TE_NOT_AVAILABLE)


def environment_with_kept_te(env, previous_env, fresh_rows, merged_rows):
    """run.json's environment after a partial run: `env` (this run's), and where this run had
    no TE but kept TE rows of an earlier one (a `--sweeps models` part, which has no TE rows,
    run without TE after the parameter sweeps), the TE those rows were timed against, from the
    earlier run's environment, so that the summary does not read as if TE had not been
    measured."""
    if (not _ran_without_te(env) or any(r["provider"] == "te" for r in fresh_rows)
            or not any(r["provider"] == "te" for r in merged_rows)):
        return env
    kept = previous_env.get(TE_OF_KEPT_ROWS)
    if kept is None and not _ran_without_te(previous_env):
        kept = previous_env["Transformer Engine"]
    return env | {TE_OF_KEPT_ROWS: kept} if kept else env


def te_of_rows(env):
    """The TE a folder's TE rows were timed against: its last run's, or the one
    `environment_with_kept_te` kept where that part ran without TE."""
    kept = env.get(TE_OF_KEPT_ROWS)
    return f"{kept} (the last part ran without it)" if kept else env.get("Transformer Engine", "-")


def device_header():
    """'device <GPU>  torch <version>  triton <version>': how an A/B script's log begins."""
    import torch
    import triton
    return (f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
            f"{triton.__version__}")


def flat_outputs(result):
    """A call's tensor results (one tensor, or the tensors of a tuple or list) as one float32
    vector: what an A/B script compares, bit for bit, between the variants of a line."""
    import torch
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    return torch.cat([o.float().flatten() for o in outputs if isinstance(o, torch.Tensor)])


class ScriptLog:
    """What an A/B script prints, kept with the rows it measures, for OUT/<name>.log and
    OUT/<name>.json."""

    def __init__(self):
        self.lines, self.rows = [], []

    def say(self, msg):
        print(msg, flush=True)
        self.lines.append(msg)

    def write(self, out_dir, name):
        with open(os.path.join(out_dir, f"{name}.log"), "w") as f:
            f.write("\n".join(self.lines) + "\n")
        write_json(os.path.join(out_dir, f"{name}.json"), self.rows)


def row_key(r):
    return (r["sweep"], str(r["x"]), r["dtype"], r["mode"], r["provider"])


def gpu_slug(device_name):
    name = device_name.lower()
    for known in ("h100", "h200"):
        if known in name:
            return known
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def mode_slug(mode):
    return re.sub(r"[^a-z0-9]+", "_", mode.lower()).strip("_")


def sweep_plot_name(sweep, dtype, mode):
    return f"rope_{mode.replace('+', '_')}_{dtype}_{sweep}"


def gpu_dirs_with_results():
    return sorted(d for d in os.listdir(ARTIFACTS_ROOT)
                  if os.path.exists(os.path.join(ARTIFACTS_ROOT, d, "results.json")))


def is_current(row):
    return row.get("device_code") == device_code_stamp()


def fraction(row):
    """Fraction of copy speed of a models row (its copy's ms / its ms), None without one."""
    return row["copy_ms"] / row["ms"] if row and row.get("copy_ms") and row["ms"] > 0 else None


def table_rows_read(point):
    """Rows of the float32 angle table that the table path must read from memory at a models
    point, at least once each: one per token where every token has a row of its own (one
    sequence, M-RoPE's per-token tables, the fused QKV, whose q and k share one table), one
    per position for packed sequences (at most the longest sequence's, bounded by max_len)."""
    if point["layout"] == "thd" and "mrope" not in point:
        return point["seq_len"] if "seq_len" in point else min(point["tokens"], point["max_len"])
    return point["seqs"] * point["seq_len"] if "seqs" in point else point["tokens"]


def table_bound(row):
    """The table path's own bound at a models row, as a fraction of copy speed: the bytes a
    copy moves over those plus the table's (`table_rows_read` rows of d2 float32 angles per
    pass); None for other rows."""
    point = MODEL_POINT_BY_NAME.get(str(row.get("x")))
    if row.get("sweep") != "models" or point is None or not row.get("bytes"):
        return None
    passes = 2 if row["mode"].startswith(EAGER_STEP) else 1
    rotary_dim = int(point["d"] * point.get("rotary_percent", 1.0))
    table = passes * table_rows_read(point) * rotary_dim * 4
    return row["bytes"] / (row["bytes"] + table)


def model_table(results):
    """{(point, dtype, mode): {provider: row}} of the models rows, in table order."""
    table = {}
    for r in results:
        if r["sweep"] == "models":
            table.setdefault((str(r["x"]), r["dtype"], r["mode"]), {})[r["provider"]] = r
    names = [p["name"] for p in MODEL_POINTS]

    def order(key):
        point, dtype, mode = key
        return (names.index(point) if point in names else len(names), point,
                MODEL_DTYPE_NAMES.index(dtype) if dtype in MODEL_DTYPE_NAMES else 9,
                MODEL_MODES.index(mode) if mode in MODEL_MODES else 9)
    return {k: table[k] for k in sorted(table, key=order)}


def sweep_table(results, sweep):
    """{(x, dtype, mode): {provider: fraction of copy speed}} of one parameter sweep, x in
    the sweep's order (the copy row's time over the provider's)."""
    by_key = {row_key(r): r for r in results if r["sweep"] == sweep}
    table = {}
    for (_, x, dtype, mode, provider), r in by_key.items():
        copy = by_key.get((sweep, x, dtype, mode, "copy"))
        if copy and r["ms"] > 0:
            table.setdefault((x, dtype, mode), {})[provider] = copy["ms"] / r["ms"]
    values = [str(v) for v in SWEEPS.get(sweep, [])]
    return {k: table[k] for k in sorted(table, key=lambda k: (
        values.index(k[0]) if k[0] in values else len(values), k[0]) + k[1:])}


def best_peer(rows):
    """(fraction of copy, provider) of the fastest peer of a models point-mode, or None (by
    fraction of copy, since liger moves other bytes than we do)."""
    peers = [(f, p) for p in PEERS if (f := fraction(rows.get(p))) is not None]
    return max(peers) if peers else None


# --- The short table: where our two paths stand ------------------------------------------------

class PathStats(NamedTuple):
    """One of our paths over a set of point-modes: how many, how many reach TARGET_FRACTION,
    the median and minimum fraction of copy speed; how many have a peer and how many of those
    we match or beat; the same against TE, with our smallest speedup over it."""
    points: int
    at_target: int
    median: float
    minimum: float
    with_peer: int
    at_peer: int
    with_te: int = 0
    at_te: int = 0
    min_te_speedup: float = float("nan")


def _path_stats(fractions, peer_fractions, te_speedups):
    """PathStats of `fractions`, `peer_fractions` (ours, best peer's) and `te_speedups` (TE ms
    / our ms); None without fractions."""
    if not fractions:
        return None
    return PathStats(len(fractions), sum(f >= TARGET_FRACTION for f in fractions),
                     statistics.median(fractions), min(fractions), len(peer_fractions),
                     sum(ours >= peer for ours, peer in peer_fractions), len(te_speedups),
                     sum(s >= 1.0 for s in te_speedups), min(te_speedups, default=float("nan")))


def kernels_overview(table):
    """{path of ours: PathStats or None} over the models point-modes timed as kernels alone,
    fractions from each row's own copy time; a TE row, where a point has one, counts as TE."""
    overview = {}
    for ours in OURS:
        fractions, peers, te = [], [], []
        for (_, _, mode), rows in table.items():
            frac = fraction(rows.get(ours))
            if mode not in KERNEL_MODES or frac is None:
                continue
            fractions.append(frac)
            if (best := best_peer(rows)) is not None:
                peers.append((frac, best[0]))
            if "te" in rows:
                te.append(rows["te"]["ms"] / rows[ours]["ms"])
        overview[ours] = _path_stats(fractions, peers, te)
    return overview


def table_path_of_bound(table):
    """The table path's fraction of its own bound (`table_bound`) at every models point-mode
    timed as kernels alone."""
    return [frac / bound for (_, _, mode), rows in table.items()
            if mode in KERNEL_MODES and (frac := fraction(rows.get("triton"))) is not None
            and (bound := table_bound(rows["triton"])) is not None]


def sweeps_overview(results):
    """PathStats of our table path ("triton") over every parameter-sweep point, dtype and mode,
    against TE where TE was measured (the sweeps have no peers); None without such rows."""
    measured = [(frac, speed) for _, frac, speed in _sweep_rows({row_key(r): r for r in results})
                if not math.isnan(frac)]
    return _path_stats([frac for frac, _ in measured], [],
                       [speed for _, speed in measured if not math.isnan(speed)])


HEADLINE_CAPTION = (
    "Our two paths: Triton (freqs table), TE's API, and Triton (positions), the angles made in the "
    "kernel. models: the point-modes timed as kernels alone, every dtype; parameter sweeps: the "
    "table path at every point, dtype and mode, against TE where TE was timed too.")


def headline(results):
    """The short table that leads a GPU's summary (markdown lines; HEADLINE_CAPTION says what
    it holds)."""
    lines = ["| scope | path | point-modes | at >= " + f"{TARGET_FRACTION} of copy | median | minimum "
             "| at or above the best peer | at or above TE (min speedup) |",
             "|---|---|---|---|---|---|---|---|"]
    table = model_table(results)
    kernels = kernels_overview(table)
    scoped = [("models, kernels alone", MODEL_PROVIDERS[p], kernels[p]) for p in OURS]
    scoped.insert(1, ("models, kernels alone", MODEL_PROVIDERS["triton"] + ", of its own bound",
                      _path_stats(table_path_of_bound(table), [], [])))
    scoped.append(("parameter sweeps, all modes", MODEL_PROVIDERS["triton"], sweeps_overview(results)))
    for scope, path, stats in scoped:
        if stats is None:
            lines.append(f"| {scope} | {path} | 0 | - | - | - | - | - |")
            continue
        peer = f"{stats.at_peer} / {stats.with_peer}" if stats.with_peer else "no peer measured"
        te = (f"{stats.at_te} / {stats.with_te} ({stats.min_te_speedup:.2f}x)" if stats.with_te
              else "no TE rows")
        lines.append(f"| {scope} | {path} | {stats.points} | {stats.at_target} / {stats.points} | "
                     f"{stats.median:.3f} | {stats.minimum:.3f} | {peer} | {te} |")
    return lines


def current_rows_line(data):
    """One line: how many rows of each GPU are of the current device code. `data`: {gpu:
    rows}."""
    counts = ", ".join(f"{g} {sum(map(is_current, rows))} of {len(rows)}" for g, rows in data.items())
    models = {g: [r for r in rows if r["sweep"] == "models"] for g, rows in data.items()}
    timing = ", ".join(f"{g} {sum(r.get('timing') == MODELS_TIMING for r in rows)} of {len(rows)}"
                       for g, rows in models.items())
    return (f"Rows of the current device code ({device_code_stamp()}, `device_code_stamp` in "
            f"rope_bench_report.py): {counts}. Rows without that stamp predate it until rerun "
            f"or restamped. Models rows timed over rotating input sets (docs/benchmarks.md): "
            f"{timing}; the others were timed one call at a time after an L2 flush, which read "
            "the H200's rows 0.044 lower to 0.063 higher than rotating sets do.")


def restamp_lines(run):
    """What restamp recorded in a run.json, one line each."""
    return [f"- restamped {r['rows']} rows of kernel sources {r['kernel']} as device code "
            f"{r['device_code']} ({r['date']}): {r['note']}" for r in run.get("restamped", [])]


# --- A GPU's SUMMARY.md ---------------------------------------------------------------------------

def _provenance(results):
    """Lines saying which device code measured which rows."""
    groups = {}
    for r in results:
        groups.setdefault(r.get("device_code"), []).append(r)
    lines = []
    for stamp, rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        sources = sorted({str(r.get("kernel")) for r in rows})
        what = (f"the current device code ({stamp})" if stamp == device_code_stamp() else
                f"other device code ({stamp}): rerun to refresh" if stamp else
                "no device-code stamp (not counted as current); kernel sources "
                + ", ".join(sources))
        dates = sorted({r["date"] for r in rows if r.get("date")})
        lines.append(f"- {len(rows)} rows measured with {what}; sweeps: "
                     f"{', '.join(sorted({r['sweep'] for r in rows}))}"
                     + (f"; runs of {', '.join(dates)}" if dates else ""))
    return lines


# An eager forward+backward step that runs below this share of the speed of the same step
# replayed from a CUDA graph is bound by the host (launches and autograd), not by its kernels.
HOST_BOUND_SHARE = 0.9


def _host_bound(table, key, provider):
    """The fraction of copy speed of `provider`'s CUDA-graph step twin where its eager step at
    `key` (a model_table key) is host-bound (below HOST_BOUND_SHARE of the twin's speed), else
    None (not an eager step, no twin, or bound by its kernels)."""
    point, dtype, mode = key
    if mode != EAGER_STEP:
        return None
    eager = fraction(table[key].get(provider))
    graphed = fraction(table.get((point, dtype, GRAPHED_STEP), {}).get(provider))
    if eager is None or graphed is None or eager >= HOST_BOUND_SHARE * graphed:
        return None
    return graphed


def _model_flags(table, key):
    """Why a models point-mode needs a look: ours below the target (an eager step that the host
    bounds says so instead), or below the best peer."""
    rows = table[key]
    peer = best_peer(rows)
    flags = []
    for ours in OURS:
        frac = fraction(rows.get(ours))
        if frac is None:
            continue
        graphed = _host_bound(table, key, ours)
        if graphed is not None:
            flags.append(f"{ours} host-bound (CUDA graph: {graphed:.3f})")
        elif frac < TARGET_FRACTION:
            flags.append(f"{ours} < {TARGET_FRACTION}")
        if peer and frac < peer[0]:
            flags.append(f"{ours} slower than {peer[1]}")
        if frac > 1.05:
            flags.append(f"{ours} > 1.05 of copy: check")
    return flags


def _models_summary(results):
    table = model_table(results)
    if not table:
        return []
    present = [p for p in MODEL_PROVIDERS if any(p in rows for rows in table.values())]
    lines = ["## models: real shapes (ms, medians, and fraction of copy speed)", "",
             "Fraction of copy speed = ms of a device copy of the same bytes (one copy per pass, "
             "two for forward+backward) / the provider's ms (kernels alone: replayed from a CUDA "
             "graph; forward+backward: eager, or replayed from a CUDA graph); rows timed over "
             "rotating input sets take the faster of two graphed copies, docs/benchmarks.md. Kernel "
             "time is the kernels-alone and CUDA-graph rows: compare providers there. An eager "
             "forward+backward row is host-bound where it runs below "
             f"{HOST_BOUND_SHARE} of the speed of its CUDA-graph twin (launch and autograd "
             "overhead per step decide it); it is counted apart. Liger moves q and k (its copy is "
             "of those bytes); the others move the point's tensor. Flags: ours below "
             f"{TARGET_FRACTION} (or host-bound), or below the best peer's fraction.", ""]
    flagged = {k: _model_flags(table, k) for k in table}
    eager_keys = [k for k in table if k[2] == EAGER_STEP]
    kernel_keys = [k for k in table if k[2] != EAGER_STEP]
    for ours in OURS:
        fracs = [f for k in kernel_keys if (f := fraction(table[k].get(ours))) is not None]
        eager = [(k, f) for k in eager_keys if (f := fraction(table[k].get(ours))) is not None]
        if not fracs and not eager:
            lines.append(f"- {MODEL_PROVIDERS[ours]}: no results (the path raised or was not run)")
            continue
        line = f"- {MODEL_PROVIDERS[ours]}:"
        if fracs:
            below = sum(f < TARGET_FRACTION for f in fracs)
            line += (f" kernel time: min {min(fracs):.3f} of copy over {len(fracs)} point-modes, "
                     f"{below} below {TARGET_FRACTION}.")
        if eager:
            host = [k for k, _ in eager if _host_bound(table, k, ours) is not None]
            short = sum(f < TARGET_FRACTION for k, f in eager if k not in host)
            line += (f" Eager forward+backward: {len(host)} of {len(eager)} host-bound; of the "
                     f"others, {short} below {TARGET_FRACTION}.")
        lines.append(line)
    kernel_flagged = sum(bool(flagged[k]) for k in kernel_keys)
    eager_flagged = sum(bool(flagged[k]) for k in eager_keys)
    lines.append(f"- flagged point-modes: {kernel_flagged} of {len(kernel_keys)} of kernel time, "
                 f"{eager_flagged} of {len(eager_keys)} eager steps")
    lines += ["", "Table bound: the table path's own bound, a copy of the point's bytes plus the "
              "float32 table rows it must read (`table_bound`), as a fraction of copy speed.", "",
              "| point | dtype | mode | copy | table bound | "
              + " | ".join(MODEL_PROVIDERS[p] for p in present)
              + " | flags |", "|---|---|---|---|---|" + "---|" * len(present) + "---|"]
    for (point, dtype, mode), rows in table.items():
        copy = rows.get("copy")
        bound = table_bound(rows["triton"]) if "triton" in rows else None
        cells = [f"{rows[p]['ms']:.4f} ({fraction(rows[p]):.3f})" if p in rows else "-" for p in present]
        lines.append(f"| {point} | {dtype} | {mode} | " + (f"{copy['ms']:.4f} | " if copy else "- | ")
                     + (f"{bound:.3f} | " if bound is not None else "- | ")
                     + " | ".join(cells) + f" | {'; '.join(flagged[(point, dtype, mode)])} |")
    return lines + [""]


def _sweep_rows(by_key):
    """Per point of the parameter sweeps (in sweep order): table line, fraction of copy, TE
    speedup (nan without TE)."""
    def order(key):
        values = [str(v) for v in SWEEPS.get(key[0], [])]
        return (key[0], values.index(key[1]) if key[1] in values else len(values), key[1]) + key[2:]

    out = []
    for key in sorted(by_key, key=order):
        sweep, x, dtype, mode, provider = key
        if provider != "triton" or sweep == "models":
            continue
        r, copy, te = by_key[key], by_key.get(key[:4] + ("copy",)), by_key.get(key[:4] + ("te",))
        frac = copy["ms"] / r["ms"] if copy else float("nan")
        speed = te["ms"] / r["ms"] if te else float("nan")
        line = (f"| {sweep} | {x} | {dtype} | {mode} | {r['ms']:.4f} | "
                + (f"{te['ms']:.4f} | {speed:.2f}x | " if te else "- | - | ")
                + (f"{copy['ms']:.4f} | {frac:.3f} |" if copy else "- | - |"))
        out.append((line, frac, speed))
    return out


def _targets(by_key, sweep_rows, env, extras):
    fractions = [f for _, f, _ in sweep_rows if not math.isnan(f)]
    speedups = [s for _, _, s in sweep_rows if not math.isnan(s)]
    lines = ["## Targets", ""]
    if fractions:
        lines.append(f"- Triton's fraction of copy speed: min {min(fractions):.3f} over "
                     f"{len(fractions)} points (target >= 0.95 everywhere, >= 0.97 at the defaults)")
    lines.append(f"- Triton speedup over TE: min {min(speedups):.2f}x over {len(speedups)} points"
                 if speedups else "- Transformer Engine line absent: "
                 + str(env.get("Transformer Engine", "not recorded")))
    for dtype in DTYPE_NAMES:
        for mode in MODES:
            key = ("seq_length", str(BENCH_DEFAULTS["seq_length"]), dtype, mode)
            tri, copy, te = (by_key.get(key + (p,)) for p in ("triton", "copy", "te"))
            if tri and copy:
                lines.append(f"- defaults, {dtype} {mode}: Triton {tri['ms']:.4f} ms = "
                             f"{copy['ms'] / tri['ms']:.3f} of copy speed"
                             + (f", {te['ms'] / tri['ms']:.2f}x TE ({te['ms']:.4f} ms)" if te else ""))
    return lines + [f"- {k}: {v}" for k, v in extras.items()] + [""]


def write_summary(out_dir):
    """<out_dir>/SUMMARY.md from its results.json and run.json: the short table, which rows
    are of the current device code, environment, targets, the models table, per point."""
    results = load_json(os.path.join(out_dir, "results.json"), [])
    run = load_json(os.path.join(out_dir, "run.json"), {})
    env, extras = run.get("environment", {}), run.get("extras", {})
    by_key = {row_key(r): r for r in results}
    sweep_rows = _sweep_rows(by_key)
    lines = [f"# Benchmark summary: {env.get('GPU', os.path.basename(out_dir))}", "",
             "Generated by `make bench` (`python pytest_benchmark_cuda_triton_comparison.py`; "
             "`--summary-only` regenerates it). Fraction of copy speed = ms of a device copy of "
             "the same bytes / ms. Plots: results.html.", ""]
    lines += [HEADLINE_CAPTION, ""] + headline(results)
    lines += ["", current_rows_line({os.path.basename(out_dir): results}), ""]
    lines += ["## Environment and rows", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += ([f"- note: {run['note']}"] if run.get("note") else []) + restamp_lines(run)
    lines += _provenance(results) + [""]
    if sweep_rows:
        lines += _targets(by_key, sweep_rows, env, extras)
    lines += _models_summary(results)
    if sweep_rows:
        lines += ["## Per point (ms, medians)", "",
                  "| sweep | x | dtype | mode | Triton | TE | Triton speedup | copy | Triton / copy speed |",
                  "|---|---|---|---|---|---|---|---|---|"] + [line for line, _, _ in sweep_rows]
    with open(os.path.join(out_dir, "SUMMARY.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --- artifacts/SUMMARY.md: the GPUs side by side ----------------------------------------------

def _models_across_gpus(tables):
    """The models table, one column per GPU (markdown lines)."""
    gpus = [g for g, t in tables.items() if t]
    keys = list(dict.fromkeys(k for g in gpus for k in tables[g]))
    if not keys:
        return []
    lines = ["## models: fraction of copy speed", "",
             "Per GPU: Triton (freqs table) [its own bound: a copy plus the table rows it must "
             "read] / Triton (positions) / best peer (liger, liger_mrope or flash-attn, by "
             "fraction) / a plain Triton copy kernel of the same bytes. `-`: not measured or the "
             "path raised. The eager forward+backward rows are host-bound.", "",
             "| point | dtype | mode | " + " | ".join(gpus) + " |", "|---|---|---|" + "---|" * len(gpus)]
    for key in keys:
        cells = []
        for g in gpus:
            rows = tables[g].get(key, {})
            best = best_peer(rows)
            ours = [f"{f:.3f}" if (f := fraction(rows.get(p))) is not None else "-" for p in OURS]
            if "triton" in rows and (bound := table_bound(rows["triton"])) is not None:
                ours[0] += f" [{bound:.3f}]"
            tcopy = fraction(rows.get("triton_copy"))
            cells.append(" / ".join(ours) + (f" / {best[0]:.3f} {best[1]}" if best else " / -")
                         + (f" / {tcopy:.3f}" if tcopy is not None else " / -"))
        lines.append(f"| {' | '.join(key)} | " + " | ".join(cells) + " |")
    return lines + [""]


def _sweeps_across_gpus(data):
    """Per parameter sweep and GPU: Triton's minimum fraction of copy and how many points
    reach 0.95 (markdown lines)."""
    sweeps = [s for s in PARAMETER_SWEEPS if any(r["sweep"] == s for rows in data.values() for r in rows)]
    if not sweeps:
        return []
    lines = ["## Other sweeps: Triton's fraction of copy speed", "",
             "Per GPU: minimum over the sweep's points, dtypes and modes, and how many are >= 0.95.", "",
             "| sweep | " + " | ".join(data) + " |", "|---|" + "---|" * len(data)]
    for s in sweeps:
        cells = []
        for rows in data.values():
            fracs = [f["triton"] for f in sweep_table(rows, s).values() if "triton" in f]
            cells.append(f"{min(fracs):.3f} ({sum(f >= 0.95 for f in fracs)}/{len(fracs)})" if fracs else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def write_gpus_summary():
    """artifacts/SUMMARY.md: per GPU its short table, then the GPUs side by side."""
    gpus = gpu_dirs_with_results()
    data = {g: load_json(os.path.join(ARTIFACTS_ROOT, g, "results.json"), []) for g in gpus}
    runs = {g: load_json(os.path.join(ARTIFACTS_ROOT, g, "run.json"), {}) for g in gpus}
    lines = ["# Benchmarks across GPUs", "",
             "Generated from `artifacts/<gpu>/results.json` (`python pytest_benchmark_cuda_triton_comparison.py "
             "--summary-only`, also at the end of every benchmark run); details in each "
             "`artifacts/<gpu>/SUMMARY.md`, plots in each `artifacts/<gpu>/results.html`. Fraction of "
             "copy speed = ms of a device copy of the same bytes / ms.", "",
             current_rows_line(data), "", HEADLINE_CAPTION, ""]
    for g in gpus:
        lines += [f"## {g}: {runs[g].get('environment', {}).get('GPU', g)}", ""] + headline(data[g]) + [""]
        lines += restamp_lines(runs[g]) + ([""] if runs[g].get("restamped") else [])
    lines += ["## Environments", "", "| folder | GPU | driver | torch | triton | Transformer Engine | date | rows |",
              "|---|---|---|---|---|---|---|---|"]
    for g in gpus:
        env = runs[g].get("environment", {})
        cells = [str(env.get(k, "-")) for k in ("GPU", "driver", "torch", "triton")]
        cells += [te_of_rows(env), str(env.get("date", "-"))]
        lines.append(f"| {g} | " + " | ".join(cells) + f" | {len(data[g])} |")
    lines += [""] + _models_across_gpus({g: model_table(rows) for g, rows in data.items()})
    lines += _sweeps_across_gpus(data)
    with open(os.path.join(ARTIFACTS_ROOT, "SUMMARY.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# --- Plots ----------------------------------------------------------------------------------------

def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing (the CSVs
    still hold every number)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        print(f"plots skipped: {err!r}", flush=True)
        return None
    return plt


def _fraction_top(all_results):
    """The y-axis top of every fraction plot: FRACTION_TOP, or higher for all plots together
    where a measured fraction (sweeps or models, any GPU) would not fit under it."""
    fracs = [f for rows in all_results for s in PARAMETER_SWEEPS for fr in sweep_table(rows, s).values()
             for f in fr.values()]
    fracs += [f for rows in all_results for r in rows if r["sweep"] == "models" and (f := fraction(r))]
    highest = max(fracs, default=0.0)
    return FRACTION_TOP if highest <= FRACTION_TOP - 0.02 else math.ceil(10 * highest + 0.5) / 10


def _write_sweep_csv(path, sweep, rows):
    """One parameter sweep, one dtype and mode: per x, ms, GB/s and fraction of copy speed per
    provider. `rows`: {x: {provider: row}}, x in order."""
    import csv
    providers = [p for p in PROVIDERS if any(p in by_p for by_p in rows.values())]
    names = [PROVIDERS[p] for p in providers]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([sweep] + [f"{n} (ms)" for n in names] + [f"{n} (GB/s)" for n in names]
                        + [f"{n} (fraction of copy)" for n in names])
        for x, by_p in rows.items():
            got = [by_p.get(p) for p in providers]
            copy = by_p.get("copy")
            writer.writerow([x] + [f"{r['ms']:.6f}" if r else "" for r in got]
                            + [f"{r['bytes'] / r['ms'] / 1e6:.1f}" if r else "" for r in got]
                            + [f"{copy['ms'] / r['ms']:.4f}" if r and copy else "" for r in got])


def _draw_sweep(plt, path, gpu, sweep, dtype, mode, rows, top):
    """The plot of one parameter sweep, one dtype and mode: fraction of copy speed per x, one
    line per provider, the copy at 1.0."""
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(9.0, 4.8))
    ax.axhline(1.0, label="Device copy (1.0)", **COPY_STYLE)
    copies = [by_p.get("copy") for by_p in rows.values()]
    for provider, style in SWEEP_STYLES.items():
        ys = [c["ms"] / by_p[provider]["ms"] if c and provider in by_p else float("nan")
              for c, by_p in zip(copies, rows.values())]
        if not all(math.isnan(y) for y in ys):
            ax.plot(xs, ys, label=PROVIDERS[provider] + (" (ours)" if provider == "triton" else ""), **style)
    ax.set_xticks(xs)
    ax.set_xticklabels(list(rows))
    ax.set_xlabel(sweep)
    ax.set_ylim(0.0, top)
    ax.set_ylabel("fraction of copy speed (copy ms / ms)")
    ax.set_title(f"{gpu}\nRoPE {mode}, {dtype}: {sweep} sweep")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # off the lines
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_sweep_plots(out_dir, gpu, top):
    """Per parameter sweep, dtype and mode: rope_<mode>_<dtype>_<sweep>.csv and .png."""
    results = load_json(os.path.join(out_dir, "results.json"), [])
    plt = _pyplot()
    for sweep in PARAMETER_SWEEPS:
        values = [str(v) for v in SWEEPS[sweep]]
        for dtype in DTYPE_NAMES:
            for mode in MODES:
                found = {}
                for r in results:
                    if (r["sweep"], r["dtype"], r["mode"]) == (sweep, dtype, mode):
                        found.setdefault(str(r["x"]), {})[r["provider"]] = r
                if not found:
                    continue
                rows = {x: found[x] for x in sorted(found, key=lambda x: (
                    values.index(x) if x in values else len(values), x))}
                stem = os.path.join(out_dir, sweep_plot_name(sweep, dtype, mode))
                _write_sweep_csv(stem + ".csv", sweep, rows)
                if plt is not None:
                    _draw_sweep(plt, stem + ".png", gpu, sweep, dtype, mode, rows, top)


def _write_models_csv(path, rows, present):
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["point", "copy (ms)"] + [f"{MODEL_PROVIDERS[p]} ({u})" for p in present
                                                  for u in ("ms", "fraction of copy")])
        for point, r in rows.items():
            writer.writerow([point, f"{r['copy']['ms']:.5f}" if "copy" in r else ""] + [
                v for p in present for v in ((f"{r[p]['ms']:.5f}", f"{fraction(r[p]):.4f}")
                                             if p in r else ("", ""))])


def _draw_model_bars(ax, rows, present, top, title):
    """One panel: fraction of copy speed per point, one bar per provider, copy at 1.0 and
    the target as lines."""
    points = list(rows)
    width = 0.8 / max(len(present), 1)
    for i, p in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j, point in enumerate(points) if p in rows[point]]
        ys = [fraction(rows[point][p]) for point in points if p in rows[point]]
        ax.bar(xs, ys, width, label=MODEL_PROVIDERS[p], color=MODEL_COLORS[p], zorder=3)
    ax.axhline(1.0, color="black", linewidth=1, zorder=4, label="device copy (1.0)")
    ax.axhline(TARGET_FRACTION, color="black", linewidth=1, linestyle="--", zorder=4,
               label=f"{TARGET_FRACTION} of copy")
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels(points, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0.0, top)
    ax.grid(True, axis="y", alpha=0.3, zorder=0)
    ax.set_title(title, fontsize=10)


def _models_by_mode(results, dtype):
    """{mode: {point: {provider: row}}} of one dtype's models rows, in table order."""
    by_mode = {}
    for (point, dt, mode), rows in model_table(results).items():
        if dt == dtype:
            by_mode.setdefault(mode, {})[point] = rows
    return by_mode


def _present(*row_sets):
    return [p for p in MODEL_PROVIDERS if any(p in r for rows in row_sets for r in rows.values())]


def _draw_kernel_mode(plt, path, gpu, dtype, mode, rows, top):
    present = _present(rows)
    fig, ax = plt.subplots(figsize=(max(10.0, 0.8 * len(rows)), 5.5))
    _draw_model_bars(ax, rows, present, top, f"{gpu}\nRoPE at model shapes, {dtype}, {mode}: "
                                             "kernels alone (one call replayed from a CUDA graph)")
    ax.set_ylabel("fraction of copy speed (copy ms / ms)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_eager_vs_graph(plt, path, gpu, dtype, eager, graphed, top):
    """The forward+backward step: eager above, replayed from a CUDA graph below; one x and
    one y axis."""
    present = _present(eager, graphed)
    points = list(dict.fromkeys(list(eager) + list(graphed)))
    fig, (upper, lower) = plt.subplots(2, 1, sharex=True, sharey=True,
                                       figsize=(max(12.0, 0.8 * len(points)), 9.5))
    _draw_model_bars(upper, {p: eager.get(p, {}) for p in points}, present, top,
                     "eager, host-bound (launch + autograd overhead; see the CUDA-graph twin below)")
    _draw_model_bars(lower, {p: graphed.get(p, {}) for p in points}, present, top,
                     "the same step replayed from a CUDA graph (device time)")
    for ax in (upper, lower):
        ax.set_ylabel("fraction of copy speed (copy ms / ms)")
    upper.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # off the bars
    fig.suptitle(f"{gpu}\nRoPE at model shapes, {dtype}, forward+backward (autograd step)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def eager_vs_graph_plot_name(dtype):
    return f"models_{dtype}_forward_backward_eager_vs_cuda_graph"


def write_model_plots(out_dir, gpu, top):
    """Per dtype: models_<dtype>_<mode>.csv for every mode, a plot per kernels-alone mode, and
    one two-panel plot of the forward+backward step, eager beside its CUDA-graph twin."""
    results = load_json(os.path.join(out_dir, "results.json"), [])
    plt = _pyplot()
    for dtype in MODEL_DTYPE_NAMES:
        by_mode = _models_by_mode(results, dtype)
        for mode, rows in by_mode.items():
            stem = os.path.join(out_dir, f"models_{dtype}_{mode_slug(mode)}")
            _write_models_csv(stem + ".csv", rows, _present(rows))
            if plt is not None and mode in KERNEL_MODES:
                _draw_kernel_mode(plt, stem + ".png", gpu, dtype, mode, rows, top)
        if plt is not None and (EAGER_STEP in by_mode or GRAPHED_STEP in by_mode):
            _draw_eager_vs_graph(plt, os.path.join(out_dir, eager_vs_graph_plot_name(dtype) + ".png"), gpu,
                                 dtype, by_mode.get(EAGER_STEP, {}), by_mode.get(GRAPHED_STEP, {}), top)


# --- results.html: every plot of a GPU's folder ---------------------------------------------

def _images(out_dir, names):
    return [n + ".png" for n in names if os.path.exists(os.path.join(out_dir, n + ".png"))]


def _html_section(title, images, per_row):
    if not images:
        return []
    width = f"{100 / per_row - 1:.1f}%"
    return [f"<h2>{html.escape(title)}</h2>", '<div class="row">'] + [
        f'<a href="{html.escape(i)}"><img src="{html.escape(i)}" alt="{html.escape(i)}" style="width:{width}"></a>'
        for i in images] + ["</div>"]


def write_results_html(out_dir):
    """<out_dir>/results.html: a header from run.json (GPU, driver, torch, Triton, TE, date),
    then every plot of the folder: models kernels alone, models forward+backward eager vs CUDA
    graph, the parameter sweeps (one row per sweep: modes x dtypes)."""
    env = load_json(os.path.join(out_dir, "run.json"), {}).get("environment", {})
    results = load_json(os.path.join(out_dir, "results.json"), [])
    gpu = env.get("GPU", os.path.basename(out_dir))
    facts = [f"{k}: {env[k]}" for k in ("GPU", "driver", "torch", "triton", "Transformer Engine", "date",
                                        TE_OF_KEPT_ROWS) if k in env]
    body = [f"<h1>RoPE benchmarks: {html.escape(gpu)}</h1>",
            "<p>" + "<br>".join(html.escape(f) for f in facts) + "</p>",
            f"<p>{html.escape(current_rows_line({os.path.basename(out_dir): results}).replace('`', ''))}</p>",
            "<p>Every plot: speed as a fraction of copy speed (ms of a device copy of the same bytes / "
            "ms; 1.0 = the copy). Numbers: <a href=\"SUMMARY.md\">SUMMARY.md</a> and the CSV beside "
            "each plot.</p>"]
    body += _html_section("models: kernels alone", _images(
        out_dir, [f"models_{d}_{m}" for m in KERNEL_MODES for d in MODEL_DTYPE_NAMES]), 2)
    body += _html_section("models: forward+backward step, eager (above: host-bound) vs replayed from a "
                          "CUDA graph (below)",
                          _images(out_dir, [eager_vs_graph_plot_name(d) for d in MODEL_DTYPE_NAMES]), 2)
    for sweep in PARAMETER_SWEEPS:
        body += _html_section(f"parameter sweep: {sweep}", _images(
            out_dir, [sweep_plot_name(sweep, d, m) for d in DTYPE_NAMES for m in MODES]), 3)
    style = ("body{font-family:sans-serif;margin:1em} .row{display:flex;flex-wrap:wrap;gap:0.5%} "
             "img{max-width:100%;border:1px solid #ddd}")
    page = ["<!doctype html>", "<html><head><meta charset=\"utf-8\">",
            f"<title>RoPE benchmarks: {html.escape(gpu)}</title><style>{style}</style></head><body>"]
    with open(os.path.join(out_dir, "results.html"), "w") as f:
        f.write("\n".join(page + body + ["</body></html>"]) + "\n")


# --- The accuracy study's plot (the study itself is computed in the test file) ----------------

# (label, color, marker, zorder) per method; ours on top, the peers' markers hollow and larger
# (in float32 transformers' and flash-attn's lines coincide with our table path's).
ACCURACY_METHODS = {
    "rounding": ("float64 rotation rounded to the input dtype (the least error)", "black", "", 2),
    "transformers": ("transformers Llama (Liger: same tables and arithmetic)", "tab:red", "v", 3),
    "flash_attn": ("flash-attn (tables in the input dtype, float32 arithmetic)", "tab:purple", "^", 3),
    "table": ("ours, table path (TE's float32 angles)", "tab:blue", "o", 4),
    "exact": ("ours, exact path (position * inv_freq)", "tab:orange", "s", 5),
}
ACCURACY_DTYPES = {"fp32": "float32 input (transformers and flash-attn compute the same here)",
                   "bf16": "bfloat16 input"}


def accuracy_column(dtype, method):
    return f"{dtype}_{method}_rel_error"


def write_accuracy_plot(path, rows, bound, title):
    """The accuracy study at `path` (.png) and a CSV next to it (same name, .csv). `rows`: per
    k, dict(k=, max_position=, and accuracy_column(dtype, method) for every dtype and method
    of ACCURACY_DTYPES x ACCURACY_METHODS); `bound`: the exact path's float32 test bound."""
    import csv
    stem = os.path.splitext(str(path))[0]
    columns = [accuracy_column(d, m) for d in ACCURACY_DTYPES for m in ACCURACY_METHODS]
    with open(stem + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["k", "max_position"] + columns)
        writer.writerows([r["k"], r["max_position"]] + [f"{r[c]:.3e}" for c in columns] for r in rows)
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13.0, 5.6))
    for ax, (dtype, what) in zip(axes, ACCURACY_DTYPES.items()):
        _draw_accuracy_panel(ax, rows, dtype, what)
    axes[0].axhline(bound, color="gray", ls="--", lw=0.8, label=f"our float32 test bound {bound:g}")
    axes[0].set_ylabel("relative error vs float64 rotation")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)       # one legend, off the lines
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)


def _draw_accuracy_panel(ax, rows, dtype, title):
    """One input dtype of the accuracy study: error per method against the largest position
    (each panel its own y range: bfloat16's errors start where float32's end)."""
    positions = [r["max_position"] for r in rows]
    for method, (label, color, marker, z) in ACCURACY_METHODS.items():
        ours = method in ("table", "exact")
        ax.loglog(positions, [r[accuracy_column(dtype, method)] for r in rows], color=color, label=label,
                  marker=marker or None, ls=":" if method == "rounding" else "-", zorder=z,
                  ms=5 if ours else 8, mfc=None if ours else "none")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("largest position 2^k (4 tokens in (2^(k-1), 2^k], 2^24 - 1 at the end)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)


# --- Everything at once -------------------------------------------------------------------------

def regenerate(gpu_dirs=None):
    """Summaries, plots, CSVs and results.html of every GPU folder (or those named), and
    artifacts/SUMMARY.md, from the stored results; needs no GPU."""
    gpu_dirs = gpu_dirs_with_results() if gpu_dirs is None else list(gpu_dirs)
    all_results = [load_json(os.path.join(ARTIFACTS_ROOT, g, "results.json"), [])
                   for g in gpu_dirs_with_results()]
    top = _fraction_top(all_results)
    for g in gpu_dirs:
        out_dir = os.path.join(ARTIFACTS_ROOT, g)
        gpu = load_json(os.path.join(out_dir, "run.json"), {}).get("environment", {}).get("GPU", g)
        write_summary(out_dir)
        write_sweep_plots(out_dir, gpu, top)
        write_model_plots(out_dir, gpu, top)
        write_results_html(out_dir)
    write_gpus_summary()
