"""launch.sh on an NPU machine: the timeouts it exports are the ones CANN and torch_npu read.

The launcher is run for real, over a stand-in virtualenv whose python says the platform is an
NPU and, in torchrun's place, prints the environment the ranks would get.
"""
import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *select_platform*) echo npu ;;
  stopping.py*) env ;;
esac
"""


def launched_env(tmp_path: Path, **env: str) -> dict[str, str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    # setup() is done when its stamp for this pyproject.toml is there.
    digest = hashlib.sha1((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    (venv / f".dapo-npu-installed-{digest}").touch()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HCCL_")}
    out = subprocess.run(["./launch.sh", "train", "configs/demo_cpu.yaml"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**clean, "VIRTUAL_ENV": str(venv), **env})
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def test_npu_ranks_get_the_collective_timeout_hccl_reads(tmp_path):
    env = launched_env(tmp_path)
    assert env["HCCL_EXEC_TIMEOUT"] == "3000"  # not CANN's 1800 s default, below dist_timeout_s
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert "HCCL_TIMEOUT" not in env  # a name nothing reads


def test_a_users_own_hccl_timeouts_are_kept(tmp_path):
    env = launched_env(tmp_path, HCCL_EXEC_TIMEOUT="7200", HCCL_CONNECT_TIMEOUT="600")
    assert (env["HCCL_EXEC_TIMEOUT"], env["HCCL_CONNECT_TIMEOUT"]) == ("7200", "600")
