"""A model_path or reward_model that is not a model folder: one line naming the key, the folder and
what is missing, exit status 2, before anything loads or is written, alone and under launch.sh."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def model_folders(tmp_path: Path) -> dict[str, Path]:
    """A folder that does not exist, one without config.json, and one a check of folders accepts."""
    empty, model = tmp_path / "empty", tmp_path / "model"
    empty.mkdir()
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return {"missing": tmp_path / "missing", "empty": empty, "model": model}


MISSING = {"missing": "no such folder", "empty": "no config.json"}
CASES = [("model_path", "missing"), ("model_path", "empty"), ("reward_model", "missing"), ("reward_model", "empty")]


def run_args(tmp_path: Path, key: str, kind: str) -> list[str]:
    folders = model_folders(tmp_path)
    model = folders[kind] if key == "model_path" else folders["model"]
    extra = ["--reward_model", str(folders[kind])] if key == "reward_model" else []
    return ["--model_path", str(model), *extra, "--dataset", str(tmp_path / "train.jsonl"),
            "--output_dir", str(tmp_path / "run")]


def assert_one_line(proc: subprocess.CompletedProcess, tmp_path: Path, key: str, kind: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("setup:", "WARNING: Location"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {key} {tmp_path / kind}: {MISSING[kind]}"), lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, kind", CASES)
def test_a_path_that_is_not_a_model_folder_is_one_line_and_status_2(tmp_path, key, kind, capsys):
    import train_dapo

    status = train_dapo.main(["--config", str(ROOT / "configs" / "demo_cpu.yaml"), *run_args(tmp_path, key, kind)])
    assert_one_line(subprocess.CompletedProcess([], status, "", capsys.readouterr().err), tmp_path, key, kind)


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_a_model_path_that_is_not_a_model_folder_under_launch_sh_train(tmp_path, kind):
    proc = subprocess.run(["./launch.sh", "train", "configs/demo_cpu.yaml", *run_args(tmp_path, "model_path", kind)],
                          cwd=ROOT, env={**ENV, "NPROC_PER_NODE": "1"}, capture_output=True, text=True, timeout=180)
    assert_one_line(proc, tmp_path, "model_path", kind)
