"""Compiles rotary_kernel for sm_90 and reports, per tile, what the tests read in the generated
code: `python rope_sass_probe.py TILE [TILE ...]`, each TILE a JSON object of Variant fields over
DEFAULT_TILE, and optionally "dtype": the data's Triton type, "bf16" (the default), "fp16" or
"fp32". No GPU is needed (Triton's own ptxas and nvdisasm). Run it in a process without
TRITON_INTERPRET, so that the kernel is a JIT function.

`python rope_sass_probe.py --launches FILE` compiles launches the launcher planned instead (FILE:
a JSON list of `launch_record`s) and prints, per launch, `{"ok": true}` or the compiler's error;
`--launch-stats FILE` prints each launch's `sass_stats`.

Per tile it prints one JSON line: the number of sin.approx in the PTX (PTX is one thread's code,
so that is the sin/cos each thread computes), the global loads in the order of the SASS and their
indices among its instructions, for each loop of the SASS (a branch back to a label) its
shared-memory stores (STS), the number of SASS instructions (NOPs left out) and of reciprocals
(MUFU.RCP: an integer division by a runtime value takes one).
The arguments are those of a contiguous call (`example_arguments`), specialized as Triton
specializes them (`signature`).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import triton_rotary_kernel as K

DEFAULT_TILE = dict(BLOCK_T=1, BLOCK_H=1, BLOCK_HALF=64, BLOCK_PASS=0, INTERLEAVED=False,
                    BACKWARD=False, SEQ_MAJOR=True, HAS_START=False, WIDE_INNER=False,
                    ANGLES_FROM_POSITIONS=True, POSITIONS_FROM=0, FLAT_GRID=False, IS_THD=False,
                    SEARCH_LEVELS=0)
UNSPECIALIZED = ("num_tokens", "seq_len", "batch", "cp_size", "cp_rank")


def example_arguments(cfg, dtype="bf16"):
    """rotary_kernel's arguments for a contiguous call of 12 heads of 128 channels of `dtype`
    (sbhd, batch 2; thd), pointers as their Triton types; a tensor the call leaves out is None,
    and so is the norm unless cfg.NORM asks for one (a weight of `dtype`; backward: the norm's
    input and float32 partial sums of dL/dweight)."""
    data = f"*{dtype}"
    heads, dim = 12, 128
    strides = (heads * dim if cfg.IS_THD else 2 * heads * dim, 0 if cfg.IS_THD else heads * dim, dim, 1)
    axis = cfg.POSITIONS_FROM == K.AXIS_POSITIONS_TENSOR.value
    angles = K.Angles("*fp32", (0, 0) if cfg.ANGLES_FROM_POSITIONS else (dim, 1),
                      0 if cfg.ANGLES_FROM_POSITIONS else 4096, "*i32" if axis else None,
                      3 if axis else 1, 1.0)
    implicit = cfg.POSITIONS_FROM == K.IMPLICIT_POSITIONS.value
    position_strides = (0, 0, 0) if implicit else (2048, 1, 0) if axis else (0, 1, 0)
    positions = K.Positions(None if implicit else "*i64", position_strides,
                            "*i32" if cfg.HAS_START else None, "*i32" if cfg.IS_THD else None)
    norm = None
    if cfg.NORM != K.NO_NORM.value:
        backward = cfg.BACKWARD
        norm = K.Norm(data, 1e-6, 0.0, K.View(data, strides) if backward else None,
                      "*fp32" if backward else None, "*fp32" if cfg.SAVED_RSTD else None)
    return (K.View(data, strides), K.View(data, strides), angles, positions,
            K.HeadShape(heads, dim, dim), norm, 4096, 2048, 2, 1, 0, cfg)


def signature(fn, args, unspecialized=UNSPECIALIZED):
    """ASTSource's (signature, constexprs, attrs) for `args`, specialized as Triton's JIT
    specializes a call: None and the parameters annotated constexpr as constants, an integer
    1 as a constant, a pointer (its type string) and an integer divisible by 16 with that
    divisibility; `unspecialized` names are plain int32."""
    constexprs, attrs = {}, {}

    def walk(value, path):
        if value is None:
            constexprs[path] = None
            return "constexpr"
        if isinstance(value, str):
            attrs[path] = [["tt.divisibility", 16]]
            return value
        if isinstance(value, float):
            return "fp32"
        if isinstance(value, bool) or not isinstance(value, (int, tuple)):
            raise TypeError(f"no example type for {value!r}")
        if isinstance(value, int):
            if value == 1:
                constexprs[path] = 1
                return "constexpr"
            if value % 16 == 0:
                attrs[path] = [["tt.divisibility", 16]]
            return "i32"
        parts = [walk(v, (*path, i)) for i, v in enumerate(value)]
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)

    sig = {}
    annotated = {p.name for p in fn.params if p.is_constexpr}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        if name in annotated:
            sig[name], constexprs[name] = "constexpr", value
        elif name in unspecialized:
            sig[name] = "i32"
        else:
            sig[name] = walk(value, (i,))
    return sig, constexprs, attrs


# A SASS instruction line of `nvdisasm -c`: its address comment, then the instruction (an
# optional predicate guard, the opcode with its modifiers, the operands) up to the semicolon.
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(.*?);")
_GUARD = re.compile(r"@!?U?P\w+\s+")


def _opcode(instruction):
    """The opcode of an instruction's text, its modifiers included (`STS.128`), unguarded."""
    return _GUARD.sub("", instruction, count=1).split(None, 1)[0]


def loop_shared_stores(sass):
    """STS instructions in each loop of `sass` (nvdisasm -c output): the instructions from a
    label to a later branch back to it, in the order of the branches."""
    label_at, counts = {}, []
    instructions = []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            label_at[label.group(1)] = len(instructions)
            continue
        op = _INSTRUCTION.match(line)
        if op:
            instructions.append(op.group(1))
            back = re.search(r"\bBRA\s+`\(\.(L_x_\d+)\)", op.group(1))
            if back and back.group(1) in label_at:
                body = instructions[label_at[back.group(1)]:]
                counts.append(sum(_opcode(i).split(".")[0] == "STS" for i in body))
    return counts


def compile_tile(tile):
    """`sass_stats` of rotary_kernel compiled for sm_90 with the Variant fields `tile` over
    DEFAULT_TILE, for `example_arguments` of the data type tile["dtype"] (default "bf16")."""
    fields = {k: v for k, v in tile.items() if k != "dtype"}
    args = example_arguments(K.Variant(**{**DEFAULT_TILE, **fields}), tile.get("dtype", "bf16"))
    sig, constexprs, attrs = signature(K.rotary_kernel, args)
    kernel = triton.compile(ASTSource(fn=K.rotary_kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return sass_stats(kernel)


def sass_stats(kernel):
    """{"sin": sin.approx count in the PTX, "loads": the SASS's global loads in order,
    "load_at": their indices among the instructions, "sincos_at": those of its MUFU.SIN and
    MUFU.COS, "loop_shared_stores": `loop_shared_stores`
    of the SASS, "instructions": its instructions but NOPs, "rcp": its MUFU.RCP} of a kernel
    that triton.compile returned."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    ops = [op for op in map(_opcode, _INSTRUCTION.findall(sass)) if op != "NOP"]
    return {"sin": len(re.findall(r"sin\.approx\.f32", kernel.asm["ptx"])),
            "loads": [op for op in ops if op.startswith("LDG.")],
            "load_at": [i for i, op in enumerate(ops) if op.startswith("LDG.")],
            "loop_shared_stores": loop_shared_stores(sass),
            "sincos_at": [i for i, op in enumerate(ops) if op in ("MUFU.SIN", "MUFU.COS")],
            "instructions": len(ops),
            "rcp": ops.count("MUFU.RCP")}


_POINTER_TYPES = {"float64": "*fp64", "float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16",
                  "int64": "*i64", "int32": "*i32"}


def launch_record(kernel, args, constexprs, num_warps, options=None):
    """A planned launch as JSON: the kernel's name, its arguments (NamedTuples as
    {"group": name, "fields": [...]}, a tensor as its pointer type), its compile-time choices
    (`constexprs`, the last arguments: a Variant or a WeightGradientTile, as a group; q's and
    k's Variants for rotary_qk_kernel), the warps and the other compile options it passes
    (`maxnreg`)."""
    def encode(value):
        if hasattr(value, "_fields"):
            return {"group": type(value).__name__, "fields": [encode(v) for v in value]}
        if isinstance(value, tuple):
            return [encode(v) for v in value]
        if hasattr(value, "data_ptr"):
            return _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
        return value
    return {"kernel": kernel.__name__, "args": [encode(a) for a in args], "constexprs": [encode(c) for c in constexprs],
            "num_warps": num_warps, "options": dict(options or {})}


def planned_launch_record(launch, args):
    """`launch_record` of a launch the launcher planned: a triton_rotary_launch `_Launch`
    called with `args` (its groups as the plain tuples the launcher passes)."""
    from triton_rotary_launch import _as_group
    named = [_as_group(a, g) for a, g in zip(args, launch.groups)]
    return launch_record(launch.kernel.fn, (*named, *args[len(launch.groups):]),
                         launch.constexprs, launch.num_warps, launch.options)


def compile_launch(record):
    """A `launch_record` compiled for sm_90, specialized as Triton's JIT would specialize it
    (triton.compile's kernel)."""
    def decode(value):
        if isinstance(value, dict):
            return getattr(K, value["group"])(*map(decode, value["fields"]))
        if isinstance(value, list):
            return tuple(map(decode, value))
        return value
    fn = getattr(K, record["kernel"])
    args = (*map(decode, record["args"]), *map(decode, record["constexprs"]))
    sig, constexprs, attrs = signature(fn, args)
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": record["num_warps"], **record.get("options", {})})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch-stats"]:
        with open(sys.argv[2]) as f:
            for record in json.load(f):
                print(json.dumps(sass_stats(compile_launch(record))), flush=True)
    elif sys.argv[1:2] == ["--launches"]:
        with open(sys.argv[2]) as f:
            for record in json.load(f):
                try:
                    compile_launch(record)
                    print(json.dumps({"ok": True}), flush=True)
                except Exception as err:   # the report names the launch that failed
                    print(json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"[-2000:]}),
                          flush=True)
    else:
        for arg in sys.argv[1:]:
            print(json.dumps(compile_tile(json.loads(arg))), flush=True)
