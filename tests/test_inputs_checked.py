"""Every path a run reads is checked before anything loads (one line naming the key and the path,
exit status 2), and the resume edges a user meets: a resume that trains nothing leaves the run's
config.yaml alone; a resume on other data names the file and the first prompt that differs; a bad
resume path lists the step folders there are. datasets' progress bars stay out of the log."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt
import train_dapo
from config import load_config, warnings_for
from tests.test_checkpoint import refused  # the one line a refused run prints; exit status 2

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ----- dataset files -----------------------------------------------------------------------------

def bad_dataset(tmp_path: Path, kind: str) -> Path:
    if kind == "folder":
        (tmp_path / "prompts").mkdir()
        return tmp_path / "prompts"
    if kind == "csv":
        (tmp_path / "prompts.csv").write_text("prompt,answer\n1+1=,2\n")
        return tmp_path / "prompts.csv"
    return tmp_path / "missing.jsonl"


@pytest.mark.parametrize("key, kind, says", [
    ("dataset", "missing", "no such file"), ("dataset", "folder", "a folder, not a dataset file"),
    ("dataset", "csv", "unsupported file type '.csv'"), ("val_dataset", "missing", "no such file")])
def test_a_dataset_that_cannot_be_read_is_one_line_naming_the_key(demo_argv, tmp_path, capsys, key, kind, says):
    path = bad_dataset(tmp_path, kind)
    err = refused(demo_argv + [f"--{key}", str(path)], capsys)
    assert err.startswith(f"error: {key} {path}: {says}"), err
    assert not (tmp_path / "run").exists()  # refused before output_dir is written


def test_a_missing_dataset_is_refused_before_a_reward_model_loads(demo_argv, demo_assets, tmp_path, capsys):
    # With a reward model nothing reads the rows before the tokenizer loads; the check comes first.
    missing = tmp_path / "missing.parquet"
    err = refused(demo_argv + ["--dataset", str(missing), "--reward_model", str(demo_assets / "model"),
                               "--dynamic_sampling_metric", "reward"], capsys)
    assert err.startswith(f"error: dataset {missing}: no such file"), err
    assert not (tmp_path / "run").exists()


def test_a_missing_dataset_under_launch_sh_train(demo_assets, tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc = subprocess.run(["./launch.sh", "train", "configs/demo_cpu.yaml", "--model_path", str(demo_assets / "model"),
                           "--dataset", str(missing), "--output_dir", str(tmp_path / "run")],
                          cwd=ROOT, env={**ENV, "NPROC_PER_NODE": "1"}, capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("setup:", "WARNING: Location"))]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: dataset {missing}: no such file"), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# ----- the shipped 30B config --------------------------------------------------------------------

def test_the_30b_configs_placeholders_are_refused_one_key_at_a_time(demo_assets, tmp_path, monkeypatch, capsys):
    """As rank 0 of its 8-process job sees it: each /path/to/ placeholder the user has not set yet
    is named, with how to set it, before anything loads or is written (output_dir's among them)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    argv = ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml")]
    err = refused(argv, capsys)
    assert err == ("error: model_path /path/to/Qwen3-30B-A3B is the config's placeholder: set your own with "
                   "--model_path (or in the config)")
    argv += ["--model_path", str(demo_assets / "model")]
    assert refused(argv, capsys).startswith("error: dataset /path/to/prompts.jsonl is the config's placeholder")
    argv += ["--dataset", str(demo_assets / "train.jsonl")]
    assert refused(argv, capsys).startswith("error: output_dir /path/to/ckpt is the config's placeholder")


def test_the_30b_config_without_overrides_under_torchrun_is_one_line_naming_model_path():
    env = {**ENV, "WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0"}  # rank 0 of the job launch.sh starts
    proc = subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/qwen3_30b_a3b_dapo.yaml"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["error: model_path /path/to/Qwen3-30B-A3B is the config's placeholder: "
                                        "set your own with --model_path (or in the config)"]


# ----- reward_model over reward_fn ---------------------------------------------------------------

def test_a_reward_model_says_it_replaces_an_explicit_reward_fn():
    def ignored(*argv: str) -> list[str]:
        return [w for w in warnings_for(load_config(["--dynamic_sampling_metric", "reward", *argv])) if "ignored" in w]

    assert ignored("--reward_model", "rm", "--reward_fn", "demo_arithmetic") == [
        "reward_model is set, so reward_fn demo_arithmetic is ignored: the reward model scores every response"]
    assert ignored("--reward_model", "rm") == []  # the default reward_fn: nothing was asked for
    assert ignored("--reward_fn", "demo_arithmetic") == []


# ----- resumes ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_steps(demo_assets, tmp_path_factory) -> Path:
    """A 2-step one-process run with a checkpoint at each step: what every resume below starts from."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    proc = subprocess.run([sys.executable, "train_dapo.py", *resume_argv(demo_assets, out), "--max_steps", "2"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def resume_argv(demo_assets: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(demo_assets / "model"),
            "--dataset", str(demo_assets / "train.jsonl"), "--output_dir", str(out), "--save_every", "1",
            "--val_dataset", "null", "--val_every", "0", *extra]


@pytest.fixture
def run_copy(two_steps, tmp_path) -> Path:
    shutil.copytree(two_steps, tmp_path / "run")
    return tmp_path / "run"


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_resume_that_trains_nothing_leaves_config_yaml_alone(demo_assets, run_copy, capsys):
    before = (run_copy / "config.yaml").read_bytes()
    env_report = (run_copy / "env_report.json").read_bytes()
    argv = resume_argv(demo_assets, run_copy, "--max_steps", "2", "--resume_from_checkpoint", "auto")
    assert train_dapo.main(argv) == 0
    assert "the checkpoint is at step 2, max_steps is 2: nothing to train" in capsys.readouterr().out
    assert (run_copy / "config.yaml").read_bytes() == before  # still the run's own, not "resume_from_checkpoint: auto"
    assert (run_copy / "env_report.json").read_bytes() == env_report


def test_a_resume_on_other_prompts_names_the_file_and_the_first_that_differs(demo_assets, run_copy, tmp_path,
                                                                               capsys):
    lines = (demo_assets / "train.jsonl").read_text().splitlines()
    changed, shorter = tmp_path / "changed.jsonl", tmp_path / "shorter.jsonl"
    row = json.loads(lines[3])
    changed.write_text("\n".join(lines[:3] + [json.dumps({**row, "prompt": row["prompt"] + " "})] + lines[4:]) + "\n")
    shorter.write_text("\n".join(lines[:10]) + "\n")
    before = snapshot(run_copy / "checkpoints")
    folder = run_copy / "checkpoints" / ckpt.step_dir_name(2)
    prefix = f"error: checkpoint {folder} does not match this run's data: training prompts differ: "

    def resume_on(dataset: Path) -> str:
        argv = resume_argv(demo_assets, run_copy, "--max_steps", "3", "--resume_from_checkpoint", "auto",
                           "--dataset", str(dataset))
        return refused(argv, capsys)

    theirs = f"{len(lines)} in the checkpoint's ({demo_assets / 'train.jsonl'})"
    assert resume_on(changed) == prefix + f"{len(lines)} in dataset {changed}, {theirs}; the first that differs is " \
                                          f"prompt 3 ({changed}:4)"
    assert resume_on(shorter) == prefix + f"10 in dataset {shorter}, {theirs}; the first that differs is prompt 10"
    assert snapshot(run_copy / "checkpoints") == before


def test_a_bad_resume_path_lists_the_step_folders_there_are(demo_assets, run_copy, capsys):
    root = run_copy / "checkpoints"
    there = f"{root} holds {ckpt.step_dir_name(1)}, {ckpt.step_dir_name(2)}"
    missing = root / ckpt.step_dir_name(5)
    err = refused(resume_argv(demo_assets, run_copy, "--max_steps", "3", "--resume_from_checkpoint", str(missing)),
                  capsys)
    assert err == f"error: resume_from_checkpoint {missing}: no such folder; {there}"
    (root / ckpt.step_dir_name(1) / ckpt.COMPLETE).unlink()  # a folder that is there but cannot be resumed
    err = refused(resume_argv(demo_assets, run_copy, "--max_steps", "3", "--resume_from_checkpoint",
                              str(root / ckpt.step_dir_name(1))), capsys)
    assert err.startswith(f"error: checkpoint {root / ckpt.step_dir_name(1)} is incomplete"), err
    assert err.endswith(f"; {root} holds {ckpt.step_dir_name(1)} (incomplete), {ckpt.step_dir_name(2)}"), err


def test_a_missing_resume_path_is_refused_before_anything_loads_unless_torchrun_restarted(demo_assets, tmp_path,
                                                                                          capsys, monkeypatch):
    missing = tmp_path / "elsewhere" / ckpt.step_dir_name(3)
    argv = resume_argv(demo_assets, tmp_path / "fresh", "--resume_from_checkpoint", str(missing))
    assert refused(argv, capsys) == (f"error: resume_from_checkpoint {missing}: no such folder; "
                                     f"{tmp_path / 'fresh' / 'checkpoints'} holds no step folder")
    assert not (tmp_path / "fresh").exists()
    # A restarted job continues from its own checkpoints: the folder it was first told may be gone.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    train_dapo.check_inputs(load_config(argv), reads_data=True)


# ----- progress bars ------------------------------------------------------------------------------

def test_datasets_progress_bars_stay_out_of_the_log_and_ours_stay(tmp_path):
    import pandas as pd

    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}).to_parquet(path)
    script = ("import sys, tqdm, data_prep\n"
              f"print(len(data_prep.read_rows({str(path)!r}).messages))\n"
              "for _ in tqdm.tqdm(range(2), desc='ours', file=sys.stderr): pass\n")
    env = {k: v for k, v in ENV.items() if k != "HF_DATASETS_DISABLE_PROGRESS_BARS"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr
    assert "Generating train split" not in proc.stderr and "ours: 100%" in proc.stderr, proc.stderr
