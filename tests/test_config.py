"""Config: precedence, unknown keys, wrong types, derived values, and the CLI's exit status."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config import Config, ConfigError, Derived, load_config, warnings_for

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
    (["--report_to", "[csv, wandb]"], "report_to takes csv and tensorboard, got ['csv', 'wandb']"),
    (["--log_completions", "-1"], "log_completions must be >= 0 (0 = off)"),
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
    two = Derived.of(load_config(["--learner_ranks", "2", "--prompts_per_step", "4"]), world_size=2)
    assert (two.num_rollout_ranks, two.num_learner_ranks) == (1, 1)  # always one rank left to roll out


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
