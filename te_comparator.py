"""Transformer Engine's fused CUDA RoPE, loaded as the baseline the Triton kernel is compared with.

    fn, desc = load_te_rope()          # fn is None and desc the reason where TE can't be loaded
    out = fn(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
             cu_seqlens=None, cp_size=1, cp_rank=0)      # == TE's apply_rotary_pos_emb(fused=True)

Two ways to reach TE, tried in order:

1. TE's Python package (`transformer_engine.pytorch`), called with `fused=True`.
2. TE's C API in `$TE_HOME/lib/libtransformer_engine.so` (headers in
   `$TE_HOME/include/transformer_engine/`), through a tiny pybind11 binding compiled at first
   use. The binding only wraps torch tensors' memory in NVTETensors and calls
   `nvte_fused_rope_forward/backward`; the host-side work TE's own PyTorch extension does
   (sizes, strides, output allocation) is mirrored here in Python. It is built with torch's
   load_inline, or with one direct compiler call where ninja is missing, and cached under
   $TE_HOME/build (or the temp dir if that is read-only).

`load_te_qkv_rope()` does the same for TE's fused QKV RoPE (`apply_fused_qkv_rotary_pos_emb`).
"""

import ctypes
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import subprocess
import sys
import sysconfig
import tempfile

import torch

__all__ = ["load_te_rope", "load_te_qkv_rope"]

# Where TE's Python API has lived: current TE, early TE 2.x, TE 1.x.
_TE_ROPE_MODULES = ("transformer_engine.pytorch.attention.rope",
                    "transformer_engine.pytorch.dot_product_attention.rope",
                    "transformer_engine.pytorch.attention")

# Enum values from TE's headers: NVTE_QKV_Format (fused_attn.h) and NVTEDType
# (transformer_engine.h).
_QKV_FORMATS = {"sbhd": 0, "bshd": 1, "thd": 2}
_NVTE_DTYPES = {torch.int32: 2, torch.float32: 4, torch.float16: 5, torch.bfloat16: 6}

_EXT_NAME = "te_rope_capi"

# The binding (its C++ beside this file). Tensors cross the boundary as {data_ptr, NVTEDType,
# dim0, dim1, ...} and the stream as an integer, so it needs no ATen and compiles in a few
# seconds.
_CPP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_capi_binding.cpp")

# TE's headers include <cuda_runtime_api.h> only for cudaStream_t; where no CUDA toolkit is
# installed, this stand-in (the same typedef CUDA uses) is put on the include path instead.
_CUDA_STREAM_SHIM = "#pragma once\ntypedef struct CUstream_st *cudaStream_t;\n"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

@functools.cache
def _te_python_module():
    """(module with apply_rotary_pos_emb, description) or (None, reason)."""
    errors = []
    for name in _TE_ROPE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a broken install raises more than ImportError
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "apply_rotary_pos_emb"):
            te = sys.modules["transformer_engine"]
            return module, f"transformer_engine {getattr(te, '__version__', '?')} Python API"
    return None, f"TE not importable ({errors[0] if errors else 'no apply_rotary_pos_emb'})"


def _build_directory(te_home):
    """A per-user cache directory: $TE_HOME/build if writable, else one under the temp dir."""
    if os.access(te_home, os.W_OK):
        path = os.path.join(te_home, "build", _EXT_NAME)
    else:
        path = os.path.join(tempfile.gettempdir(), f"{_EXT_NAME}_{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _cuda_include_dir(build_dir):
    """CUDA's headers from the toolkit torch would build with, else the cudaStream_t shim."""
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime_api.h")):
        return os.path.join(CUDA_HOME, "include")
    shim_dir = os.path.join(build_dir, "cuda_shim")
    os.makedirs(shim_dir, exist_ok=True)
    with open(os.path.join(shim_dir, "cuda_runtime_api.h"), "w") as f:
        f.write(_CUDA_STREAM_SHIM)
    return shim_dir


def _compile_extension(build_dir, include_dirs, ldflags):
    """Build and import the binding with load_inline (which needs ninja), else with the C++
    compiler directly; the binding is plain pybind11, so no torch build machinery is needed."""
    from torch.utils import cpp_extension
    with open(_CPP_FILE) as f:      # installed without it (pip install .): the error says so
        cpp_source = f.read()
    if cpp_extension.is_ninja_available():
        extra = {}
        if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
            extra["no_implicit_headers"] = True  # skip <torch/extension.h>: much faster build
        return cpp_extension.load_inline(
            name=_EXT_NAME, cpp_sources=[cpp_source], extra_cflags=["-O2"],
            extra_include_paths=include_dirs, extra_ldflags=ldflags, with_cuda=False,
            build_directory=build_dir, verbose=False, **extra)
    # No ninja: one compiler call, cached under a name that hashes the source and flags.
    include_dirs = include_dirs + [cpp_extension.include_paths()[0],  # torch's pybind11
                                   sysconfig.get_paths()["include"]]
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", *(f"-I{d}" for d in include_dirs)]
    key = hashlib.sha256("\n".join([cpp_source, *flags, *ldflags]).encode()).hexdigest()[:12]
    name = f"{_EXT_NAME}_{key}"
    path = os.path.join(build_dir, name + importlib.machinery.EXTENSION_SUFFIXES[0])
    if not os.path.exists(path):
        source = os.path.join(build_dir, name + ".cpp")
        with open(source, "w") as f:
            f.write(cpp_source)
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [os.environ.get("CXX", "c++"), *flags, f"-DTORCH_EXTENSION_NAME={name}",
               source, "-o", tmp, *ldflags]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the TE binding failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees all or nothing
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _te_c_extension():
    """(compiled binding, description) or (None, reason)."""
    te_home = os.environ.get("TE_HOME")
    if not te_home:
        return None, "TE_HOME not set"
    lib_dir = os.path.join(te_home, "lib")
    lib = os.path.join(lib_dir, "libtransformer_engine.so")
    header = os.path.join(te_home, "include", "transformer_engine", "fused_rope.h")
    for path in (lib, header):
        if not os.path.isfile(path):
            return None, f"TE_HOME={te_home} has no {os.path.relpath(path, te_home)}"
    try:
        # The library was linked against a newer cuBLAS than some machines have. RoPE never
        # calls cuBLAS, so resolve symbols lazily: load it RTLD_LAZY before anything needs it,
        # and import the binding (which links to it) with the same flags.
        ctypes.CDLL(lib, mode=os.RTLD_LAZY | os.RTLD_GLOBAL)
        build_dir = _build_directory(te_home)
        include_dirs = [os.path.join(te_home, "include"), _cuda_include_dir(build_dir)]
        ldflags = [f"-L{lib_dir}", "-ltransformer_engine", f"-Wl,-rpath,{lib_dir}"]
        old_flags = sys.getdlopenflags()
        sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
        try:
            ext = _compile_extension(build_dir, include_dirs, ldflags)
        finally:
            sys.setdlopenflags(old_flags)
    except Exception as exc:
        return None, f"TE C API at TE_HOME={te_home} unusable: {type(exc).__name__}: {exc}"
    return ext, f"TE C API (libtransformer_engine.so{_packed_te_version()} at {te_home})"


def _packed_te_version():
    """' <version>' of the TE wheel this repository packs for TE_HOME (.te/common/SHA256SUMS
    names it; the library itself records no version), or '' if it can't be told."""
    sums = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".te", "common", "SHA256SUMS")
    try:
        with open(sums) as f:
            wheel = f.read().split()[1]  # transformer_engine_cu13-2.20.2-py3-none-...whl
        return " " + wheel.split("-")[1]
    except (OSError, IndexError):
        return ""


def _load(python_attr, c_api_fn):
    """Shared by the two loaders: TE's Python API first, else the C API binding."""
    try:
        module, python_info = _te_python_module()
        if module is not None:
            if hasattr(module, python_attr):
                return getattr(module, python_attr), python_info
            python_info = f"{python_info} lacks {python_attr}"
        ext, c_info = _te_c_extension()
        if ext is not None:
            return c_api_fn, c_info
        return None, f"{python_info}; {c_info}"
    except Exception as exc:  # never raise: the caller reports the reason and skips
        return None, f"{type(exc).__name__}: {exc}"


@functools.cache
def load_te_rope():
    """Return (fn, description) or (None, reason).

    fn(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
       cu_seqlens=None, cp_size=1, cp_rank=0) is TE's apply_rotary_pos_emb(..., fused=True):
    forward and backward both run TE's fused CUDA kernels."""
    fn, info = _load("apply_rotary_pos_emb", _c_api_rope)
    if fn is None or fn is _c_api_rope:
        return fn, info
    apply_rotary_pos_emb = fn

    def te_python_rope(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                       cu_seqlens=None, cp_size=1, cp_rank=0):
        kwargs = dict(tensor_format=tensor_format, fused=True, cu_seqlens=cu_seqlens,
                      cp_size=cp_size, cp_rank=cp_rank)
        # Keywords later TE versions added: passed only when used, so older TE still works.
        if start_positions is not None:
            kwargs["start_positions"] = start_positions
        if interleaved:
            kwargs["interleaved"] = True
        return apply_rotary_pos_emb(t, freqs, **kwargs)

    return te_python_rope, info


@functools.cache
def load_te_qkv_rope():
    """Return (fn, description) or (None, reason).

    fn(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
       interleaved=False, cp_size=1, cp_rank=0) -> (q, k, v) is TE's
    apply_fused_qkv_rotary_pos_emb: qkv is [s, b, h, q+k+v] or [b, s, h, q+k+v]."""
    fn, info = _load("apply_fused_qkv_rotary_pos_emb", _c_api_qkv_rope)
    if fn is None or fn is _c_api_qkv_rope:
        return fn, info
    apply_fused_qkv_rotary_pos_emb = fn

    def te_python_qkv_rope(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                           start_positions=None, interleaved=False, cp_size=1, cp_rank=0):
        return apply_fused_qkv_rotary_pos_emb(
            qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format=tensor_format,
            start_positions=start_positions, interleaved=interleaved, cp_size=cp_size,
            cp_rank=cp_rank)

    return te_python_qkv_rope, info


# ---------------------------------------------------------------------------------------------
# C API path: host-side logic of TE's PyTorch extension (csrc/extensions/apply_rope.cpp)
# ---------------------------------------------------------------------------------------------

def _desc(t):
    """A tensor as the binding takes it; None becomes a null data pointer (absent input)."""
    if t is None:
        return [0, 0]
    if t.dtype not in _NVTE_DTYPES:
        raise TypeError(f"TE's fused RoPE does not take {t.dtype} tensors")
    return [t.data_ptr(), _NVTE_DTYPES[t.dtype], *t.shape]


def _stream(t):
    """The current CUDA stream of t's device, as an integer handle."""
    if not t.is_cuda:
        raise ValueError("TE's fused RoPE needs CUDA tensors")
    return torch.cuda.current_stream(t.device).cuda_stream


def _as_int32(t):
    # TE's kernels read cu_seqlens and start_positions as int32 without checking the dtype.
    return None if t is None else t.to(torch.int32).contiguous()


def _as_freqs(freqs):
    """float32 as TE casts; contiguous since TE's kernel indexes freqs as [s2, d2] packed."""
    if freqs.dim() != 4 or freqs.size(1) != 1 or freqs.size(2) != 1:
        raise ValueError(f"freqs must be [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    return freqs.float().contiguous()


def _rope_launch(backward, x, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                 cp_size, cp_rank):
    """Run TE's forward (x = t) or backward (x = grad_output) kernel; returns a new contiguous
    tensor shaped like x. The kernel reads x through its strides but writes packed output."""
    stream = _stream(x)
    if tensor_format == "thd":
        if x.dim() != 3 or cu_seqlens is None or cu_seqlens.dim() != 1:
            raise ValueError("thd needs t of shape [t, h, d] and 1D cu_seqlens")
        # Grid (s, b) = (max positions, sequences): s is freqs' length, b = len(cu_seqlens) - 1;
        # tokens of a sequence beyond freqs' length are not written (as in TE).
        s, b = freqs.size(0), cu_seqlens.numel() - 1
        h, d = x.shape[1:]
        stride_s, stride_h, stride_d = x.stride()
        stride_b = 0
    elif tensor_format in ("sbhd", "bshd"):
        if x.dim() != 4:
            raise ValueError(f"{tensor_format} needs a 4D tensor, got {x.dim()}D")
        s_dim, b_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
        s, b, h, d = x.size(s_dim), x.size(b_dim), x.size(2), x.size(3)
        stride_s, stride_b, stride_h, stride_d = (x.stride(s_dim), x.stride(b_dim), x.stride(2),
                                                  x.stride(3))
        if s * cp_size > freqs.size(0):
            raise ValueError("freqs must cover at least s * cp_size positions")
    else:
        raise ValueError(f"Unsupported tensor_format: {tensor_format}")
    d2 = freqs.size(3)
    if d < d2:
        raise ValueError(f"head dim {d} is smaller than freqs' last dim {d2}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _te_c_extension()[0].rope(
        backward, _desc(x), _desc(cu_seqlens), _desc(freqs), _desc(start_positions), _desc(out),
        _QKV_FORMATS[tensor_format], bool(interleaved), cp_size, cp_rank, s, b, h, d, d2,
        stride_s, stride_b, stride_h, stride_d, stream)
    return out


class _CApiRope(torch.autograd.Function):
    """TE's FusedRoPEFunc over the C API."""

    @staticmethod
    def forward(ctx, t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                cp_rank):
        freqs = _as_freqs(freqs)
        start_positions, cu_seqlens = _as_int32(start_positions), _as_int32(cu_seqlens)
        ctx.save_for_backward(freqs, start_positions, cu_seqlens)
        ctx.args = (tensor_format, interleaved, cp_size, cp_rank)
        return _rope_launch(False, t, freqs, tensor_format, start_positions, interleaved,
                            cu_seqlens, cp_size, cp_rank)

    @staticmethod
    def backward(ctx, grad_output):
        freqs, start_positions, cu_seqlens = ctx.saved_tensors
        tensor_format, interleaved, cp_size, cp_rank = ctx.args
        grad_input = _rope_launch(True, grad_output, freqs, tensor_format, start_positions,
                                  interleaved, cu_seqlens, cp_size, cp_rank)
        return grad_input, None, None, None, None, None, None, None


def _c_api_rope(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                cu_seqlens=None, cp_size=1, cp_rank=0):
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'.")
    return _CApiRope.apply(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                           cp_size, cp_rank)


class _CApiQkvRope(torch.autograd.Function):
    """TE's FusedQKVRoPEFunc over the C API. qkv's last dim holds q, k and v parts of sizes
    qkv_split_arg_list; q gets h * q_split / k_split heads of k_split (grouped-query layout)."""

    @staticmethod
    def forward(ctx, qkv, q_freqs, k_freqs, split, tensor_format, start_positions, interleaved,
                cp_size, cp_rank):
        if tensor_format not in ("sbhd", "bshd"):
            raise ValueError(f"Unsupported tensor_format: {tensor_format}")
        if qkv.dim() != 4 or not qkv.is_contiguous():
            raise ValueError("qkv must be a contiguous 4D tensor")
        if cp_size > 1 and start_positions is not None:
            raise ValueError("start_positions != None with cp_size > 1 is not supported")
        q_freqs, k_freqs = _as_freqs(q_freqs), _as_freqs(k_freqs)
        start_positions = _as_int32(start_positions)
        split = [int(n) for n in split]
        if len(split) != 3 or sum(split) != qkv.size(3):
            raise ValueError("qkv_split_arg_list must be 3 sizes adding up to qkv's last dim")
        lead, h = qkv.shape[:2], qkv.size(2)
        q = qkv.new_empty(*lead, h * split[0] // split[1], split[1])
        k = qkv.new_empty(*lead, h, split[1])
        v = qkv.new_empty(*lead, h, split[2])
        s, b = lead if tensor_format == "sbhd" else lead[::-1]
        # As TE's extension: d is the v part's size, d2 q_freqs' last dim.
        _te_c_extension()[0].qkv_rope_forward(
            _desc(qkv), _desc(q_freqs), _desc(k_freqs), _desc(start_positions), _desc(q),
            _desc(k), _desc(v), _QKV_FORMATS[tensor_format], bool(interleaved), cp_size, cp_rank,
            s, b, h, split[2], q_freqs.size(3), *split, _stream(qkv))
        ctx.save_for_backward(q_freqs, k_freqs)
        ctx.args = (split, tensor_format, interleaved, cp_size, cp_rank)
        return q, k, v

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        q_freqs, k_freqs = ctx.saved_tensors
        split, tensor_format, interleaved, cp_size, cp_rank = ctx.args
        # The kernel reads the gradients packed.
        grad_q, grad_k, grad_v = grad_q.contiguous(), grad_k.contiguous(), grad_v.contiguous()
        lead, h = grad_k.shape[:2], grad_k.size(2)  # k's head count is qkv's
        grad_qkv = grad_k.new_empty(*lead, h, sum(split))
        s, b = lead if tensor_format == "sbhd" else lead[::-1]
        _te_c_extension()[0].qkv_rope_backward(
            _desc(grad_q), _desc(grad_k), _desc(grad_v), _desc(q_freqs), _desc(k_freqs),
            _desc(grad_qkv), _QKV_FORMATS[tensor_format], bool(interleaved), cp_size, cp_rank,
            s, b, h, split[2], q_freqs.size(3), *split, _stream(grad_qkv))
        return grad_qkv, None, None, None, None, None, None, None, None


def _c_api_qkv_rope(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                    start_positions=None, interleaved=False, cp_size=1, cp_rank=0):
    return _CApiQkvRope.apply(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format,
                              start_positions, interleaved, cp_size, cp_rank)
