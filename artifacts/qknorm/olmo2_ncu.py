"""OLMo 2's query through the fused token norm + RoPE (16K tokens, 32 heads of d 128, bf16,
exact angles, bshd), forward and backward once each, for Nsight Compute to read the two
rotary_kernel launches: whether the backward's extra time over its bytes (1.76 copies of q
against 1.5) is bytes moved or latency.

    ncu --clock-control none -k regex:rotary_kernel -c 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats python artifacts/qknorm/olmo2_ncu.py
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch

from triton_rotary_main import RotaryPositionEmbedding, apply_rotary_pos_emb

tokens, heads, head_dim = 16384, 32, 128
q = torch.randn(1, tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                requires_grad=True)
weight = (1.0 + 0.1 * torch.randn(heads * head_dim, device="cuda")).to(torch.bfloat16)
weight.requires_grad_()
rope = RotaryPositionEmbedding(head_dim, rotary_base=5e5, device="cuda")
out = apply_rotary_pos_emb(q, rope, "bshd", norm_weight=weight, norm_eps=1e-6, norm_over="token")
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("q bytes", q.numel() * q.element_size())
