"""Config: precedence, unknown keys, wrong types, derived values, the CLI's exit status and its
--help."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

import config
from config import Config, ConfigError, Derived, load_config, model_params, warnings_for
from ranks import Layout

ROOT = Path(__file__).resolve().parents[1]


def write_yaml(tmp_path, doc) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_precedence_defaults_then_yaml_then_cli(tmp_path):
    path = write_yaml(tmp_path, {"algo": {"kl_coef": 0.05, "clip_ratio_high": 0.3}, "sample_num": 4})
    cfg = load_config(["--config", path, "--kl_coef", "0.01"])
    assert cfg.algo.kl_coef == 0.01  # CLI beats YAML
    assert cfg.algo.clip_ratio_high == 0.3  # YAML beats default
    assert cfg.rollout.sample_num == 4  # flat key at the YAML top level
    assert cfg.algo.clip_ratio_low == Config().algo.clip_ratio_low  # default untouched


def test_article_launch_flags_are_accepted_as_written():
    argv = ("--model_path /m --reward_model /rm --dataset /d.jsonl --output_dir /o --max_prompt_length 2048 "
            "--max_response_length 2048 --temperature 0.7 --top_p 0.95 --kl_coef 0.01 --sample_num 8 "
            "--per_device_batch_size 4 --gradient_accumulation_steps 8 --learning_rate 1e-6").split()
    cfg = load_config(argv)
    assert cfg.optim.learning_rate == 1e-6 and isinstance(cfg.optim.learning_rate, float)
    assert cfg.model.reward_model == "/rm" and cfg.rollout.top_p == 0.95


@pytest.mark.parametrize("argv, needle", [
    (["--kl_coeff", "0.1"], "unknown config key 'kl_coeff' on the command line (did you mean 'kl_coef'?)"),
    (["--learning_rate", "abc"], "'learning_rate' expects a number"),
    (["--sample_num", "2.5"], "'sample_num' expects an integer"),
    (["--dynamic_sampling", "maybe"], "'dynamic_sampling' expects a boolean"),
    (["--loss_agg_mode", "sum"], "'loss_agg_mode' expects one of"),
    (["--eos_token_ids", "[1, x]"], "'eos_token_ids' expects a list of integers"),
    (["--clip_ratio_c", "0.5"], "clip_ratio_c must be > 1"),
    (["--kl_coef"], "--kl_coef needs a value"),
    (["--reward_model", "/rm", "--dynamic_sampling_metric", "acc"], "a reward_model has no notion of correct"),
    (["--report_to", "[csv, mlflow]"], "report_to takes csv, console, tensorboard, wandb, none, got ['csv', 'mlflow']"),
    (["--report_to", "[none, wandb]"], "report_to none means no reporter but the console and metrics.csv: give it alone"),
    (["--log_completions", "-1"], "log_completions must be >= 0 (0 = off)"),
    (["--val_top_p", "0"], "val_top_p must be in (0, 1]"),  # a key's own check (config.key) names that key
    (["--disk_gb", "0"], "disk_gb must be > 0 (null = what the machine reports)"),
    (["--clip_ratio_low", "1.0"], "clip_ratio_low must be < 1: it is an epsilon"),
])
def test_bad_command_line_values_name_the_key(argv, needle):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_yaml_key_names_file_and_suggestion(tmp_path):
    path = write_yaml(tmp_path, {"optim": {"learning_rte": 1e-6}})
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rte' in .*run.yaml \(did you mean 'learning_rate'\?\)"):
        load_config(["--config", path])


def test_values_parse_like_yaml():
    cfg = load_config(["--eos_token_ids", "[151645, 151643]", "--kl_coef_init=0.05", "--reward_model", "null",
                       "--gradient_checkpointing", "true", "--report_to", "tensorboard"])
    assert cfg.model.eos_token_ids == [151645, 151643]
    assert cfg.run.report_to == ["tensorboard"]  # one item needs no brackets, as for eos_token_ids
    assert cfg.algo.kl_coef_init == 0.05 and cfg.model.reward_model is None
    assert cfg.model.gradient_checkpointing is True


def test_config_is_frozen_and_round_trips_through_yaml(tmp_path):
    cfg = load_config(["--seed", "7", "--eos_token_ids", "[3]"])
    with pytest.raises(Exception):
        cfg.run.seed = 8  # user settings are never mutated
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    reloaded = load_config(["--config", str(saved)]).flat()
    assert reloaded.pop("config") == str(saved)
    assert reloaded == {k: v for k, v in cfg.flat().items() if k != "config"}


def test_clip_ratio_high_of_one_or_more_warns():
    assert any("epsilon" in w for w in warnings_for(load_config(["--clip_ratio_high", "1.1"])))
    assert not any("epsilon" in w for w in warnings_for(load_config([])))


def test_derived_values_and_their_explanations():
    cfg = load_config(["--prompts_per_step", "6", "--sample_num", "8", "--per_device_batch_size", "8",
                       "--gradient_accumulation_steps", "2"])
    one = Derived.of(cfg, world_size=1)
    assert (one.num_rollout_ranks, one.num_learner_ranks, one.optimizer_steps_per_step) == (1, 1, 3)
    eight = Derived.of(load_config(["--prompts_per_step", "4", "--sample_num", "8", "--per_device_batch_size", "4",
                                    "--gradient_accumulation_steps", "2"]), world_size=8)
    assert (eight.num_rollout_ranks, eight.num_learner_ranks, eight.optimizer_steps_per_step) == (6, 2, 2)
    with pytest.raises(ConfigError, match="must split evenly"):
        Derived.of(load_config(["--prompts_per_step", "5", "--sample_num", "3"]), world_size=1)
    three = Derived.of(load_config(["--learner_ranks", "2", "--prompts_per_step", "8"]), world_size=3)
    assert (three.num_rollout_ranks, three.num_learner_ranks) == (1, 2)


def test_more_learner_ranks_than_the_job_allows_is_an_error():
    """W processes hold at most W - 1 learners (one rank must roll out); one process runs both
    roles and ignores learner_ranks, so the demo config's 2 runs there as it is."""
    assert Derived.of(load_config(["--learner_ranks", "5"]), world_size=1).num_learner_ranks == 1
    assert Derived.of(load_config(["--learner_ranks", "1"]), world_size=2).num_learner_ranks == 1
    for ranks, world in (("5", 2), ("2", 2), ("8", 8)):
        with pytest.raises(ConfigError) as err:
            Derived.of(load_config(["--learner_ranks", ranks, "--prompts_per_step", "8"]), world_size=world)
        assert str(err.value) == (f"learner_ranks {ranks} needs at least {int(ranks) + 1} processes (the learners "
                                  f"and a rollout rank), this job has {world}: set learner_ranks to at most "
                                  f"{world - 1} or start more processes")


def test_plan_and_dry_run_take_a_world_size_and_its_nodes(monkeypatch):
    from config import split_inspection

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert split_inspection(["--plan", "16", "--nnodes", "2", "--seed", "1"]) == (["--seed", "1"], "plan", 16, 2)
    assert split_inspection(["--nnodes=4", "--dry_run"]) == ([], "dry_run", 8, 4)
    assert split_inspection(["--plan"]) == ([], "plan", 8, 1)  # one node of 8
    assert split_inspection(["--seed", "1"]) == (["--seed", "1"], None, None, None)  # a run: torchrun's layout
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert split_inspection(["--plan"]) == ([], "plan", 16, 2) and config.torchrun_nodes() == 2
    with pytest.raises(ConfigError, match="--nnodes goes with --plan or --dry_run"):
        split_inspection(["--nnodes", "2"])
    with pytest.raises(ConfigError, match="--nnodes expects a number of nodes >= 1, got '0'"):
        split_inspection(["--plan", "--nnodes", "0"])
    cfg = load_config(["--learner_ranks", "2"])
    assert Derived.of(cfg, 16, nodes=2).nodes == 2
    with pytest.raises(ConfigError, match="--nnodes 3 does not split 8 ranks evenly"):
        Derived.of(cfg, 8, nodes=3)


def test_rollout_tensor_parallel_must_divide_the_rollout_ranks_and_needs_vllm():
    vllm = ["--rollout_engine", "vllm", "--learner_ranks", "2", "--prompts_per_step", "8"]
    with pytest.raises(ConfigError, match="^rollout_tensor_parallel 2 needs rollout_engine vllm: the built-in engine"):
        load_config(["--rollout_tensor_parallel", "2"])
    with pytest.raises(ConfigError, match="rollout_tensor_parallel must be >= 1"):
        load_config([*vllm, "--rollout_tensor_parallel", "0"])
    cfg = load_config([*vllm, "--rollout_tensor_parallel", "2"])
    eight = Derived.of(cfg, 8)
    assert (eight.num_rollout_ranks, eight.rollout_tensor_parallel, Layout.of(eight).num_engines) == (6, 2, 3)
    assert Layout.of(Derived.of(load_config(vllm), 8)).num_engines == 6  # the default: an engine per rollout rank
    with pytest.raises(ConfigError) as err:
        Derived.of(load_config([*vllm, "--rollout_tensor_parallel", "4"]), 8)
    assert str(err.value) == ("rollout_tensor_parallel 4 does not divide the 6 rollout ranks (8 ranks - learner_ranks "
                              "2): values that do: 1, 2, 3, 6")
    with pytest.raises(ConfigError, match="needs a torchrun job"):
        Derived.of(cfg, 1)
    # Two nodes of 4: engines of 2 ranks stay on a node (0-1, 2-3 | 4-5), engines of 3 would not (3-5).
    assert Layout.of(Derived.of(cfg, 8, nodes=2)).num_engines == 3
    with pytest.raises(ConfigError, match="the engine of rollout ranks 3-5 would span two nodes"):
        Derived.of(load_config([*vllm, "--rollout_tensor_parallel", "3"]), 8, nodes=2)


@pytest.mark.parametrize("inspection", ["--plan", "--dry_run"])
def test_plan_and_dry_run_refuse_a_tensor_parallel_that_cannot_work_in_one_line(inspection, tmp_path, capsys):
    import train_dapo

    argv = ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml"), "--model_path",
            str(ROOT / "configs" / "models" / "qwen3-30b-a3b"), "--output_dir", str(tmp_path / "out"), inspection]
    assert train_dapo.main([*argv, "--rollout_engine", "vllm", "--rollout_tensor_parallel", "4"]) == 2
    assert capsys.readouterr().err == ("error: rollout_tensor_parallel 4 does not divide the 6 rollout ranks (8 ranks - "
                                       "learner_ranks 2): values that do: 1, 2, 3, 6\n")
    assert train_dapo.main([*argv, "--rollout_tensor_parallel", "2"]) == 2  # the config's built-in engine
    assert capsys.readouterr().err.startswith("error: rollout_tensor_parallel 2 needs rollout_engine vllm")
    assert train_dapo.main([*argv, "--rollout_engine", "vllm", "--rollout_tensor_parallel", "3"]) == 2
    err = capsys.readouterr().err  # 3 divides the 6 rollout ranks; vLLM cannot split 32 heads over 3
    assert err.count("\n") == 1 and "rollout_tensor_parallel 3 does not divide the model's 32 attention heads" in err
    assert not (tmp_path / "out").exists()


def test_train_dapo_refuses_too_many_learner_ranks_before_writing_anything(tmp_path):
    # WORLD_SIZE as torchrun sets it: the check comes before any process group is formed.
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/demo_cpu.yaml", "--learner_ranks", "5",
                           "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: learner_ranks 5 needs at least 6 processes (the learners and a rollout rank), this job has 2: "
        "set learner_ranks to at most 1 or start more processes"]
    assert not out.exists()


def tiny_model_config(folder: Path) -> Path:
    """A config.json of a Qwen3-MoE too small to need a low learning rate."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 101,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_experts": 8, "tie_word_embeddings": True}))
    return folder


def test_the_learning_rate_warning_follows_the_models_size_not_its_path(tmp_path):
    big = tmp_path / "demo_of_the_30b"  # "demo" in the path, 30.5B parameters in config.json
    big.mkdir()
    shutil.copy(ROOT / "configs" / "models" / "qwen3-30b-a3b" / "config.json", big)
    small = tiny_model_config(tmp_path / "qwen3-moe-tiny")
    assert model_params(str(big)) == pytest.approx(30.53e9, rel=1e-3)  # the memory plan's exact count
    assert model_params(str(small)) == pytest.approx(229_056, rel=0.01)  # built on meta: 229,056
    assert model_params(str(tmp_path / "nothing")) is None

    def lr_warnings(model: Path, lr: str) -> list[str]:
        return [w for w in warnings_for(load_config(["--model_path", str(model), "--learning_rate", lr]))
                if "learning_rate" in w]

    assert lr_warnings(big, "2e-5") == [
        "learning_rate=2e-05 is high for RL on a model of 30.5B parameters (article 5.4: ~1e-6 for a large MoE model)"]
    assert lr_warnings(big, "1e-6") == []
    assert lr_warnings(small, "2e-4") == []  # the demo's rate on a tiny model, wherever it lives


def test_report_to_takes_none_console_and_wandb():
    assert load_config(["--report_to", "none"]).run.report_to == ["none"]
    assert load_config(["--report_to", "[console, wandb]"]).run.report_to == ["console", "wandb"]
    assert load_config(["--report_to", "[csv, tensorboard, wandb]"]).run.report_to == ["csv", "tensorboard", "wandb"]


@pytest.mark.parametrize("argv, line", [
    (["--kl_coeff", "0.1"], "error: unknown config key 'kl_coeff' on the command line (did you mean 'kl_coef'?)"),
    (["--learning_rate", "abc"], "error: config key 'learning_rate' expects a number, got 'abc'"),
])
def test_train_dapo_exits_2_with_one_line(argv, line):
    proc = subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/demo_cpu.yaml", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line]


def test_checkpoints_and_exports_follow_their_own_periods():
    from dataclasses import replace

    from config import Schedule

    cfg = load_config(["--max_steps", "10", "--save_every", "2", "--hf_export_every", "4"])
    schedule = Schedule(cfg.run, has_val_set=False)
    assert [v for v in range(11) if schedule.saves(v)] == [2, 4, 6, 8, 10]
    assert [v for v in range(11) if schedule.exports(v)] == [4, 8, 10]  # and the last, always
    default = Schedule(load_config(["--max_steps", "10", "--save_every", "3"]).run, has_val_set=False)
    assert [v for v in range(11) if default.exports(v)] == [10]  # hf_export_every 0: the last step only
    resumed = replace(schedule, resumed_from=8)
    assert [v for v in range(11) if resumed.exports(v)] == [10]  # a resumed run has its first one already
    assert not any(Schedule(replace(cfg.run, save_every=0), has_val_set=False).exports(v) for v in range(11))


def test_offload_needs_a_torchrun_job():
    cfg = load_config(["--learner_offload", "true"])
    with pytest.raises(ConfigError, match="learner_offload needs a torchrun job"):
        Derived.of(cfg, 1)
    assert Derived.of(cfg, 8).num_learner_ranks == 2


def key_lines(text: str) -> dict[str, str]:
    """--help's "  --KEY  DEFAULT" lines, by key."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^  --(\w+) +(.*)$", text, flags=re.M)}


def test_help_lists_every_key_with_its_default_and_meaning():
    proc = subprocess.run([sys.executable, "train_dapo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("usage: python train_dapo.py --config FILE.yaml [--KEY VALUE ...]\n")
    assert "--plan [WORLD_SIZE]" in text and "--dry_run [WORLD_SIZE]" in text
    listed, defaults = key_lines(text), config.default_texts()
    assert set(config.KEY_SECTION) <= set(listed)
    for key in config.KEY_SECTION:
        assert listed[key] == defaults[key], key
    assert (listed["learning_rate"], listed["report_to"], listed["reward_model"], listed["dynamic_sampling"]) == (
        "1e-06", "[csv]", "null", "true")
    lines = text.splitlines()
    for key in config.KEY_SECTION:  # under its section's heading, with a line of meaning
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  --{key} "))
        heading = next(line for line in reversed(lines[:at]) if line and not line.startswith(" "))
        assert heading == f"{config.KEY_SECTION[key]}:", key
        assert lines[at + 1].startswith("      ") and len(lines[at + 1].strip()) > 10, key
    assert "[token-mean | seq-mean-token-mean | seq-mean-token-sum]" in text  # a Literal key's choices


def undeclared(classes) -> list[str]:
    """'KEY lacks WHAT' for each field of ``classes`` not declared through config.key: a default, a
    line of help, whether a resume may change it, and its check (None where it has none)."""
    missing = []
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                missing.append(f"{f.name} lacks a default")
            text = f.metadata.get("help")
            if not isinstance(text, str) or len(text.strip()) < 10 or "\n" in text:
                missing.append(f"{f.name} lacks a line of help")
            if not isinstance(f.metadata.get("resumable"), bool):
                missing.append(f"{f.name} lacks resumable")
            if "check" not in f.metadata or not (f.metadata["check"] is None or callable(f.metadata["check"])):
                missing.append(f"{f.name} lacks a check (None for none)")
    return missing


def test_every_key_declares_its_default_help_check_and_resumable():
    # A key added to a dataclass bare (not through config.key) would show in --help without a
    # meaning and make a resume that changes it warn or not by accident.
    assert undeclared(config.SECTIONS.values()) == []
    assert config.KEY_HELP == {name: config._FIELDS[name].metadata["help"] for name in config.KEY_SECTION}

    @dataclasses.dataclass(frozen=True)
    class Bare:  # the test sees what it is for
        plain: int = 1
        helped: int = dataclasses.field(default=1, metadata={"help": "a line of help only"})
        declared: list[int] = config.key([1], "a list copied for each instance", resumable=True)

    assert undeclared([Bare]) == ["plain lacks a line of help", "plain lacks resumable",
                                  "plain lacks a check (None for none)", "helped lacks resumable",
                                  "helped lacks a check (None for none)"]
    assert Bare().declared == [1] and Bare().declared is not Bare().declared


def another_value(name: str, value):
    """A valid value of key ``name`` other than ``value`` (the default)."""
    tp = config._FIELD_TYPES[name]
    if value is None:
        return {"config": "other.yaml", "resume_from_checkpoint": "auto"}.get(name, 7)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return ["tensorboard"] if name == "report_to" else [*value, 1]
    return [a for a in typing.get_args(tp) if a != value][0] if typing.get_origin(tp) is Literal else value + "2"


def resume_warnings(tmp_path, changes: dict) -> list[str]:
    """What check_resumable warns of when this run's settings are a checkpoint's with ``changes``."""
    import resuming

    folder = tmp_path / "step_00000001"
    (folder / "learner_state").mkdir(parents=True, exist_ok=True)
    fingerprint = {"model": {}, "tokenizer": {}, "layout": {}, "data": {"train_prompts": "x"}}
    saved = Config().flat()
    (folder / "trainer_state.json").write_text(json.dumps({"fingerprint": fingerprint, "config": saved}))
    current = {**saved, **changes}
    validate_flat(current)
    warnings: list[str] = []
    resuming.check_resumable(folder, fingerprint, current, warnings.append, source_rows=[])
    return warnings


def validate_flat(flat: dict) -> None:
    """The changed settings are ones a run takes (each key's check), so the test asks a real question."""
    sections = {s: {k: v for k, v in flat.items() if config.KEY_SECTION[k] == s} for s in config.SECTIONS}
    config.validate(Config(**{s: config.SECTIONS[s](**kw) for s, kw in sections.items()}))


def test_a_resume_warns_of_changed_settings_but_not_of_resumable_ones(tmp_path):
    defaults = Config().flat()
    resumable = {name: another_value(name, defaults[name]) for name in sorted(config.RESUMABLE_KEYS)}
    assert {"config", "host_memory_gb", "disk_gb", "async_save", "max_steps"} <= set(resumable)
    assert resume_warnings(tmp_path, resumable) == []
    assert resume_warnings(tmp_path, {**resumable, "learning_rate": 2e-6}) == [
        "resuming with changed settings (learning_rate): the run will not match an uninterrupted one"]
    assert not {"learning_rate", "seed", "deterministic", "device", "max_staleness"} & config.RESUMABLE_KEYS


def test_short_help_and_no_arguments(capsys):
    import train_dapo

    assert train_dapo.main(["--config", "x.yaml", "-h"]) == 0  # anywhere on the line, before the config is read
    assert key_lines(capsys.readouterr().out)["learner_ranks"] == "2"
    assert config.answer_usage(["--config", "x.yaml"], prog="train_dapo.py") is None  # a run: go on
    proc = subprocess.run([sys.executable, "train_dapo.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # not a training run into runs/dapo
    assert proc.stderr.startswith("usage: python train_dapo.py --config FILE.yaml [--KEY VALUE ...]\n")
    assert "(--plan | --dry_run) [WORLD_SIZE]" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: no arguments: give --config FILE.yaml and --KEY VALUE settings "
        "(python train_dapo.py --help lists every key)")
    assert proc.stdout == ""
