"""What a run shows its user besides metrics.csv: TensorBoard scalars (also after a resume),
sample completions, curves.png, and the start-up check of report_to."""
import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import metrics
from config import RunConfig, UserError
from metrics import COLUMNS, TENSORBOARD_GROUPS, TENSORBOARD_TAGS, CompletionLog, StepReporter
from samples import SampleBatch


def event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def csv_as_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv's values as TensorBoard stores them (float32), keyed by tag."""
    expected: dict[str, list[tuple[int, float]]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            for column, value in row.items():
                if column != "step" and value != "":
                    expected.setdefault(TENSORBOARD_TAGS[column], []).append((int(row["step"]), float(np.float32(value))))
    return expected


def test_every_column_but_step_has_exactly_one_tensorboard_group():
    grouped = [column for columns in TENSORBOARD_GROUPS.values() for column in columns]
    assert sorted(grouped) == sorted(c for c in COLUMNS if c != "step")


class CharTokenizer:
    """Token id i is the letter chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def reporter(out: Path, append: bool, **run) -> StepReporter:
    run_config = RunConfig(output_dir=str(out), report_to=["csv", "tensorboard"], log_completions=0, **run)
    return StepReporter(run_config, tokenizer=CharTokenizer(), reference_answers=[], advantages=None, append=append)


def test_a_resumed_run_redraws_its_curves_with_one_value_per_step(tmp_path):
    first = reporter(tmp_path, append=False, max_steps=10)
    for step in range(4):  # the run writes step 3, then dies before checkpointing it
        first.write({"step": step, "reward_mean": 0.1 * step, "val_acc": 0.5 if step == 0 else None})
        if step == 2:
            checkpoint_csv = tmp_path / "checkpoint_metrics.csv"
            checkpoint_csv.write_text((tmp_path / "metrics.csv").read_text())
            state = {**first.state(), "step": 2}
    resumed = reporter(tmp_path, append=True, max_steps=3)
    resumed.restore(state, checkpoint_csv)
    resumed.write({"step": 3, "reward_mean": 0.7})  # step 3 again, with another value
    scalars = event_scalars(tmp_path / "tensorboard")
    assert scalars["reward/reward_mean"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                             (3, pytest.approx(0.7))]
    assert scalars == csv_as_scalars(tmp_path / "metrics.csv")


def test_curves_are_redrawn_at_a_validation_at_most_once_a_minute_and_at_the_end(tmp_path, monkeypatch):
    drawn, clock = [], [1000.0]
    monkeypatch.setattr(metrics, "plot_curves", lambda out: drawn.append(step))
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    report = reporter(tmp_path, append=False, max_steps=6)
    for step, seconds in enumerate([0, 30, 31, 30, 10, 20, 1]):  # validations at steps 0, 2, 4 and 6
        clock[0] += seconds
        report.write({"step": step, "reward_mean": 0.0, "val_reward_mean": 0.0 if step % 2 == 0 else None})
    # step 0: nothing to draw; step 2: 61 s in; step 4: 40 s after; step 6: the end
    assert drawn == [2, 6]


def group_batch() -> SampleBatch:
    """Two prompts (rows 0-1 and 2-3), left-padded prompts, right-padded responses."""
    return SampleBatch(
        prompt_ids=torch.tensor([[0, 7, 8], [0, 7, 8], [2, 3, 4], [2, 3, 4]]),
        prompt_mask=torch.tensor([[False, True, True]] * 2 + [[True, True, True]] * 2),
        response_ids=torch.tensor([[1, 2, 0], [3, 0, 0], [4, 4, 4], [5, 0, 0]]),
        response_mask=torch.tensor([[True, True, False], [True, False, False], [True, True, True],
                                    [True, False, False]]),
        rollout_logp=torch.zeros(4, 3), reward=torch.tensor([1.0, 0.0, -0.5, 1.0]),
        score=torch.tensor([1.0, 0.0, 0.0, 1.0]), correct=torch.tensor([True, False, False, True]),
        truncated=torch.tensor([False, False, True, False]), prompt_index=torch.tensor([5, 5, 1, 1]),
        version=torch.tensor([3, 3, 2, 2]), group_size=2)


def test_completions_are_decoded_without_padding_and_a_resume_drops_later_steps(tmp_path):
    path = tmp_path / "completions.jsonl"
    answers = ["zero", "one", "two", "three", "four", "five"]
    log = CompletionLog(path, prompts=1, tokenizer=CharTokenizer(), reference_answers=answers,
                        advantages=lambda batch: batch.reward * 10, append=False)
    for step in (1, 2, 3):
        log.record(step, group_batch())
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["step"] for e in entries] == [1, 2, 3]  # one prompt per step: log_completions 1
    assert entries[0]["prompt"] == "hi" and entries[0]["answer"] == "five"
    assert [(r["text"], r["reward"], r["advantage"]) for r in entries[0]["responses"]] == [("bc", 1.0, 10.0),
                                                                                           ("d", 0.0, 0.0)]
    assert log.console_sample() == "sample from step 3: 'hi' -> 'bc' (reward +1.000, advantage +10.000)"
    log.drop_after(2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    CompletionLog(path, prompts=0, tokenizer=None, reference_answers=[], advantages=None, append=False)
    assert not path.exists()  # a fresh start does not keep an older run's completions


def test_plot_writes_a_picture_of_the_run_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    from matplotlib.image import imread

    with (tmp_path / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for step in range(200):  # enough steps for the trailing mean
            writer.writerow({"step": step, "reward_mean": step / 200, "entropy": 2 - step / 200,
                             "val_acc": step / 200 if step % 20 == 0 else "", "step_time_s": 0.3})
    assert metrics.main(["plot", str(tmp_path)]) == 0
    picture = imread(tmp_path / "curves.png")
    assert picture.shape[:2] == (720, 1280)
    assert (picture[..., :3] < 0.5).mean() > 0.01  # lines and text, not a blank page
    assert metrics.main(["plot", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_report_to_tensorboard_without_the_package_is_refused_at_start_up(monkeypatch):
    metrics.check_report_to(["csv", "tensorboard"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    metrics.check_report_to(["csv"])
    with pytest.raises(UserError, match=r"pip install -e '\.\[tensorboard\]'"):
        metrics.check_report_to(["csv", "tensorboard"])


def test_the_demo_writes_curves_completions_and_a_picture_and_a_resume_keeps_one_value_per_step(demo_argv, tmp_path):
    from transformers import AutoTokenizer

    import train_dapo

    out = tmp_path / "run"
    argv = demo_argv + ["--max_steps", "3", "--save_every", "1"]  # the demo config: report_to csv, tensorboard
    assert train_dapo.main(argv) == 0
    assert train_dapo.main(argv + ["--resume_from_checkpoint", str(out / "checkpoints" / "step_00000002")]) == 0
    scalars = event_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["reward/reward_mean"]] == [1, 2, 3]  # step 3 trained twice, shown once
    assert scalars == csv_as_scalars(out / "metrics.csv")

    entries = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in entries] == [1, 1, 2, 2, 3, 3]  # log_every 1, log_completions 2
    special = AutoTokenizer.from_pretrained(demo_argv[demo_argv.index("--model_path") + 1]).all_special_tokens
    for entry in entries:
        assert entry["prompt"].endswith("=<|im_end|>\n<|im_start|>assistant\n") and len(entry["responses"]) == 8
        for response in entry["responses"]:
            written = response["text"]
            for token in special:
                written = written.replace(token, "")
            # The text is what the reward read: demo_arithmetic pays exactly the reference answer.
            assert (written.strip() == entry["answer"]) == (response["score"] == 1.0), response
        assert abs(sum(r["advantage"] for r in entry["responses"])) < 1e-3  # group-relative: mean zero

    picture = (out / "curves.png").read_bytes()
    assert picture.startswith(b"\x89PNG\r\n\x1a\n") and len(picture) > 20_000


# ----- report_to wandb and none -----------------------------------------------------------------

def wandb_records(path: Path) -> list:
    """The protobuf records of one .wandb file (a LevelDB-style log: 32 KiB blocks, each record
    or piece of one behind a 7-byte header of crc32, length and type)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, position, chunk = [], 7, b""
    while position + header <= len(data):
        if block - position % block < header:  # the rest of a block is padding
            position += block - position % block
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        if position + header + length > len(data):  # a record wandb is still writing
            break
        chunk += data[position + header:position + header + length]
        position += header + length
        if kind in (1, 4):  # 1 a whole record, 4 the last piece of one
            records.append(pb.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_runs(wandb_dir: Path) -> list[dict]:
    """The offline runs under ``wandb_dir``, oldest first: project, name, config and every scalar
    as {tag: [(step, value)]}. wandb's service process may still be writing a run's log when
    ``finish()`` has returned, so a file is read until it ends with the run's exit record."""
    import time

    runs = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        deadline, records = time.monotonic() + 60, wandb_records(path)
        while not (records and records[-1].HasField("exit")) and time.monotonic() < deadline:
            time.sleep(0.1)
            records = wandb_records(path)
        run = {"scalars": {}, "config": {}}
        for record in records:
            kind_of_record = record.WhichOneof("record_type")
            if kind_of_record == "run":
                run.update(project=record.run.project, name=record.run.display_name)
            elif kind_of_record == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind_of_record == "history":
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                for tag, value in values.items():
                    if not tag.startswith("_"):
                        run["scalars"].setdefault(tag, []).append((record.history.step.num, value))
        runs.append(run)
    return runs


def csv_as_wandb_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv's values keyed by TensorBoard tag, as W&B keeps them (float64: exactly)."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in metrics.read_metrics(path):
        for column, value in row.items():
            if column != "step" and value != "":
                expected.setdefault(TENSORBOARD_TAGS[column], []).append((int(row["step"]), float(value)))
    return expected


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch) -> Path:
    """wandb offline, every file it writes inside tmp_path, no network, no account (setup installs
    the wandb extra)."""
    home = tmp_path / "wandb_home"
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb_dir"),
                        "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
                        "WANDB_DATA_DIR": str(home / "data")}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "wandb_dir"


def test_report_to_wandb_logs_the_tensorboard_scalars_and_a_resume_redraws_them(demo_argv, tmp_path,
                                                                                  offline_wandb):
    import train_dapo

    out = tmp_path / "run"
    argv = demo_argv + ["--max_steps", "2", "--save_every", "1", "--report_to", "[csv, wandb]"]
    assert train_dapo.main(argv) == 0
    first_csv = metrics.read_metrics(out / "metrics.csv")
    assert train_dapo.main(argv + ["--resume_from_checkpoint", str(out / "checkpoints" / "step_00000001")]) == 0
    first, resumed = wandb_runs(offline_wandb)
    assert (first["project"], first["name"], resumed["name"]) == ("dapo-npu", "run", "run")  # output_dir's name
    assert first["config"]["optim"]["learning_rate"] == 2e-4  # config.yaml, by section
    assert set(first["scalars"]) == {TENSORBOARD_TAGS[c] for row in first_csv for c, v in row.items()
                                     if c != "step" and v != ""}
    assert [step for step, _ in resumed["scalars"]["reward/reward_mean"]] == [1, 2]  # step 2 trained twice, shown once
    assert resumed["scalars"] == csv_as_wandb_scalars(out / "metrics.csv")
    assert not (out / "tensorboard").exists()


def test_wandb_project_and_name_follow_the_usual_variables(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    monkeypatch.setenv("WANDB_NAME", "my-run")
    run = RunConfig(output_dir=str(tmp_path / "out"), report_to=["wandb"], log_completions=0, max_steps=1)
    (tmp_path / "out").mkdir()
    report = StepReporter(run, tokenizer=CharTokenizer(), reference_answers=[], advantages=None, append=False)
    report.write({"step": 0, "val_reward_mean": 0.25, "val_acc": 0.5})
    report.write({"step": 1, "reward_mean": 0.5, "val_acc": None})  # the last step closes the run
    [logged] = wandb_runs(offline_wandb)
    assert (logged["project"], logged["name"]) == ("my-project", "my-run")
    assert logged["scalars"] == {"val/val_reward_mean": [(0, 0.25)], "val/val_acc": [(0, 0.5)],
                                 "reward/reward_mean": [(1, 0.5)], **{f"alarm/{a}": [(1, 0)] for a in
                                 ("alarm_kl_jump", "alarm_length_rising", "alarm_no_signal", "alarm_overfit")}}


def test_report_to_wandb_without_the_package_stops_before_anything_is_written(demo_argv, tmp_path, monkeypatch,
                                                                               capsys):
    import train_dapo

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"^report_to wandb needs the wandb package, which is not installed: "
                                        r"pip install -e '\.\[wandb\]'$"):
        metrics.check_report_to(["csv", "wandb"])
    assert train_dapo.main(demo_argv + ["--report_to", "[csv, wandb]"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: report_to wandb needs the wandb package, which is not installed: pip install -e '.[wandb]'"]
    assert not (tmp_path / "run").exists()


def test_report_to_none_writes_no_curves_but_metrics_csv(tmp_path):
    from config import load_config

    cfg = load_config(["--report_to", "none", "--output_dir", str(tmp_path), "--max_steps", "1", "--log_completions", "0"])
    metrics.check_report_to(cfg.run.report_to)
    report = StepReporter(cfg.run, tokenizer=CharTokenizer(), reference_answers=[], advantages=None, append=False)
    report.write({"step": 0, "val_reward_mean": 0.25})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # checkpoints keep a copy of it
