"""Public API: a drop-in for Transformer Engine's `apply_rotary_pos_emb` and
`RotaryPositionEmbedding`, backed by the Triton kernels in `triton_rotary_kernel.py` (launched by
`triton_rotary_launch.py`), plus angles computed in the kernel from positions.

    rope = RotaryPositionEmbedding(128)                               # or .from_hf_config(cfg)
    freqs = rope(max_seq_len=4096)                                    # TE's table [s2, 1, 1, d2]
    q = apply_rotary_pos_emb(q, freqs, tensor_format="sbhd")          # Triton, autograd-aware
    q = apply_rotary_pos_emb(q, rope, positions=pos)                  # exact angles, no table
    q = apply_rotary_pos_emb(q, freqs, norm_weight=q_norm.weight)     # Qwen3's QK-norm, fused
    q_ref = apply_rotary_pos_emb(q, freqs, fused=False)               # pure-PyTorch formula
"""

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

import torch
from torch._C import _functorch as _FUNCTORCH  # private: _check_untransformed says what of it

from triton_rotary_launch import (
    AngleSource,
    RMSNorm,
    angle_source,
    check_layout,
    check_norm,
    check_norm_options,
    check_norm_pair,
    check_qk_norms,
    check_qk_pair,
    check_qkv_args,
    check_qkv_norms,
    check_rope_args,
    is_finite_number,
    is_real_number,
    norm_rstd,
    qkv_outputs,
    saves_rstd,
    set_rotary_kernel,
    set_rotary_kernel_transposed,
    set_rotary_qk_kernel,
    set_rotary_qk_kernel_transposed,
    set_rotary_qkv_kernel,
)

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_qk", "apply_rotary_pos_emb_inplace",
           "apply_fused_qkv_rotary_pos_emb", "RopeForwardAndBackward", "QKRopeForwardAndBackward",
           "RopeNormForwardAndBackward", "FusedQKVRopeForwardAndBackward",
           "FusedQKVRopeNormForwardAndBackward", "RotaryPositionEmbedding"]


# rope_type -> how its parameters are read; "mrope" is Qwen2-VL's legacy name for the default
# frequencies (transformers' Qwen2VLTextConfig rewrites it to "default" the same way).
_SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_ROPE_TYPE_ALIASES = {"mrope": "default"}
# These depend on the sequence length of each call (transformers recomputes inv_freq from
# max(position_ids) in forward, and for "dynamic" also on the longest call seen so far), which a
# module that builds one inv_freq at construction cannot reproduce.
_UNSUPPORTED_ROPE_TYPES = {
    "dynamic": "its base grows with the longest sequence seen at call time",
    "longrope": "it switches between short and long factors by the sequence length at call time",
}


def _python_number(value):
    """A real number (numpy's scalars and the fractions module's included) as the Python int or
    float of its value, so that the constructor's arithmetic after its checks is Python's
    whatever type the number came in (numpy's float32 would keep it in float32); anything else
    (bools too) as it is, for the checks to name."""
    if not is_real_number(value):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _rope_number(rope_scaling, key, rope_type, *, allow_none=False, positive=True):
    if key not in rope_scaling:
        raise ValueError(f"rope_scaling[{key!r}] is required for rope_type {rope_type!r}")
    value = rope_scaling[key]
    if value is None and allow_none:
        return None
    if not is_finite_number(value):
        raise (ValueError if is_real_number(value) else TypeError)(
            f"rope_scaling[{key!r}] must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be > 0, got {value!r}")
    return value


def _rope_type_of(rope_scaling) -> str:
    # transformers' precedence: "rope_type" first, the legacy "type" only when it is absent
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type in _UNSUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported "
                         f"({_UNSUPPORTED_ROPE_TYPES[rope_type]}); supported rope types: "
                         f"{', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling has unknown rope_type {rope_type!r}; supported rope types: "
                         f"{', '.join(_SUPPORTED_ROPE_TYPES)}")
    return rope_type


def _original_max_positions(rope_scaling, max_position_embeddings, rope_type):
    # transformers fills a missing original_max_position_embeddings from max_position_embeddings
    value = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    if value is None:
        raise ValueError(f"rope_type {rope_type!r} needs rope_scaling['original_max_position_embeddings'] "
                         "or max_position_embeddings")
    if not is_finite_number(value) or not value > 0:
        raise ValueError(f"original_max_position_embeddings must be a positive number, got {value!r}")
    return value


# The inverse-frequency builders below reproduce transformers' float32 arithmetic op for op, in
# the same order and with the same Python-scalar/tensor mixing: `scalar / tensor` is computed by
# torch as reciprocal-then-multiply, so e.g. `2 * math.pi / inv_freq` and
# `torch.full_like(inv_freq, 2 * math.pi) / inv_freq` differ in the last bit. They always run on
# the CPU, as transformers' rotary modules call them (device=None), and are moved afterwards.

def _base_inv_freq(base, d2):
    return 1.0 / (base ** (torch.arange(0, d2, 2, dtype=torch.float32) / d2))


def _llama3_inv_freq(base, d2, rope_scaling, max_position_embeddings):
    factor = _rope_number(rope_scaling, "factor", "llama3")
    low_freq_factor = _rope_number(rope_scaling, "low_freq_factor", "llama3")
    high_freq_factor = _rope_number(rope_scaling, "high_freq_factor", "llama3")
    if high_freq_factor <= low_freq_factor:
        raise ValueError("rope_scaling['high_freq_factor'] must be greater than rope_scaling['low_freq_factor'], "
                         f"got {high_freq_factor} <= {low_freq_factor}")
    old_context_len = _original_max_positions(rope_scaling, max_position_embeddings, "llama3")
    inv_freq = _base_inv_freq(base, d2)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by factor, short ones kept, the band between blended linearly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base, d2, rope_scaling, max_position_embeddings):
    original = _original_max_positions(rope_scaling, max_position_embeddings, "yarn")
    factor = _rope_number(rope_scaling, "factor", "yarn", allow_none=True)
    if factor is None:
        # DeepSeek-V3 style: the factor is implied by the two context lengths
        if max_position_embeddings is None:
            raise ValueError("rope_scaling['factor'] is None, so yarn needs max_position_embeddings to derive it")
        factor = max_position_embeddings / original
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if value is not None and not is_finite_number(value):
                raise ValueError(f"rope_scaling[{key!r}] must be a finite number, got {value!r}")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    elif not is_finite_number(attention_factor) or not attention_factor > 0:
        raise ValueError(f"rope_scaling['attention_factor'] must be a finite number > 0, got "
                         f"{attention_factor!r}")
    # falsy values (None, 0) fall back to the paper's defaults, as in transformers
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1
    for key, value in (("beta_fast", beta_fast), ("beta_slow", beta_slow)):
        if not is_finite_number(value) or not value > 0:
            raise ValueError(f"rope_scaling[{key!r}] must be a finite number > 0, got {value!r}")
    if not isinstance(rope_scaling.get("truncate", True), bool):
        raise TypeError(f"rope_scaling['truncate'] must be a bool, got "
                        f"{rope_scaling['truncate']!r}")

    def correction_dim(rotations):
        # the pair index whose wavelength completes `rotations` turns over the original context
        return (d2 * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d2 - 1)
    if low == high:
        high += 0.001       # a zero-width ramp would divide by zero

    pos_freqs = base ** (torch.arange(0, d2, 2).to(dtype=torch.float32) / d2)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(d2 // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp         # 1 where a pair keeps its original frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, attention_factor


def _rope_inv_freq(rope_type, base, d2, rope_scaling, max_position_embeddings):
    """(float32 CPU inv_freq [d2/2], attention_scaling) as transformers computes them."""
    if rope_type == "default":
        return _base_inv_freq(base, d2), 1.0
    if rope_type == "linear":
        factor = _rope_number(rope_scaling, "factor", "linear")
        inv_freq = _base_inv_freq(base, d2)
        inv_freq /= factor
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, d2, rope_scaling, max_position_embeddings), 1.0
    return _yarn_inv_freq(base, d2, rope_scaling, max_position_embeddings)


def _mrope_pair_axis(mrope_section, mrope_interleaved, n_pairs):
    """Position axis of each rotated pair, int32 [n_pairs]."""
    axis = torch.zeros(n_pairs, dtype=torch.int32)
    if mrope_section is None:
        return axis
    if mrope_interleaved:
        # Qwen3-VL: axis a in (1, 2) owns every third pair from a, over its first 3*s_a pairs;
        # the temporal axis keeps every other pair.
        k = torch.arange(n_pairs)
        for a in (1, 2):
            axis[(k % 3 == a) & (k < 3 * mrope_section[a])] = a
        return axis
    # Qwen2-VL / Qwen2.5-VL: consecutive blocks of pairs, block i from axis i
    start = 0
    for a, size in enumerate(mrope_section):
        axis[start:start + size] = a
        start += size
    return axis


def _check_mrope_section(mrope_section, mrope_interleaved, n_pairs):
    if mrope_section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved=True needs mrope_section")
        return None
    if isinstance(mrope_section, (str, bytes)) or not hasattr(mrope_section, "__iter__"):
        raise TypeError(f"mrope_section must be a sequence of ints, got {mrope_section!r}")
    section = tuple(mrope_section)
    if not section or not all(isinstance(s, int) and not isinstance(s, bool) for s in section):
        raise TypeError(f"mrope_section must be a non-empty sequence of ints, got {mrope_section!r}")
    if any(s < 0 for s in section):
        raise ValueError(f"mrope_section must be non-negative, got {section}")
    if sum(section) != n_pairs:
        raise ValueError(f"mrope_section {section} must sum to rotary_dim / 2 = {n_pairs}, got {sum(section)}")
    if mrope_interleaved and len(section) != 3:
        # the interleaved layout (Qwen3-VL) is defined only for temporal, height and width
        raise ValueError(f"mrope_interleaved=True needs 3 mrope_section entries, got {section}")
    return section


def _config_get(config, key, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _config_pair_layout(config):
    """`interleaved` as a transformers config states it (`from_hf_config` says which)."""
    flag = _config_get(config, "rope_interleave")
    if flag is not None:
        if not isinstance(flag, bool):
            raise TypeError(f"config's rope_interleave must be a bool, got {type(flag).__name__}")
        return flag
    if _config_get(config, "qk_rope_head_dim") is not None:
        raise ValueError("config is of a latent-attention model (it has qk_rope_head_dim) but no "
                         "rope_interleave, and such models pair channels differently (DeepSeek-V2 "
                         "adjacent ones; DeepSeek-V3 adjacent ones unless rope_interleave=False): "
                         "pass interleaved=True or False")
    return False


# Text models whose rotary embedding in transformers (5.24) interleaves the M-RoPE axes, every
# third pair from the second taking the height and from the third the width, whatever their
# config's mrope_interleaved says, with the mrope_section it takes where the config has none.
_INTERLEAVED_MROPE_MODELS = {
    **dict.fromkeys(("qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_omni_moe_text",
                     "cohere_compass_text", "cosmos3_edge_text", "hy_v4_vl_text"), (24, 20, 20)),
    **dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text"), (11, 11, 10)),
}


class RotaryPositionEmbedding(torch.nn.Module):
    """Rotary frequencies as TE's module builds them: `forward(max_seq_len, offset=0)` returns
    float32 `[max_seq_len, 1, 1, d2]` with d2 = int(dim * rotary_percent), laid out for the
    rotate-half (`interleaved=False`) or adjacent-pair (`interleaved=True`) form.

    Beyond TE, it takes Hugging Face transformers' RoPE scaling and multimodal (M-RoPE) settings:

    * `rope_scaling`: a dict in transformers' form, rope_type (or legacy `type`) one of "default",
      "linear", "yarn", "llama3"; `max_position_embeddings` fills in what transformers takes from
      the model config (yarn's and llama3's original length, yarn's implied factor).
    * `inv_freq` [d2/2] float32 is bitwise transformers' for the same config;
      `attention_scaling` is its factor on cos and sin (1.0 except for yarn). The table of
      `forward` holds angles only, so `attention_scaling` is not in it.
    * `mrope_section` / `mrope_interleaved`: pair k rotates by position axis `pair_axis[k]`
      (Qwen2-VL contiguous blocks, or Qwen3-VL interleaving); `n_axes` axes in all. `forward`'s
      table uses one position per token, i.e. the text case where every axis is equal.

    `inv_freq` stays float32 when the module, or a model holding it, is cast to another dtype
    (`.to(torch.bfloat16)`, `.half()`, `.double()`): the angles need float32 frequencies (in
    bf16 an inverse frequency is off by up to 2^-8 of itself: angles off by up to 0.6 rad at
    position 512 and 5 rad at 4096, d 128). Moves to another device apply as usual.
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None,
                 rotary_base: float = 10000.0, interleaved: bool = False,
                 device: Optional[torch.device] = None, *,
                 rope_scaling: Optional[Mapping] = None,
                 max_position_embeddings: Optional[int] = None,
                 mrope_section: Optional[Sequence[int]] = None,
                 mrope_interleaved: bool = False):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        (rotary_percent, rotary_base, max_position_embeddings, seq_len_interpolation_factor,
         pretrained_max_position_embeddings) = map(_python_number, (
            rotary_percent, rotary_base, max_position_embeddings, seq_len_interpolation_factor,
            pretrained_max_position_embeddings))
        if not is_finite_number(rotary_percent) or not 0 < rotary_percent <= 1:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent!r}")
        if not is_finite_number(rotary_base) or not rotary_base > 0:
            raise ValueError(f"rotary_base must be a positive number, got {rotary_base!r}")
        for name, value in (("max_position_embeddings", max_position_embeddings),
                            ("seq_len_interpolation_factor", seq_len_interpolation_factor),
                            ("pretrained_max_position_embeddings",
                             pretrained_max_position_embeddings)):
            if value is not None and (not is_finite_number(value) or not value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim == 0 or dim % 2:
            raise ValueError(f"the rotary dimension int(dim * rotary_percent) = {dim} must be even and > 0")

        if rope_scaling is None:
            rope_scaling = {}
        if not isinstance(rope_scaling, Mapping):
            raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
        rope_scaling = {key: _python_number(value) for key, value in rope_scaling.items()}
        rope_type = _rope_type_of(rope_scaling)
        # transformers 5 keeps these inside its rope dict; a second, different value is ambiguous
        for key, ours, name in (("rope_theta", rotary_base, "rotary_base"),
                                ("partial_rotary_factor", rotary_percent, "rotary_percent")):
            theirs = rope_scaling.get(key)
            if theirs is not None and float(theirs) != float(ours):
                raise ValueError(f"rope_scaling[{key!r}] = {theirs!r} disagrees with {name} = {ours!r}")
        if mrope_section is None:
            mrope_section = rope_scaling.get("mrope_section")
        elif rope_scaling.get("mrope_section") is not None and \
                tuple(rope_scaling["mrope_section"]) != tuple(mrope_section):
            raise ValueError(f"rope_scaling['mrope_section'] = {rope_scaling['mrope_section']!r} disagrees with "
                             f"mrope_section = {mrope_section!r}")
        for name, flag in (("interleaved", interleaved), ("mrope_interleaved", mrope_interleaved),
                           ("rope_scaling['mrope_interleaved']",
                            rope_scaling.get("mrope_interleaved", False))):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        mrope_interleaved = mrope_interleaved or rope_scaling.get("mrope_interleaved", False)
        n_pairs = dim // 2
        mrope_section = _check_mrope_section(mrope_section, mrope_interleaved, n_pairs)

        try:
            inv_freq, attention_scaling = _rope_inv_freq(rope_type, rotary_base, dim, rope_scaling,
                                                         max_position_embeddings)
        except (ArithmeticError, ValueError) as err:
            if not isinstance(err, ArithmeticError) and "math domain" not in str(err):
                raise                        # the settings' own checks, each naming its key
            raise ValueError(f"rotary_base={rotary_base!r} with rope_scaling={dict(rope_scaling)!r} "
                             f"gives no frequencies ({err})") from None
        # A frequency of 0 or inf, or a scale of NaN, would rotate every token the same way or
        # make every output NaN.
        if not (torch.isfinite(inv_freq).all() and (inv_freq > 0).all()):
            raise ValueError(f"rotary_base={rotary_base!r} with rope_scaling={dict(rope_scaling)!r} "
                             f"gives inverse frequencies that are not finite and > 0")
        if not (math.isfinite(attention_scaling) and attention_scaling > 0):
            raise ValueError(f"rope_scaling={dict(rope_scaling)!r} gives an attention scaling of "
                             f"{attention_scaling}; it must be finite and > 0")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.rotary_base = rotary_base
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        self.rotary_dim = dim
        self.rope_type = rope_type
        self.attention_scaling = float(attention_scaling)
        self.max_position_embeddings = max_position_embeddings
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved if mrope_section is not None else False
        self.n_axes = 1 if mrope_section is None else len(mrope_section)
        self.register_buffer("inv_freq", inv_freq.to(device))
        # not persistent, so state dicts keep TE's single entry
        self.register_buffer("pair_axis", _mrope_pair_axis(mrope_section, mrope_interleaved, n_pairs).to(device),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to, .half(), .cuda() and the others convert buffers through Module._apply (a
        # private method, overridden as torch 2.11 and 2.13 define it; the dtype's test is
        # test_module_keeps_float32_frequencies). A dtype change is undone from the float32
        # values, not by casting back, which would keep the rounding.
        float32 = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != float32.dtype:
            self.inv_freq = float32.to(self.inv_freq.device)
        return self

    @classmethod
    def from_hf_config(cls, config, device: Optional[torch.device] = None,
                       interleaved: Optional[bool] = None):
        """The rotary embedding of a transformers model config (a PretrainedConfig or its dict):
        transformers 5's `rope_parameters` or transformers 4's `rope_theta` + `rope_scaling`,
        taken from `text_config` when the config is a multimodal wrapper. The rotary dim of a
        multi-head latent attention model is its `qk_rope_head_dim`.

        `interleaved`: which channels pair up, which transformers decides in each model's code,
        not always in its config. None takes the config's `rope_interleave` (DeepSeek-V3,
        Mistral 4, GLM-4-MoE-Lite: adjacent pairs when True), else the two halves (Llama,
        Qwen, Mistral, Gemma); a latent-attention config without `rope_interleave` (DeepSeek-V3's
        own config.json, DeepSeek-V2) is refused, since those models differ. Pass True for a
        model that pairs adjacent channels without saying so in its config (Llama 4,
        DeepSeek-V2); a value given here wins over the config's.

        M-RoPE (`mrope_section`, `n_axes` 3) follows the config's `mrope_section` and
        `mrope_interleaved`, except for the text models whose transformers code always
        interleaves the axes (Qwen3-VL, Qwen3-Omni, Qwen3.5 and their MoE variants: the keys of
        `_INTERLEAVED_MROPE_MODELS`, by `model_type`), which take that layout, and, where the
        config has no section, the one transformers defaults to."""
        text_config = _config_get(config, "text_config")
        if text_config is not None and _config_get(config, "num_attention_heads") is None \
                and _config_get(config, "head_dim") is None:
            config = text_config
        rope = _config_get(config, "rope_parameters") or _config_get(config, "rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise TypeError(f"config's rope_parameters / rope_scaling must be a dict, got {type(rope).__name__}")
        if rope and all(isinstance(v, Mapping) or v is None for v in rope.values()):
            raise ValueError(f"config has per-layer-type rope_parameters ({', '.join(rope)}); "
                             "build one RotaryPositionEmbedding per layer type instead")
        if _config_get(config, "rope_local_base_freq") is not None:
            # transformers 4's form of the same (Gemma 3's config.json)
            raise ValueError("config has rope_local_base_freq: its sliding-window layers rotate with "
                             "another base than its full-attention ones; build one "
                             "RotaryPositionEmbedding per layer type instead (the sliding layers': "
                             "rotary_base=rope_local_base_freq, no rope_scaling)")
        rope = dict(rope)
        rope_type = _rope_type_of(rope)
        rope["rope_type"] = rope_type
        rope.pop("type", None)

        theta = rope.get("rope_theta")
        if theta is None:
            theta = _config_get(config, "rope_theta")
        if theta is None:
            theta = _config_get(config, "default_theta", 10000.0)
        rope["rope_theta"] = theta
        partial = rope.get("partial_rotary_factor")
        if partial is None:
            partial = _config_get(config, "partial_rotary_factor")
        partial = 1.0 if partial is None else partial
        rope["partial_rotary_factor"] = partial

        # Latent-attention configs rotate qk_rope_head_dim channels (transformers sets their
        # head_dim to it, but their config.json may have no head_dim).
        head_dim = _config_get(config, "qk_rope_head_dim")
        if head_dim is None:
            head_dim = _config_get(config, "head_dim")
        if head_dim is None:
            hidden, heads = _config_get(config, "hidden_size"), _config_get(config, "num_attention_heads")
            if hidden is None or heads is None:
                raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
            for key, value in (("hidden_size", hidden), ("num_attention_heads", heads)):
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"config's {key} must be a positive int, got {value!r}")
            head_dim = hidden // heads
        max_positions = _config_get(config, "max_position_embeddings")
        # Phi-3 keeps the pre-training length at the top level, and there it wins (as in transformers)
        top_original = _config_get(config, "original_max_position_embeddings")
        if top_original is not None and rope_type in ("yarn", "llama3"):
            rope["original_max_position_embeddings"] = top_original

        if interleaved is None:
            interleaved = _config_pair_layout(config)
        # The constructor reads mrope_section and mrope_interleaved from the rope dict; only
        # transformers' fixed layout overrides them.
        mrope = {}
        default_section = _INTERLEAVED_MROPE_MODELS.get(_config_get(config, "model_type"))
        if default_section is not None:
            section = rope.get("mrope_section")
            mrope = dict(mrope_interleaved=True,
                         mrope_section=default_section if section is None else section)
        return cls(head_dim, rotary_percent=partial, rotary_base=theta, interleaved=interleaved, device=device,
                   rope_scaling=rope, max_position_embeddings=max_positions, **mrope)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        for name, value in (("max_seq_len", max_seq_len), ("offset", offset)):
            if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if max_seq_len < 0:
            raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
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


class RopeCall(NamedTuple):
    """Everything about one RoPE launch except the tensor rotated: what `ctx` keeps for the
    backward, which is the same call with the rotation transposed."""
    source: AngleSource
    tensor_format: str
    start_positions: Optional[torch.Tensor]
    interleaved: bool
    cu_seqlens: Optional[torch.Tensor]
    cp_size: int
    cp_rank: int
    positions: Optional[torch.Tensor]
    inverse: bool           # rotate by the negated angles
    transpose: bool         # the transpose of that rotation (the backward)
    norm: Optional[RMSNorm] = None    # QK-norm before the rotation


# The tensors a call's backward reads besides the gradient go through ctx.save_for_backward, so
# that modifying one in place before the backward raises PyTorch's in-place error, as it does
# with TE, instead of giving the gradient of other angles or positions. ctx.call keeps the rest
# (it holds the same tensors; a backward unpacks saved_tensors, which checks them, before it
# launches).

def _save_rope_call(ctx, call, *inputs):
    """Keep `call` for the backward; `inputs`, the other tensors it reads (a norm's input and
    weight), are saved first."""
    source = call.source
    ctx.save_for_backward(*inputs, source.angles, source.pair_axis, call.start_positions,
                          call.cu_seqlens, call.positions)
    ctx.call = call


def _source_with(source, angles, pair_axis):
    """`source` with the tensors the backward took from saved_tensors (built directly:
    NamedTuple._replace costs more CPU time on every step)."""
    return AngleSource(angles, source.from_positions, pair_axis, source.n_axes, source.scale,
                       source.interleaved)


def _backward_rope_call(ctx):
    """(the backward's call, the inputs saved with it): the forward's call, with its tensors
    from saved_tensors and the rotation transposed."""
    *inputs, angles, pair_axis, start_positions, cu_seqlens, positions = ctx.saved_tensors
    call = ctx.call
    return RopeCall(_source_with(call.source, angles, pair_axis), call.tensor_format,
                    start_positions, call.interleaved, cu_seqlens, call.cp_size, call.cp_rank,
                    positions, call.inverse, not call.transpose, call.norm), inputs


def _eager_transposed(ctx):
    """(the eager forward's launch plan, then the rest of the transposed launcher's arguments:
    `set_rotary_kernel_transposed`'s, `set_rotary_qk_kernel_transposed`'s after the gradients)
    where a backward launches the forward's plan transposed straight: eager, with no graph to
    record, and a forward that kept its plan (one with elements). Else None. A RopeCall or a
    plan's key worked out in the backward costs CPU time on every step, twice as much on
    autograd's device thread. Unpacks saved_tensors first, which raises if one was modified in
    place."""
    plan = getattr(ctx, "plan", None)
    if plan is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    ctx.saved_tensors       # noqa: B018
    call = ctx.call
    return (plan, call.source, call.tensor_format, call.start_positions, call.interleaved,
            call.cu_seqlens, call.cp_size, call.cp_rank, not call.transpose, call.positions,
            call.inverse)


# The types and values of the entry points' norm options (eps, offset, over) as their
# signatures default them: types first, so that the comparison stops at an odd type.
_NORM_DEFAULTS = (float, float, str, 1e-6, 0.0, "head")


def _rms_norm(weight, eps, offset, over):
    """The entry points' norm arguments as an RMSNorm (None without a weight), eps and offset
    as floats (the custom ops' schema). The options are checked here, with or without a
    weight (without one, only where they are not the defaults: a call that has no norm pays
    one comparison); the weight against the input with the rest of the call (`check_norm`)."""
    if weight is None:
        if (type(eps), type(offset), type(over), eps, offset, over) != _NORM_DEFAULTS:
            check_norm_options(eps, offset, over)
        return None
    check_norm_options(eps, offset, over)
    return RMSNorm(weight, float(eps), float(offset), over)


def _refuse_double_backward():
    """The QK-norm backward launches are not differentiable: under create_graph=True (double
    backward, gradient penalties) say so instead of returning a gradient without a graph."""
    if torch.is_grad_enabled():
        raise RuntimeError("double backward (create_graph=True) through a fused QK-norm call is not "
                           "supported; call with fused=False for a twice-differentiable QK-norm")


class RopeNormForwardAndBackward(torch.autograd.Function):
    """QK-norm then RoPE: one launch forward (normalize, weight, rotate) and one backward
    (rotate back, the norm's transpose, dL/dweight as partial sums), then the partial sums'
    reduction. The backward is not itself differentiable: double backward raises
    (`_refuse_double_backward`). The forward saves each row's rstd for the backward where
    `saves_rstd` says so (`RMSNorm.rstd`), eager and under torch.compile alike."""

    @staticmethod
    def forward(ctx, t, weight, call):
        rstd = None
        if saves_rstd(call.norm) and isinstance(t, torch.Tensor):
            out, rstd = _rope_norm_saving_rstd(t, call)
        else:
            out = _rope(t, call)
        _save_rope_call(ctx, call, t, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _refuse_double_backward()
        call, (t, weight, rstd) = _backward_rope_call(ctx)
        call = call._replace(norm=call.norm._replace(weight=weight, rstd=rstd))
        grad_t, grad_weight = _rope_norm_backward(grad_out, t, call)
        return grad_t, grad_weight, None


class RopeForwardAndBackward(torch.autograd.Function):
    """Autograd wiring: forward and backward are each one launch of `rotary_kernel`. The
    backward is this function again with the rotation transposed, so under
    `create_graph=True` the gradient is differentiable too (its backward is the forward).
    The call's options travel as one `RopeCall`: each extra argument of `apply` costs CPU
    time on every step."""

    @staticmethod
    def forward(ctx, t, call):
        _save_rope_call(ctx, call)
        if torch.compiler.is_compiling():
            return _rope(t, call)
        out, ctx.plan = _rope_eager(t, call, return_plan=True)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kept = _eager_transposed(ctx)
        if kept is not None:
            return set_rotary_kernel_transposed(grad_out, *kept), None
        call, _ = _backward_rope_call(ctx)
        if torch.is_grad_enabled():           # create_graph=True: record the gradient's graph
            return RopeForwardAndBackward.apply(grad_out, call), None
        return _rope(grad_out, call), None


class QKRopeForwardAndBackward(torch.autograd.Function):
    """q and k by the same angles: one launch of `rotary_qk_kernel` forward and one backward
    (the same launch with the rotation transposed; under `create_graph=True` this function
    again, so the gradient is differentiable too)."""

    @staticmethod
    def forward(ctx, q, k, call):
        _save_rope_call(ctx, call)
        if torch.compiler.is_compiling():
            return _rope_qk(q, k, call)
        outs, ctx.plan = _rope_qk_eager(q, k, call, return_plan=True)
        return outs

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        kept = _eager_transposed(ctx)
        if kept is not None:
            return (*set_rotary_qk_kernel_transposed(grad_q, grad_k, *kept), None)
        call, _ = _backward_rope_call(ctx)
        if torch.is_grad_enabled():           # create_graph=True: record the gradient's graph
            return (*QKRopeForwardAndBackward.apply(grad_q, grad_k, call), None)
        return (*_rope_qk(grad_q, grad_k, call), None)


class QKRopeNormForwardAndBackward(torch.autograd.Function):
    """QK-norm then RoPE of q and k by the same angles: one launch of `rotary_qk_kernel`
    forward and one backward (rotate back, the norms' transposes, dL/dweight as partial sums;
    two each way where `_joins` says so), then the weights' reduction. `call.norm` holds q's
    norm; k's has its settings, k_weight and k_rstd. Double backward raises
    (`_refuse_double_backward`). The forward saves each row's rstd for the backward, as
    `RopeNormForwardAndBackward` does."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, call):
        q_rstd = k_rstd = None
        if saves_rstd(call.norm) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            out_q, out_k, q_rstd, k_rstd = _rope_qk_norm_saving_rstd(q, k, k_weight, call)
        else:
            out_q, out_k = _rope_qk_norm(q, k, k_weight, call)
        _save_rope_call(ctx, call, q, k, q_weight, k_weight, q_rstd, k_rstd)
        return out_q, out_k

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        _refuse_double_backward()
        call, (q, k, q_weight, k_weight, q_rstd, k_rstd) = _backward_rope_call(ctx)
        call = call._replace(norm=call.norm._replace(weight=q_weight, rstd=q_rstd))
        return (*_rope_qk_norm_backward(grad_q, grad_k, q, k, k_weight, k_rstd, call), None)


# The kernels as torch.library ops, so that torch.compile(fullgraph=True) sees one opaque,
# shape-polymorphic node per launch instead of tracing (and specialising on) the launcher. A call
# crosses an op flattened to the types an op takes; the schemas below are the one statement of
# that order (the ops and their fakes take *args), `_rope_op_args` / `_qkv_op_args` flatten in
# it and `_rope_call` / `_qkv_call` read it back.
_ROPE_CALL_SCHEMA = ("Tensor angles, Tensor? pair_axis, bool from_positions, int n_axes, float scale, "
                     "str tensor_format, Tensor? start_positions, bool interleaved, Tensor? cu_seqlens, "
                     "int cp_size, int cp_rank, Tensor? positions, bool inverse, bool backward, "
                     "Tensor? norm_weight=None, float norm_eps=0.0, float norm_offset=0.0, "
                     "str norm_over=\"head\"")


def _rope_op_args(call):
    """A RopeCall as the rope ops' arguments, in _ROPE_CALL_SCHEMA's order."""
    src, norm = call.source, call.norm or RMSNorm(None, 0.0, 0.0, "head")
    return (src.angles, src.pair_axis, src.from_positions, src.n_axes, src.scale,
            call.tensor_format, call.start_positions, call.interleaved, call.cu_seqlens,
            call.cp_size, call.cp_rank, call.positions, call.inverse, call.transpose,
            norm.weight, norm.eps, norm.offset, norm.over)


def _rope_call(angles, pair_axis, from_positions, n_axes, scale, tensor_format, start_positions,
               interleaved, cu_seqlens, cp_size, cp_rank, positions, inverse, transpose,
               norm_weight=None, norm_eps=0.0, norm_offset=0.0, norm_over="head"):
    """The rope ops' arguments back into a RopeCall. The module's pair layout is not among
    them: it is checked before a call is flattened (`_compiled_or_eager`)."""
    norm = None if norm_weight is None else RMSNorm(norm_weight, norm_eps, norm_offset, norm_over)
    return RopeCall(AngleSource(angles, from_positions, pair_axis, n_axes, scale, None),
                    tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                    positions, inverse, transpose, norm)


def _rope_op_args_with_rstd(call):
    """A RopeCall whose norm may hold rstd (a backward's) as the norm backward ops' arguments:
    the rstd buffer (or None), then `_rope_op_args`'."""
    return (call.norm.rstd, *_rope_op_args(call))


def _rope_call_with_rstd(rstd, *args):
    """`_rope_op_args_with_rstd`'s arguments back into a RopeCall."""
    return _with_rstd(_rope_call(*args), rstd)


def _with_rstd(call, rstd):
    """`call` (a RopeCall with a norm) with the norm's rstd buffer `rstd`."""
    return call._replace(norm=call.norm._replace(rstd=rstd))


def _traced_scale(source):
    """`source` as the fake (shape) impls check it: with a scale of 1. The scale's value is
    the op's to check when the graph runs, where a bad one raises its plain ValueError. While
    Dynamo traces, the scale may be a symbol, or a constant it specialized (a NaN), and an
    error raised then reaches the user wrapped in Dynamo's TorchRuntimeError (torch 2.11;
    2.13 passes it through)."""
    return source._replace(scale=1.0)


def _check_rope_call(t, call):
    """The fake impls' checks of `call` on t."""
    call = call._replace(source=_traced_scale(call.source))
    shape = check_rope_args(t, call.source, call.tensor_format, call.start_positions,
                            call.cu_seqlens, call.cp_size, call.cp_rank, call.interleaved,
                            call.positions, need_kernel=False, inverse=call.inverse)
    if call.norm is not None:
        check_norm(call.norm, t, shape.nheads, shape.head_dim)


def _rope_eager(t, call, return_plan=False):
    """`call` on t, straight to the launcher (with return_plan=True: (result, launch plan))."""
    return set_rotary_kernel(t, call.source, call.tensor_format, call.start_positions,
                             call.interleaved, call.cu_seqlens, call.cp_size, call.cp_rank,
                             call.transpose, None, call.positions, call.inverse, call.norm,
                             return_plan=return_plan)


def _rope_qk_eager(q, k, call, return_plan=False):
    """`call` on q and k (it holds no norm), straight to the launcher (with return_plan=True:
    (results, launch plan))."""
    return set_rotary_qk_kernel(q, k, call.source, call.tensor_format, call.start_positions,
                                call.interleaved, call.cu_seqlens, call.cp_size, call.cp_rank,
                                call.transpose, call.positions, call.inverse,
                                return_plan=return_plan)


def _rope_qk_norm_eager(q, k, k_weight, call, k_rstd=None):
    """`call` on q and k, q normalized by call.norm and k by that norm with k_weight (and
    k_rstd, with call.norm.rstd), straight to the launcher."""
    return set_rotary_qk_kernel(q, k, call.source, call.tensor_format, call.start_positions,
                                call.interleaved, call.cu_seqlens, call.cp_size, call.cp_rank,
                                False, call.positions, call.inverse, call.norm,
                                call.norm._replace(weight=k_weight, rstd=k_rstd))


def _rope_qk_norm_backward_eager(grad_q, grad_k, q, k, k_weight, k_rstd, call):
    """(dq, dk, dL/dq_weight, dL/dk_weight) of `_rope_qk_norm_eager`'s call, from the forward's
    q and k (and their rstd, call.norm.rstd and k_rstd, where it saved them)."""
    return set_rotary_qk_kernel(grad_q, grad_k, call.source, call.tensor_format,
                                call.start_positions, call.interleaved, call.cu_seqlens,
                                call.cp_size, call.cp_rank, True, call.positions, call.inverse,
                                call.norm, call.norm._replace(weight=k_weight, rstd=k_rstd), q, k)


def _rope_inplace_eager(t, call):
    set_rotary_kernel(t, call.source, call.tensor_format, call.start_positions, call.interleaved,
                      call.cu_seqlens, call.cp_size, call.cp_rank, call.transpose, out=t,
                      positions=call.positions, inverse=call.inverse, norm=call.norm)
    # The kernel wrote t's memory unseen by autograd: as after PyTorch's own in-place ops, a
    # backward that saved t must refuse its new values instead of reading them.
    torch.autograd.graph.increment_version(t)


def _rope_norm_saving_rstd_eager(t, call):
    """(the result, each row's rstd) of a QK-norm call whose norm saves rstd (`saves_rstd`)."""
    rstd = norm_rstd(t, call.norm)
    return _rope_eager(t, _with_rstd(call, rstd)), rstd


def _rope_qk_norm_saving_rstd_eager(q, k, k_weight, call):
    """(q's result, k's, q's rows' rstd, k's) of `_rope_qk_norm_eager`'s call, its norms saving
    rstd."""
    q_rstd, k_rstd = norm_rstd(q, call.norm), norm_rstd(k, call.norm)
    outs = _rope_qk_norm_eager(q, k, k_weight, _with_rstd(call, q_rstd), k_rstd)
    return (*outs, q_rstd, k_rstd)


def _rope_norm_backward_eager(grad, t, call):
    """(the gradient of t, of the norm's weight) of a QK-norm call, from t, the forward's input
    (and its rows' rstd, call.norm.rstd, where the forward saved them)."""
    return set_rotary_kernel(grad, call.source, call.tensor_format, call.start_positions,
                             call.interleaved, call.cu_seqlens, call.cp_size, call.cp_rank,
                             True, None, call.positions, call.inverse, call.norm, norm_input=t)


@torch.library.custom_op("triton_rotary::rope", mutates_args=(),
                         schema=f"(Tensor t, {_ROPE_CALL_SCHEMA}) -> Tensor")
def _rope_op(t, *args):
    return _rope_eager(t, _rope_call(*args))


@_rope_op.register_fake
def _(t, *args):
    _check_rope_call(t, _rope_call(*args))
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.custom_op("triton_rotary::rope_qk", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, {_ROPE_CALL_SCHEMA}) -> (Tensor, Tensor)")
def _rope_qk_op(q, k, *args):
    return _rope_qk_eager(q, k, _rope_call(*args))


@_rope_qk_op.register_fake
def _(q, k, *args):
    call = _rope_call(*args)
    check_qk_pair(q, k)
    _check_rope_call(q, call)
    _check_rope_call(k, call)
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))


def _check_rope_qk_norm_call(q, k, k_weight, call, k_rstd=None):
    check_qk_pair(q, k)
    _check_rope_call(q, call)
    _check_rope_call(k, call._replace(norm=call.norm._replace(weight=k_weight, rstd=k_rstd)))


@torch.library.custom_op("triton_rotary::rope_qk_norm", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor k_norm_weight, {_ROPE_CALL_SCHEMA}) "
                                f"-> (Tensor, Tensor)")
def _rope_qk_norm_op(q, k, k_weight, *args):
    return _rope_qk_norm_eager(q, k, k_weight, _rope_call(*args))


@_rope_qk_norm_op.register_fake
def _(q, k, k_weight, *args):
    _check_rope_qk_norm_call(q, k, k_weight, _rope_call(*args))
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k))


# A norm that saves rstd (`saves_rstd`) returns the buffers from its forward op; the backward
# ops read them (None where the forward saved none).
@torch.library.custom_op("triton_rotary::rope_qk_norm_saving_rstd", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor k_norm_weight, {_ROPE_CALL_SCHEMA}) "
                                f"-> (Tensor, Tensor, Tensor, Tensor)")
def _rope_qk_norm_saving_rstd_op(q, k, k_weight, *args):
    return _rope_qk_norm_saving_rstd_eager(q, k, k_weight, _rope_call(*args))


@_rope_qk_norm_saving_rstd_op.register_fake
def _(q, k, k_weight, *args):
    call = _rope_call(*args)
    _check_rope_qk_norm_call(q, k, k_weight, call)
    return (*(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k)),
            norm_rstd(q, call.norm), norm_rstd(k, call.norm))


@torch.library.custom_op("triton_rotary::rope_qk_norm_backward", mutates_args=(),
                         schema=f"(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, "
                                f"Tensor k_norm_weight, Tensor? k_norm_rstd, Tensor? norm_rstd, "
                                f"{_ROPE_CALL_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")
def _rope_qk_norm_backward_op(grad_q, grad_k, q, k, k_weight, k_rstd, rstd, *args):
    return _rope_qk_norm_backward_eager(grad_q, grad_k, q, k, k_weight, k_rstd,
                                        _rope_call_with_rstd(rstd, *args))


@_rope_qk_norm_backward_op.register_fake
def _(grad_q, grad_k, q, k, k_weight, k_rstd, rstd, *args):
    call = _rope_call_with_rstd(rstd, *args)
    _check_rope_qk_norm_call(q, k, k_weight, call, k_rstd)
    return (*(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k)),
            torch.empty_like(call.norm.weight), torch.empty_like(k_weight))


@torch.library.custom_op("triton_rotary::rope_", mutates_args=("t",),
                         schema=f"(Tensor(a!) t, {_ROPE_CALL_SCHEMA}) -> ()")
def _rope_inplace_op(t, *args):
    _rope_inplace_eager(t, _rope_call(*args))


@_rope_inplace_op.register_fake
def _(t, *args):
    _check_rope_call(t, _rope_call(*args))


@torch.library.custom_op("triton_rotary::rope_norm_saving_rstd", mutates_args=(),
                         schema=f"(Tensor t, {_ROPE_CALL_SCHEMA}) -> (Tensor, Tensor)")
def _rope_norm_saving_rstd_op(t, *args):
    return _rope_norm_saving_rstd_eager(t, _rope_call(*args))


@_rope_norm_saving_rstd_op.register_fake
def _(t, *args):
    call = _rope_call(*args)
    _check_rope_call(t, call)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device), norm_rstd(t, call.norm)


@torch.library.custom_op("triton_rotary::rope_norm_backward", mutates_args=(),
                         schema=f"(Tensor grad, Tensor t, Tensor? norm_rstd, {_ROPE_CALL_SCHEMA}) "
                                f"-> (Tensor, Tensor)")
def _rope_norm_backward_op(grad, t, rstd, *args):
    return _rope_norm_backward_eager(grad, t, _rope_call_with_rstd(rstd, *args))


@_rope_norm_backward_op.register_fake
def _(grad, t, rstd, *args):
    call = _rope_call_with_rstd(rstd, *args)
    _check_rope_call(t, call)
    return (torch.empty(t.shape, dtype=t.dtype, device=t.device),
            torch.empty_like(call.norm.weight))


def _rope(t, call):
    """One launch of rotary_kernel: `call` on t."""
    return _compiled_or_eager(_rope_op, _rope_eager, (t,), call, _rope_op_args)


def _rope_qk(q, k, call):
    """One launch of rotary_qk_kernel: `call` on q and k."""
    return _compiled_or_eager(_rope_qk_op, _rope_qk_eager, (q, k), call, _rope_op_args)


def _rope_qk_norm(q, k, k_weight, call):
    """`call` on q and k with their norms: one launch of rotary_qk_kernel (two where
    triton_rotary_launch._joins says so)."""
    return _compiled_or_eager(_rope_qk_norm_op, _rope_qk_norm_eager, (q, k, k_weight), call,
                              _rope_op_args)


def _rope_qk_norm_saving_rstd(q, k, k_weight, call):
    """`_rope_qk_norm`, its norms saving rstd: (q's result, k's, q's rows' rstd, k's)."""
    return _compiled_or_eager(_rope_qk_norm_saving_rstd_op, _rope_qk_norm_saving_rstd_eager,
                              (q, k, k_weight), call, _rope_op_args)


def _rope_qk_norm_backward(grad_q, grad_k, q, k, k_weight, k_rstd, call):
    """One launch of rotary_qk_kernel and the weights' reductions: the backward of a QK-norm
    call on q and k (reading the forward's rstd, call.norm.rstd and k_rstd, where it saved
    them)."""
    return _compiled_or_eager(_rope_qk_norm_backward_op, _rope_qk_norm_backward_eager,
                              (grad_q, grad_k, q, k, k_weight, k_rstd), call,
                              _rope_op_args_with_rstd)


def _rope_norm_saving_rstd(t, call):
    """`_rope`, its norm saving rstd: (the result, each row's rstd)."""
    return _compiled_or_eager(_rope_norm_saving_rstd_op, _rope_norm_saving_rstd_eager, (t,),
                              call, _rope_op_args)


def _rope_norm_backward(grad, t, call):
    """One launch of rotary_kernel and the weight gradient's reduction: the backward of a
    QK-norm call (reading the forward's rstd, call.norm.rstd, where it saved them)."""
    return _compiled_or_eager(_rope_norm_backward_op, _rope_norm_backward_eager, (grad, t), call,
                              _rope_op_args_with_rstd)


def _qkv(qkv, call):
    """One launch of rotary_qkv_kernel: packed qkv -> (q, k, v)."""
    return _compiled_or_eager(_qkv_op, _qkv_eager, (qkv,), call, _qkv_op_args)


def _qkv_backward(dq, dk, dv, call):
    """One launch of rotary_qkv_kernel: (dq, dk, dv) -> the packed gradient of qkv."""
    return _compiled_or_eager(_qkv_backward_op, _qkv_backward_eager, (dq, dk, dv), call,
                              _qkv_op_args)


def _second_input(first, second):
    """`second`, or under torch.compile a view of it where it is `first`: Dynamo traces no
    autograd.Function given one tensor as two of its inputs (k as q, one weight for both
    norms); a view is another input, and its gradient reaches the same tensor."""
    if second is first and isinstance(second, torch.Tensor) and torch.compiler.is_compiling():
        return second.view_as(second)
    return second


def _check_fused(fused):
    # Any object would pick a path by its truth value: fused=None would run the slow formula.
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be a bool, got {type(fused).__name__}")


def _check_untransformed(**tensors):
    """A TypeError naming the first of `tensors` that a torch.func transform wraps (vmap's
    batched tensor, grad's or jvp's wrapper): the kernels read storage, which those wrappers
    have not, and would fail inside Triton. fused=False computes the formula with torch ops,
    which the transforms see through."""
    # torch._C._functorch is private; peek_interpreter_stack (None outside every transform,
    # but not while torch.compile traces) and is_functorch_wrapped_tensor, as torch 2.11 and
    # 2.13 define them. The stack first: it costs a tenth of a microsecond, is_compiling twice that.
    if _FUNCTORCH.peek_interpreter_stack() is None or torch.compiler.is_compiling():
        return
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and _FUNCTORCH.is_functorch_wrapped_tensor(x):
            raise TypeError(f"{name} is a tensor of a torch.func transform (vmap, grad, jvp, ...), "
                            f"which the fused kernels cannot read: pass fused=False, whose "
                            f"formula the transforms see through")


def _needs_grad(t):
    """Whether autograd records a call on t (anything but a tensor is left to the checks)."""
    return torch.is_grad_enabled() and getattr(t, "requires_grad", False)


def _compiled_or_eager(op, eager, tensors, call, op_args):
    """`eager(*tensors, call)`, or under torch.compile the custom op `op` on the tensors and the
    call flattened by `op_args`. Eager calls skip the op: its dispatcher costs
    CPU time on every call. A module's pair layout does not survive the flattening, so it is
    checked here, where the module is still known."""
    if torch.compiler.is_compiling():
        sources = (call.source,) if isinstance(call, RopeCall) else (call.q_source, call.k_source)
        for source in sources:
            check_layout(source, call.interleaved)
        return op(*tensors, *op_args(call))
    return eager(*tensors, call)


def _token_positions(shape, tensor_format, start_positions=None, cu_seqlens=None, cp_size=1,
                     cp_rank=0, device=None, positions=None, n_axes=1):
    """Position of every token (for a table: its row of freqs), and whether the token belongs
    to a sequence.

    Returns `(pos, in_seq)`, int64 and bool, shaped to broadcast against t without its
    [h, d] dims: [s, b] for sbhd, [b, s] for bshd, [t] for thd (with M-RoPE `positions`, a
    leading axis dim). Pure PyTorch, no host sync. `shape` is the RopeShape that
    `check_rope_args` returned for these arguments, which it has checked.
    """
    if positions is not None:
        pos = positions.long()
        if tensor_format == "thd":
            return pos, torch.ones(shape.num_tokens, dtype=torch.bool, device=device)
        if pos.dim() == (2 if n_axes > 1 else 1):                           # [s]: every batch entry
            pos = pos.unsqueeze(-2)
        pos = pos.expand(*pos.shape[:-2], shape.batch, shape.seq_len)      # [.., b, s]
        if tensor_format == "sbhd":
            pos = pos.transpose(-1, -2)
        return pos, torch.ones((), dtype=torch.bool, device=device)
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


def _pair_angles_to_channels(angles, interleaved):
    """[..., d2/2] angles of the pairs -> [..., d2] angles of the channels."""
    if interleaved:
        return angles.repeat_interleave(2, dim=-1)
    return torch.cat((angles, angles), dim=-1)


def _unfused_norm(t, norm, nheads, head_dim):
    """RMSNorm of t in plain PyTorch: statistics and weighting in float32 (float64 for float64
    t), rounded once to t's dtype, as Gemma 3's RMSNorm rounds."""
    check_norm(norm, t, nheads, head_dim)
    x = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    rows = x.flatten(-2) if norm.over == "token" else x
    rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + norm.eps)
    rows = rows * (norm.offset + norm.weight.to(x.dtype))
    return rows.view(x.shape).to(t.dtype)


def _unfused_rope(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                  cp_rank, positions=None, inverse=False, norm=None):
    """TE's unfused formula in plain PyTorch ops (autograd by PyTorch): cos/sin in float32,
    cast to t's dtype, then t * cos + rotate_half(t) * sin on the first d2 channels. For a
    RotaryPositionEmbedding, each angle is position * inv_freq computed in float64 (exact),
    its cos/sin rounded to float32 and scaled by the attention factor.
    Same conventions as the kernel off the happy path: tokens outside every thd sequence pass
    through; tokens whose position falls outside a freqs table get NaN in their rotated
    channels. Angles of 2^24 rad or more are the exception: computed here, NaN in the kernel.
    `inverse` negates the angles: t * cos - rotate_half(t) * sin. `norm` (an RMSNorm)
    normalizes t first (`_unfused_norm`)."""
    shape = check_rope_args(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size,
                            cp_rank, interleaved, positions, need_kernel=False, inverse=inverse)
    source = angle_source(freqs)
    if t.is_neg():
        t = t.resolve_neg()
    if norm is not None:
        t = _unfused_norm(t, norm, shape.nheads, shape.head_dim)
    pos, in_seq = _token_positions(shape, tensor_format, start_positions, cu_seqlens, cp_size,
                                   cp_rank, device=t.device, positions=positions,
                                   n_axes=source.n_axes)
    if source.from_positions:
        inv_freq = source.angles.double()
        if positions is not None and source.n_axes > 1:
            # pos [n_axes, ..., tokens]: pair k takes its position from axis pair_axis[k].
            axis_pos = pos.movedim(0, -1).double()                          # [..., n_axes]
            pair_pos = axis_pos[..., source.pair_axis.long()]               # [..., d2/2]
            pair_angles = pair_pos * inv_freq
        else:
            pair_angles = pos[..., None].double() * inv_freq
        angles = _pair_angles_to_channels(pair_angles, interleaved)            # float64
    else:
        table = source.angles[:, 0, 0, :]                                  # [s2, d2]
        pos_ok = (pos >= 0) & (pos < table.shape[0])
        angles = table[pos.clamp(0, max(table.shape[0] - 1, 0))] if table.shape[0] else \
            torch.zeros(*pos.shape, table.shape[1], device=t.device)
        angles = torch.where(pos_ok[..., None], angles, float("nan"))
    if tensor_format == "thd":
        # Tokens outside every sequence pass through: a finite stand-in angle keeps their
        # (unselected) rotation's NaN out of the gradient of the torch.where below.
        angles = torch.where(in_seq[:, None], angles, 0.0)
    # cos/sin rounded to float32 (the module's scaled), then to t's dtype, as TE's formula.
    cos = (torch.cos(angles).float() * source.scale).to(t.dtype)[..., None, :]  # over heads
    sin = (torch.sin(angles).float() * source.scale).to(t.dtype)[..., None, :]
    if inverse:
        sin = -sin
    rot, rest = t[..., :shape.rotary_dim], t[..., shape.rotary_dim:]
    rotated = rot * cos + _rotate_half(rot, interleaved) * sin
    if tensor_format == "thd":
        rotated = torch.where(in_seq[:, None, None], rotated, rot)
    return torch.cat((rotated, rest), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None,
                         interleaved: bool = False, fused: bool = True,
                         cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                         cp_rank: int = 0, positions: Optional[torch.Tensor] = None,
                         inverse: bool = False, norm_weight: Optional[torch.Tensor] = None,
                         norm_eps: float = 1e-6, norm_offset: float = 0.0,
                         norm_over: str = "head") -> torch.Tensor:
    """Apply rotary position embedding to `t` (Transformer Engine's signature and semantics,
    plus angles from positions, the inverse rotation and a fused QK-norm).

    t:               [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd); float32,
                     float16, bfloat16 (float64 also works, computed in float64). Any strides.
    freqs:           either TE's angle table [s2, 1, 1, d2], d2 even and <= d, s2 >= s * cp_size,
                     used as float32 (other floating dtypes are cast, as TE does), any strides;
                     or a `RotaryPositionEmbedding`: the kernel computes each angle as the exact
                     product position * inv_freq (no table, no float32 rounding of the angle),
                     times the module's attention scaling.
    start_positions: int32/int64 [b]: token j of sequence i uses position j + start_positions[i].
    interleaved:     rotate adjacent pairs (GPT-J) instead of the two halves (GPT-NeoX).
    fused:           True runs the Triton kernel; False the PyTorch formula.
    cu_seqlens:      int32/int64 [b + 1], thd only: sequence i is tokens cu[i]..cu[i+1]
                     (padded global offsets under context parallelism: a rank holds
                     cu // cp_size).
    cp_size/cp_rank: context parallelism with TE's load-balanced split.
    positions:       int32/int64 position of every token, replacing the implicit ones: [s]
                     (shared by the batch) or [b, s] for sbhd/bshd, [t] for thd (then without
                     cu_seqlens); with an M-RoPE module [n_axes, ...]. Not combined with
                     start_positions or cp_size > 1. With a table, the position is the row.
    inverse:         rotate by the negated angles, t * cos - rotate_half(t) * sin (undoes the
                     rotation; RoPE applied to attention values and outputs, as DeepSeek-V4
                     does). Its gradient is the rotation by the angles.
    norm_weight:     QK-norm: RMSNorm t before rotating it, in the same launch,
                     x * rsqrt(mean(x^2) + norm_eps) * (norm_offset + norm_weight), the mean
                     over each head's d channels (norm_over="head", weight [d]: Qwen3, and
                     Gemma 3 with norm_offset=1.0) or over all h * d channels of a token
                     (norm_over="token", weight [h * d]: OLMo 2). The norm covers the whole
                     head, rotated or not. Statistics, weighting and rotation are computed in
                     float32 and rounded once to t's dtype; transformers' modules round the
                     norm's output to t's dtype before RoPE (and Qwen3's before the weight), so
                     in bfloat16 ours is the closer of the two to the exact result. The
                     backward gives the gradients of t and norm_weight (its reduction over
                     tokens is deterministic); it is not itself differentiable.

    Returns a new contiguous tensor of t's shape and dtype; channels d2..d are copied
    (normalized, with a norm).
    Off the happy path (defined here, unlike TE): thd tokens outside every sequence (before
    cu_seqlens[0] or from cu_seqlens[-1] on) are returned unchanged; a token whose position
    falls outside a table's [0, s2) (too large start_positions or positions, inconsistent
    cu_seqlens) gets NaN in its rotated channels rather than reading out of bounds; so does
    an angle of 2^24 rad or more (a table's entry, or position * inv_freq of a
    RotaryPositionEmbedding, whose positions must also be below 2^24): the kernel's exact
    reduction of angles holds below that (docs/accuracy.md), while fused=False takes their
    cos and sin from PyTorch.
    cu_seqlens must be non-decreasing: its values are never read on the host (that would
    synchronise with the GPU), and with a decreasing entry a token is placed in some sequence
    in bounds, or passed through, which fused=False may place otherwise.
    As in TE, `freqs` is not differentiated: a table that requires grad gets no gradient here
    (fused=False differentiates it).
    """
    _check_fused(fused)
    norm = _rms_norm(norm_weight, norm_eps, norm_offset, norm_over)
    if not fused:
        return _unfused_rope(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens,
                             cp_size, cp_rank, positions, inverse, norm)
    _check_untransformed(t=t, freqs=freqs, start_positions=start_positions, cu_seqlens=cu_seqlens,
                         positions=positions, norm_weight=norm_weight)
    if norm is None and not _needs_grad(t) and not torch.compiler.is_compiling():
        # No graph to record: the arguments straight to the launcher, without a RopeCall or
        # the autograd function (autograd.Function.apply costs about as much CPU time as the
        # rest of a small call).
        return set_rotary_kernel(t, freqs, tensor_format, start_positions, interleaved,
                                 cu_seqlens, cp_size, cp_rank, False, None, positions, inverse)
    call = RopeCall(angle_source(freqs), tensor_format, start_positions, interleaved,
                    cu_seqlens, cp_size, cp_rank, positions, inverse, False, norm)
    if norm is not None:
        if not (_needs_grad(t) or _needs_grad(norm_weight)):
            return _rope(t, call)
        return RopeNormForwardAndBackward.apply(t, norm_weight, call)
    if not _needs_grad(t):          # under torch.compile: its custom op
        return _rope(t, call)
    return RopeForwardAndBackward.apply(t, call)


def apply_rotary_pos_emb_qk(q: torch.Tensor, k: torch.Tensor, freqs, tensor_format: str = "sbhd",
                            start_positions: Optional[torch.Tensor] = None,
                            interleaved: bool = False, fused: bool = True,
                            cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                            cp_rank: int = 0, positions: Optional[torch.Tensor] = None,
                            inverse: bool = False, q_norm_weight: Optional[torch.Tensor] = None,
                            k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 1e-6,
                            norm_offset: float = 0.0, norm_over: str = "head"):
    """`apply_rotary_pos_emb` of the queries and the keys by the same angles, as Hugging
    Face's and Liger's `apply_rotary_pos_emb(q, k, ...)` take them: returns (q's result,
    k's). q and k: the same format, tokens, head dim and dtype, any head counts (GQA, a rank
    of tensor parallelism). The other arguments are `apply_rotary_pos_emb`'s, for both.

    One launch rotates both, forward and backward. Without norms a program takes a token
    block's query heads and a share of its key heads and works their angles out once. With
    norms (q_norm_weight and k_norm_weight, both or neither; `norm_over`, `norm_eps` and
    `norm_offset` shared) q's programs and k's share the launch, each with the tiles of its
    own call of `apply_rotary_pos_emb`, where those tiles differ and take the same warps
    (else two launches, as two calls would make: triton_rotary_launch._joins says why).
    """
    _check_fused(fused)
    check_norm_pair(q_norm_weight, k_norm_weight)
    if not fused:
        # Two calls: their own checks do not compare q with k, nor name q's and k's weights.
        # (One launch: its plan does.)
        check_qk_pair(q, k)
        check_qk_norms(q, k, _rms_norm(q_norm_weight, norm_eps, norm_offset, norm_over),
                       _rms_norm(k_norm_weight, norm_eps, norm_offset, norm_over))
        kw = dict(tensor_format=tensor_format, start_positions=start_positions,
                  interleaved=interleaved, fused=fused, cu_seqlens=cu_seqlens, cp_size=cp_size,
                  cp_rank=cp_rank, positions=positions, inverse=inverse, norm_eps=norm_eps,
                  norm_offset=norm_offset, norm_over=norm_over)
        return (apply_rotary_pos_emb(q, freqs, norm_weight=q_norm_weight, **kw),
                apply_rotary_pos_emb(k, freqs, norm_weight=k_norm_weight, **kw))
    _check_untransformed(q=q, k=k, freqs=freqs, start_positions=start_positions,
                         cu_seqlens=cu_seqlens, positions=positions,
                         q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    call = RopeCall(angle_source(freqs), tensor_format, start_positions, interleaved,
                    cu_seqlens, cp_size, cp_rank, positions, inverse, False,
                    _rms_norm(q_norm_weight, norm_eps, norm_offset, norm_over))
    if call.norm is not None:
        if not any(map(_needs_grad, (q, k, q_norm_weight, k_norm_weight))):
            return _rope_qk_norm(q, k, k_norm_weight, call)
        return QKRopeNormForwardAndBackward.apply(
            q, _second_input(q, k), q_norm_weight, _second_input(q_norm_weight, k_norm_weight),
            call)
    if not (_needs_grad(q) or _needs_grad(k)):
        return _rope_qk(q, k, call)
    return QKRopeForwardAndBackward.apply(q, _second_input(q, k), call)


def apply_rotary_pos_emb_inplace(t: torch.Tensor, freqs, tensor_format: str = "sbhd",
                                 start_positions: Optional[torch.Tensor] = None,
                                 interleaved: bool = False,
                                 cu_seqlens: Optional[torch.Tensor] = None, cp_size: int = 1,
                                 cp_rank: int = 0,
                                 positions: Optional[torch.Tensor] = None,
                                 inverse: bool = False,
                                 norm_weight: Optional[torch.Tensor] = None,
                                 norm_eps: float = 1e-6, norm_offset: float = 0.0,
                                 norm_over: str = "head") -> torch.Tensor:
    """Inference path: rotate `t` in its own storage and return it. Only the first d2 channels
    of each head are read and written (all channels with a norm); `t` may be a strided view
    (e.g. q inside a packed qkv buffer) but must not overlap itself. Same arguments and
    semantics as `apply_rotary_pos_emb`; no autograd (use it under torch.no_grad() /
    inference_mode())."""
    for name, x in (("t", t), ("norm_weight", norm_weight)):
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"apply_rotary_pos_emb_inplace is for inference: {name} requires "
                             f"grad; use apply_rotary_pos_emb, or call it under torch.no_grad()")
    _check_untransformed(t=t, freqs=freqs, start_positions=start_positions, cu_seqlens=cu_seqlens,
                         positions=positions, norm_weight=norm_weight)
    call = RopeCall(angle_source(freqs), tensor_format, start_positions, interleaved, cu_seqlens,
                    cp_size, cp_rank, positions, inverse, False,
                    _rms_norm(norm_weight, norm_eps, norm_offset, norm_over))
    _compiled_or_eager(_rope_inplace_op, _rope_inplace_eager, (t,), call, _rope_op_args)
    return t


class QKVCall(NamedTuple):
    """Everything about one fused-QKV launch except the tensors it reads."""
    q_source: AngleSource
    k_source: AngleSource
    split: object           # qkv_split_arg_list as given (the checks judge it)
    tensor_format: str
    start_positions: Optional[torch.Tensor]
    interleaved: bool
    cp_size: int
    cp_rank: int
    positions: Optional[torch.Tensor]
    inverse: bool           # rotate q and k by the negated angles
    q_norm: Optional[RMSNorm] = None     # QK-norm of each query head, before the rotation
    k_norm: Optional[RMSNorm] = None     # of each key head


def _save_qkv_call(ctx, call, *inputs):
    """Keep `call` for the backward; `inputs`, the other tensors it reads (qkv and the norms'
    weights), are saved first."""
    q, k = call.q_source, call.k_source
    ctx.save_for_backward(*inputs, q.angles, q.pair_axis, k.angles, k.pair_axis,
                          call.start_positions, call.positions)
    ctx.call = call


def _saved_qkv_call(ctx):
    """(the forward's call, the inputs saved with it), its tensors from saved_tensors."""
    (*inputs, q_angles, q_pair_axis, k_angles, k_pair_axis, start_positions,
     positions) = ctx.saved_tensors
    call = ctx.call
    return QKVCall(_source_with(call.q_source, q_angles, q_pair_axis),
                   _source_with(call.k_source, k_angles, k_pair_axis), call.split,
                   call.tensor_format, start_positions, call.interleaved, call.cp_size,
                   call.cp_rank, positions, call.inverse, call.q_norm, call.k_norm), inputs


class FusedQKVRopeForwardAndBackward(torch.autograd.Function):
    """Fused QKV: one launch forward (packed qkv -> q, k, v), one launch backward (-> the
    packed gradient). The backward is `_FusedQKVRopeTranspose`, whose own backward is this
    forward, so double backward works."""

    @staticmethod
    def forward(ctx, qkv, call):
        _save_qkv_call(ctx, call)
        return _qkv(qkv, call)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        call, _ = _saved_qkv_call(ctx)
        if torch.is_grad_enabled():           # create_graph=True: record the gradient's graph
            return _FusedQKVRopeTranspose.apply(dq, dk, dv, call), None
        return _qkv_backward(dq, dk, dv, call), None


class _FusedQKVRopeTranspose(torch.autograd.Function):
    """(dq, dk, dv) -> the packed gradient of qkv, as a differentiable function."""

    @staticmethod
    def forward(ctx, dq, dk, dv, call):
        _save_qkv_call(ctx, call)
        return _qkv_backward(dq, dk, dv, call)

    @staticmethod
    def backward(ctx, grad_dqkv):
        call, _ = _saved_qkv_call(ctx)
        if torch.is_grad_enabled():
            return (*FusedQKVRopeForwardAndBackward.apply(grad_dqkv, call), None)
        return (*_qkv(grad_dqkv, call), None)


_QKV_CALL_SCHEMA = ("Tensor q_angles, Tensor? q_pair_axis, Tensor k_angles, Tensor? k_pair_axis, "
                    "bool from_positions, int n_axes, float q_scale, float k_scale, "
                    "int[] qkv_split_arg_list, str tensor_format, Tensor? start_positions, "
                    "bool interleaved, int cp_size, int cp_rank, Tensor? positions, bool inverse, "
                    "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, float norm_eps=0.0, "
                    "float norm_offset=0.0")


def _qkv_op_args(call):
    """A QKVCall as the fused-QKV ops' arguments, in _QKV_CALL_SCHEMA's order."""
    q, k = call.q_source, call.k_source
    q_norm, k_norm = call.q_norm, call.k_norm
    norm = q_norm or k_norm or RMSNorm(None, 0.0, 0.0, "head")
    return (q.angles, q.pair_axis, k.angles, k.pair_axis, q.from_positions, q.n_axes, q.scale,
            k.scale, list(call.split), call.tensor_format, call.start_positions, call.interleaved,
            call.cp_size, call.cp_rank, call.positions, call.inverse,
            q_norm and q_norm.weight, k_norm and k_norm.weight, norm.eps, norm.offset)


def _qkv_call(q_angles, q_pair_axis, k_angles, k_pair_axis, from_positions, n_axes, q_scale,
              k_scale, split, tensor_format, start_positions, interleaved, cp_size, cp_rank,
              positions, inverse, q_norm_weight=None, k_norm_weight=None, norm_eps=0.0,
              norm_offset=0.0):
    """The fused-QKV ops' arguments back into a QKVCall."""
    q_norm, k_norm = (None if w is None else RMSNorm(w, norm_eps, norm_offset, "head")
                      for w in (q_norm_weight, k_norm_weight))
    return QKVCall(AngleSource(q_angles, from_positions, q_pair_axis, n_axes, q_scale, None),
                   AngleSource(k_angles, from_positions, k_pair_axis, n_axes, k_scale, None),
                   split, tensor_format, start_positions, interleaved, cp_size, cp_rank,
                   positions, inverse, q_norm, k_norm)


def _qkv_eager(qkv, call):
    return set_rotary_qkv_kernel(qkv, call.q_source, call.k_source, call.split,
                                 call.tensor_format, call.start_positions, call.interleaved,
                                 call.cp_size, call.cp_rank, positions=call.positions,
                                 inverse=call.inverse, q_norm=call.q_norm, k_norm=call.k_norm)


def _qkv_norm_backward_eager(dq, dk, dv, qkv, call):
    """(the packed gradient of qkv, of q_norm's weight, of k_norm's weight) of a QK-norm call,
    from qkv, the forward's input."""
    return set_rotary_qkv_kernel(qkv, call.q_source, call.k_source, call.split,
                                 call.tensor_format, call.start_positions, call.interleaved,
                                 call.cp_size, call.cp_rank, grads=(dq, dk, dv),
                                 positions=call.positions, inverse=call.inverse,
                                 q_norm=call.q_norm, k_norm=call.k_norm)


def _qkv_backward_eager(dq, dk, dv, call):
    """The packed gradient of qkv. Only qkv's shape, dtype and device matter to the backward
    launch, so a zero-stride stand-in takes its place (qkv itself is not kept for backward)."""
    packed = dq.new_empty(()).expand(*dq.shape[:2], dk.shape[2], sum(call.split))
    return set_rotary_qkv_kernel(packed, call.q_source, call.k_source, call.split,
                                 call.tensor_format, call.start_positions, call.interleaved,
                                 call.cp_size, call.cp_rank, grads=(dq, dk, dv),
                                 positions=call.positions, inverse=call.inverse)


@torch.library.custom_op("triton_rotary::qkv_rope", mutates_args=(),
                         schema=f"(Tensor qkv, {_QKV_CALL_SCHEMA}) -> (Tensor, Tensor, Tensor)")
def _qkv_op(qkv, *args):
    return _qkv_eager(qkv, _qkv_call(*args))


@_qkv_op.register_fake
def _(qkv, *args):
    call = _qkv_call(*args)
    _, split = check_qkv_args(qkv, _traced_scale(call.q_source), _traced_scale(call.k_source),
                              call.split, call.tensor_format, call.start_positions, call.cp_size,
                              call.cp_rank, call.interleaved, call.positions, need_kernel=False,
                              inverse=call.inverse)
    check_qkv_norms(qkv, split, call.q_norm, call.k_norm)
    return qkv_outputs(qkv, split)


@torch.library.custom_op("triton_rotary::qkv_rope_backward", mutates_args=(),
                         schema=f"(Tensor dq, Tensor dk, Tensor dv, {_QKV_CALL_SCHEMA}) -> Tensor")
def _qkv_backward_op(dq, dk, dv, *args):
    return _qkv_backward_eager(dq, dk, dv, _qkv_call(*args))


@_qkv_backward_op.register_fake
def _(dq, dk, dv, *args):
    call = _qkv_call(*args)
    return dq.new_empty((*dq.shape[:2], dk.shape[2], sum(call.split)))


@torch.library.custom_op("triton_rotary::qkv_rope_norm_backward", mutates_args=(),
                         schema=f"(Tensor dq, Tensor dk, Tensor dv, Tensor qkv, {_QKV_CALL_SCHEMA}) "
                                f"-> (Tensor, Tensor, Tensor)")
def _qkv_norm_backward_op(dq, dk, dv, qkv, *args):
    return _qkv_norm_backward_eager(dq, dk, dv, qkv, _qkv_call(*args))


@_qkv_norm_backward_op.register_fake
def _(dq, dk, dv, qkv, *args):
    call = _qkv_call(*args)
    return (torch.empty_like(qkv, memory_format=torch.contiguous_format),
            torch.empty_like(call.q_norm.weight), torch.empty_like(call.k_norm.weight))


def _qkv_norm_backward(dq, dk, dv, qkv, call):
    """One launch of rotary_qkv_kernel and the weight gradients' reductions: the backward of a
    QK-norm call."""
    return _compiled_or_eager(_qkv_norm_backward_op, _qkv_norm_backward_eager, (dq, dk, dv, qkv),
                              call, _qkv_op_args)


class FusedQKVRopeNormForwardAndBackward(torch.autograd.Function):
    """Fused QKV with QK-norm: one launch forward (q and k normalized and rotated, v copied),
    one launch backward (-> the packed gradient and the partial sums of both weights'
    gradients), then their reductions. The backward is not itself differentiable."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, call):
        _save_qkv_call(ctx, call, qkv, q_weight, k_weight)
        return _qkv(qkv, call)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        _refuse_double_backward()
        call, (qkv, q_weight, k_weight) = _saved_qkv_call(ctx)
        call = call._replace(q_norm=call.q_norm._replace(weight=q_weight),
                             k_norm=call.k_norm._replace(weight=k_weight))
        return (*_qkv_norm_backward(dq, dk, dv, qkv, call), None)


def _unfused_qkv(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions,
                 interleaved, cp_size, cp_rank, positions=None, inverse=False, q_norm=None,
                 k_norm=None):
    _, split = check_qkv_args(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format,
                              start_positions, cp_size, cp_rank, interleaved, positions,
                              need_kernel=False, inverse=inverse)
    check_qkv_norms(qkv, split, q_norm, k_norm)
    q, k, v = torch.split(qkv, list(qkv_split_arg_list), dim=-1)
    q = q.unflatten(-1, (qkv_split_arg_list[0] // qkv_split_arg_list[1], qkv_split_arg_list[1])
                    ).flatten(2, 3)
    rope = lambda x, f, norm: _unfused_rope(x, f, tensor_format, start_positions,  # noqa: E731
                                            interleaved, None, cp_size, cp_rank, positions,
                                            inverse, norm)
    return rope(q, q_freqs, q_norm), rope(k, k_freqs, k_norm), v.contiguous()


def apply_fused_qkv_rotary_pos_emb(qkv: torch.Tensor, q_freqs, k_freqs, qkv_split_arg_list,
                                   tensor_format: str = "sbhd",
                                   start_positions: Optional[torch.Tensor] = None,
                                   interleaved: bool = False, cp_size: int = 1, cp_rank: int = 0,
                                   fused: bool = True, positions: Optional[torch.Tensor] = None,
                                   inverse: bool = False,
                                   q_norm_weight: Optional[torch.Tensor] = None,
                                   k_norm_weight: Optional[torch.Tensor] = None,
                                   norm_eps: float = 1e-6, norm_offset: float = 0.0):
    """RoPE on a fused QKV projection (TE's `apply_fused_qkv_rotary_pos_emb`).

    qkv: [s, b, h_kv, q + k + v] (sbhd) or [b, s, h_kv, q + k + v] (bshd), split along the last
    dim by `qkv_split_arg_list` = [q, k, v] with k the head dim d and q a multiple of it.
    q_freqs/k_freqs: two tables, or two RotaryPositionEmbedding (angles from positions).
    Returns contiguous q [.., h_kv * q / d, d] rotated with q_freqs, k [.., h_kv, d] rotated with
    k_freqs, and v [.., h_kv, v] unchanged: one kernel launch forward and one backward (which
    writes the packed gradient of qkv). q_norm_weight and k_norm_weight (both [d], given
    together): QK-norm of each query and key head before the rotation, in the same launches
    (Qwen3, Gemma 3: see `apply_rotary_pos_emb`'s norm_weight; norm_eps and norm_offset are
    shared by both). Other arguments, `inverse` too, as in `apply_rotary_pos_emb`.
    """
    _check_fused(fused)
    q_norm = _rms_norm(q_norm_weight, norm_eps, norm_offset, "head")
    k_norm = _rms_norm(k_norm_weight, norm_eps, norm_offset, "head")
    if not fused:
        return _unfused_qkv(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format,
                            start_positions, interleaved, cp_size, cp_rank, positions, inverse,
                            q_norm, k_norm)
    _check_untransformed(qkv=qkv, q_freqs=q_freqs, k_freqs=k_freqs,
                         start_positions=start_positions, positions=positions,
                         q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    q_source, k_source = angle_source(q_freqs, "q_freqs"), angle_source(k_freqs, "k_freqs")
    if torch.compiler.is_compiling():         # the op's arguments drop the modules' layouts
        for name, source in (("q_freqs", q_source), ("k_freqs", k_source)):
            check_layout(source, interleaved, name)
    if q_source.from_positions != k_source.from_positions or q_source.n_axes != k_source.n_axes:
        # Named here: the custom ops take one kind for both.
        check_qkv_args(qkv, q_source, k_source, qkv_split_arg_list, tensor_format,
                       start_positions, cp_size, cp_rank, interleaved, positions)
    call = QKVCall(q_source, k_source, qkv_split_arg_list, tensor_format, start_positions,
                   interleaved, cp_size, cp_rank, positions, inverse, q_norm, k_norm)
    if q_norm is not None or k_norm is not None:
        if q_norm is None or k_norm is None:
            check_qkv_norms(qkv, qkv_split_arg_list, q_norm, k_norm)     # names what is missing
        if not (_needs_grad(qkv) or _needs_grad(q_norm_weight) or _needs_grad(k_norm_weight)):
            return _qkv(qkv, call)
        return FusedQKVRopeNormForwardAndBackward.apply(
            qkv, q_norm_weight, _second_input(q_norm_weight, k_norm_weight), call)
    if not _needs_grad(qkv):
        return _qkv(qkv, call)
    return FusedQKVRopeForwardAndBackward.apply(qkv, call)
