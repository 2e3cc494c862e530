"""pytest setup for every test module: Triton's backend and the markers."""
import os

import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, so the choice is made here,
# before pytest imports any test module. Without a CUDA GPU the kernels run in Triton's
# interpreter on CPU tensors; an explicit TRITON_INTERPRET is left as it is.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running GPU test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "sanitize: odd shapes that `make sanitize` runs under "
                                       "compute-sanitizer (select with -m sanitize)")


def pytest_report_header(config):
    """Which Transformer Engine the TE comparisons ran against, or why they are skipped."""
    from te_comparator import load_te_qkv_rope, load_te_rope
    lines = []
    for what, loader in (("fused RoPE", load_te_rope), ("fused QKV RoPE", load_te_qkv_rope)):
        fn, info = loader()
        lines.append(f"Transformer Engine {what}: " + (info if fn is not None else f"unavailable ({info})"))
    return lines
