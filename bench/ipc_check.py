"""Does a rollout rank's memory open in place in another process, as a vLLM engine's worker opens
it for each weight bucket (weight_sync.IpcWeights, vllm_worker.WeightTransfer)? vLLM is not
needed: this runs the same device calls (device.shareable_buffer, ipc_handle, ipc_key,
open_ipc_handle) between this process and a child started as engine_vllm starts the engine's
process, seeing the rank's device alone as its device 0.

    python bench/ipc_check.py [--device auto|cuda|npu|cpu] [--local-rank N] [--mb 256]

This process fills a buffer of ``--mb`` MiB on its device with a pattern and hands its handle
and device key to the child, which checks that its own device has the same key, opens the
handle, compares a bucket in the middle of it with the pattern, times the copy of the whole
buffer on its device, and writes a marker that this process then reads. Prints
"PASS ipc: ..." with the copy's GB/s, or "FAIL ipc: ...". On a CPU the buffer is torch's
named shared memory (the suite runs this there); on a GPU or NPU it checks what only a device
can: CUDA's or torch_npu's IPC between two processes of one device.
"""
from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from device import ipc_handle, ipc_key, open_ipc_handle, select_platform, shareable_buffer  # noqa: E402

MARKER = 0xA5


def pattern(nbytes: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(nbytes, device=device) % 251).to(torch.uint8)


def child(message_path: Path) -> int:
    """The engine's worker's side: the rank's device is this process's device 0."""
    import time

    sent = pickle.loads(message_path.read_bytes())
    plat = select_platform(sent["device_type"])
    plat.bind()
    mine = ipc_key(plat.device)
    if mine != sent["key"]:
        print(f"FAIL ipc: the child's device key {mine} is not the rank's {sent['key']}")
        return 1
    opened = open_ipc_handle(sent["handle"], plat.device)
    middle = slice(sent["nbytes"] // 2, sent["nbytes"] // 2 + 4096)
    if not torch.equal(opened[middle], pattern(sent["nbytes"], plat.device)[middle]):
        print("FAIL ipc: the opened memory does not hold the rank's bytes")
        return 1
    plat.synchronize()
    start = time.perf_counter()
    copy = opened.clone()
    plat.synchronize()
    seconds = time.perf_counter() - start
    opened[-1] = MARKER
    plat.synchronize()
    print(f"copied {copy.numel() / 2**20:.0f} MiB in {seconds * 1e3:.2f} ms: {copy.numel() / seconds / 1e9:.1f} GB/s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child)
    plat = select_platform(args.device, local_rank=args.local_rank)
    plat.bind()
    nbytes = args.mb * 2**20
    buffer = shareable_buffer(nbytes, plat.device)
    buffer.copy_(pattern(nbytes, plat.device))
    plat.synchronize()
    message = Path(os.environ.get("TMPDIR", "/tmp")) / f"ipc_check_{os.getpid()}.pickle"
    message.write_bytes(pickle.dumps({"device_type": plat.kind, "key": ipc_key(plat.device),
                                      "handle": ipc_handle(buffer[nbytes // 3:]), "nbytes": nbytes}))
    try:
        env = {**os.environ, **plat.child_visible_devices()}  # as engine_vllm starts the engine's process
        proc = subprocess.run([sys.executable, __file__, "--child", str(message)], env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        message.unlink(missing_ok=True)
    printed = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        failed = [line for line in printed.splitlines() if line.startswith("FAIL ipc:")]
        print(failed[-1] if failed else f"FAIL ipc: the child exited {proc.returncode}: {printed[-300:]}")
        return 1
    plat.synchronize()
    if buffer[-1].item() != MARKER:
        print("FAIL ipc: the child's write did not reach the rank's memory")
        return 1
    print(f"PASS ipc: {plat.device} memory opened in place by another process (key {ipc_key(plat.device)}); "
          f"{printed.splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
