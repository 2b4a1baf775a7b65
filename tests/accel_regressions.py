"""Mistakes a device would reject, made on purpose through the project's own code, under the
stand-in accelerator (tests/accel_standin.py): each must leave its finding in the report.

    AUDIT_OUT=DIR python tests/accel_standin.py tests/accel_regressions.py
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckpt  # noqa: E402
import dapo_loss  # noqa: E402
import engine_builtin  # noqa: E402
from device import select_platform, step_generator  # noqa: E402
from ranks import all_reduce_tensor  # noqa: E402

plat = select_platform("auto", 0)
plat.bind()
device = plat.device
dist.init_process_group(plat.backend, store=dist.HashStore(), rank=0, world_size=1)

# 1. A host generator drawing for device probabilities.
logits = torch.randn(4, 16).to(device)
engine_builtin._choose_token(logits, greedy=False, top_p=1.0, generator=step_generator(0, 1))

# 2. Host advantages in the loss over device log-probs.
logp = torch.randn(4, 6).to(device)
dapo_loss.policy_loss(logp, logp.detach(), torch.randn(4), torch.ones(4, 6, dtype=torch.bool).to(device))

# 3. A host tensor into the HCCL group.
all_reduce_tensor(torch.ones(3), dist.group.WORLD, torch.device("cpu"))

# 4. A float64 reduction, which HCCL rejects.
dist.all_reduce(torch.zeros(2, dtype=torch.float64).to(device))

# 5. A writer thread that never binds the rank's device.
writer = ckpt.BackgroundWriter(bind_device=lambda: None)
writer.start("save-unbound", lambda: plat.module.current_stream())
writer.wait()

dist.destroy_process_group()
