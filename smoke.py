"""The article's two environment checks (section 2.3), run by ``./launch.sh smoke``.

``python smoke.py matmul`` multiplies on the selected device; ``torchrun --nproc_per_node=2
smoke.py all_reduce`` sums a tensor across two processes on the selected backend. Each prints
the device, the backend and one PASS or FAIL line, and exits non-zero on FAIL.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from device import select_platform


def check_matmul() -> bool:
    plat = select_platform()
    print(f"device={plat.device} backend={plat.backend}")
    a = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(plat.device)
    product = (a @ a).sum().item()
    expected = (a.cpu().double() @ a.cpu().double()).sum().item()
    ok = abs(product - expected) <= 1e-3 * max(1.0, abs(expected))
    print(f"{'PASS' if ok else 'FAIL'} matmul: sum={product:.6f} expected={expected:.6f}")
    return ok


def check_all_reduce() -> bool:
    plat = select_platform(local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    plat.bind()
    dist.init_process_group(plat.backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        tensor = torch.full((16,), float(rank + 1), device=plat.device)
        dist.all_reduce(tensor)
        expected = 16.0 * world * (world + 1) / 2
        ok = abs(tensor.sum().item() - expected) < 1e-3
        if rank == 0:
            print(f"device={plat.device} backend={plat.backend} world_size={world}")
            print(f"{'PASS' if ok else 'FAIL'} all_reduce: sum={tensor.sum().item():g} expected={expected:g}")
        return ok
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    checks = {"matmul": check_matmul, "all_reduce": check_all_reduce}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        print(f"usage: python smoke.py {{{'|'.join(checks)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if checks[sys.argv[1]]() else 1)
