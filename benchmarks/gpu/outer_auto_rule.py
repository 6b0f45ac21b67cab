"""outer_state_device "auto" on a real card: 1.48G fp32 parameters (5.9 GB) and AdamW on GPU 0, the outer state
of eager overlap (5 buffers) placed by the rule (the line it prints), then one AdamW step and the peak memory.

    python benchmarks/gpu/outer_auto_rule.py      (benchmarks/gpu.sh outer runs it)
"""

import torch

from prime.outer import OuterState

dev = torch.device("cuda", 0)
params = [torch.nn.Parameter(torch.randn(1 << 27, device=dev) * 0.01) for _ in range(11)]
opt = torch.optim.AdamW(params, lr=1e-4)
st = OuterState(params, device="auto", extra_buffers=2, inner_optimizer=opt)  # eager overlap: 5 buffers
print(st.device_reason)
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt.step()
torch.cuda.synchronize()
print(f"after one AdamW step: allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
      f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB of "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
