"""The article's environment checks through the real launcher: matmul and a 2-process all_reduce."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_launch_smoke_passes_on_cpu_gloo():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(["./launch.sh", "smoke"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "PASS matmul" in proc.stdout and "PASS all_reduce" in proc.stdout
    assert not [line for line in lines if line.startswith("FAIL")]
    assert "backend=gloo" in proc.stdout and "world_size=2" in proc.stdout
