"""The one-process DAPO loop end to end: a real step, overrides, alarms, skipped steps, determinism."""
import csv
import hashlib
import math
import os
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

import train_dapo
from config import Derived, load_config
from device import select_platform
from metrics import TIMING_COLUMNS, AlarmMonitor
from tests.cuda_determinism import RefusedOnCuda


ROOT = Path(__file__).resolve().parents[1]


def read_metrics(out_dir: Path) -> list[dict[str, str]]:
    with (out_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def make_trainer(argv, cls=train_dapo.Trainer):
    cfg = load_config(argv)
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    return cls(cfg, select_platform("cpu"), Derived.of(cfg, 1))


def test_one_full_step_trains_and_writes_everything(demo_argv, tmp_path):
    trainer = make_trainer(demo_argv + ["--max_steps", "2"])
    policy = trainer.learner.policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer.train()
    out = tmp_path / "run"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["val_acc"] != "" and rows[1]["val_acc"] == "" and rows[2]["val_acc"] != ""
    for row in rows[1:]:
        assert math.isfinite(float(row["policy_loss"])) and float(row["grad_norm"]) > 0
        assert int(row["optimizer_steps"]) == trainer.derived.optimizer_steps_per_step * int(row["step"])
        assert 0 <= float(row["acc_mean"]) <= 1 and int(row["num_gen_batches"]) >= 1
    changed = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight changed after two steps"
    rollout = dict(trainer.rollout.engine.model.state_dict())
    assert all(torch.equal(rollout[k], v) for k, v in policy.state_dict().items()), "weights not synced"
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_main_writes_config_and_env_report_and_is_deterministic(demo_argv, tmp_path):
    """Two runs match; the second with run.deterministic, which on a CPU changes no number: none
    of its ops reads memory it did not write (deterministic mode fills fresh tensors) and none is
    one a CUDA device refuses under deterministic algorithms (its rollout and its training step
    included); the setting ends with the run."""
    runs, refused = [], RefusedOnCuda()
    for name, deterministic in (("a", nullcontext()), ("b", refused)):
        argv = demo_argv + ["--max_steps", "3", "--output_dir", str(tmp_path / name),
                            "--deterministic", str(name == "b").lower()]
        with deterministic:
            assert train_dapo.main(argv) == 0
        assert not torch.are_deterministic_algorithms_enabled()
        runs.append(read_metrics(tmp_path / name))
        assert (tmp_path / name / "config.yaml").is_file() and (tmp_path / name / "env_report.json").is_file()
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]  # noqa: E731
    assert strip(runs[0]) == strip(runs[1])
    assert len(runs[0]) == 4
    assert not refused.seen, refused.seen


def test_existing_checkpoints_are_not_overwritten(demo_argv, tmp_path, capsys):
    argv = demo_argv + ["--max_steps", "2"]
    assert train_dapo.main(argv) == 0
    before = (tmp_path / "run" / "metrics.csv").read_bytes()
    assert train_dapo.main(argv) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == before


def test_an_earlier_runs_output_without_checkpoints_is_not_replaced(demo_argv, tmp_path, capsys):
    """save_every 0 (or a crash before the first save) leaves metrics and curves but no checkpoint."""
    argv = demo_argv + ["--max_steps", "1", "--save_every", "0", "--val_every", "0"]
    assert train_dapo.main(argv) == 0
    out = tmp_path / "run"
    before = {name: (out / name).read_bytes() for name in ("metrics.csv", "completions.jsonl")}
    assert train_dapo.main(argv) == 2
    assert "already holds an earlier run's metrics.csv, completions.jsonl" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert train_dapo.main(argv + ["--overwrite_output_dir", "true"]) == 0


def readme_example() -> str:
    """The subclassing example of README.md, as a user would copy it."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n# my_dapo.py") + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_readme_override_example_trains_with_its_advantages(demo_argv, tmp_path):
    """The README's Trainer subclass, run as a script: its advantages, not the default ones,
    drive the update (the same step with the default Trainer gives other weights)."""
    (tmp_path / "my_dapo.py").write_text(readme_example())
    argv = demo_argv + ["--max_steps", "1", "--save_every", "1", "--val_every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, script in (("default", str(ROOT / "train_dapo.py")), ("override", str(tmp_path / "my_dapo.py"))):
        proc = subprocess.run([sys.executable, script, *argv, "--output_dir", str(tmp_path / name)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = read_metrics(tmp_path / name)[-1]
        weights = tmp_path / name / "checkpoints" / "step_00000001" / "model" / "model.safetensors"
        runs[name]["weights"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    default, override = runs["default"], runs["override"]
    assert default["reward_mean"] == override["reward_mean"]  # the same samples ...
    assert default["weights"] != override["weights"]  # ... trained on with other advantages


def test_update_policy_override_receives_the_step(demo_argv, tmp_path):
    seen = {}

    class Recording(train_dapo.Trainer):
        def update_policy(self, batch, advantages):
            seen["groups"], seen["adv"] = batch.num_groups, advantages.shape
            return {"policy_loss": 123.0}

    make_trainer(demo_argv + ["--max_steps", "1", "--save_every", "0", "--val_every", "0"], Recording).train()
    assert seen == {"groups": 6, "adv": torch.Size([48])}
    assert read_metrics(tmp_path / "run")[-1]["policy_loss"] == "123.0"


def test_non_finite_gradient_step_is_skipped_not_applied(demo_argv):
    trainer = make_trainer(demo_argv + ["--max_steps", "1"])
    learner = trainer.learner
    before = {k: v.clone() for k, v in learner.policy.named_parameters()}
    for p in learner.policy.parameters():
        p.grad = torch.full_like(p, float("nan"))
    assert learner.optimizer_step(step=1) == 0.0
    assert learner.skipped_steps == 1 and learner.optimizer_steps == 0
    assert all(torch.equal(p, before[k]) for k, p in learner.policy.named_parameters())
    assert all(p.grad is None for p in learner.policy.parameters())


def test_kl_loss_pulls_the_update_toward_the_reference_model(demo_argv, tmp_path):
    """Six optimizer steps in one training step: the first sees policy == reference (KL 0), the
    later ones a policy that moved, so the step's KL is positive and the update differs."""
    weights = {}
    for kl_coef in ("0.0", "1.0"):
        argv = demo_argv + ["--max_steps", "1", "--kl_coef", kl_coef, "--save_every", "0", "--val_every", "0",
                            "--output_dir", str(tmp_path / kl_coef)]
        trainer = make_trainer(argv)
        trainer.train()
        weights[kl_coef] = [p.detach().clone() for p in trainer.learner.policy.parameters()]
        row = read_metrics(tmp_path / kl_coef)[-1]
    assert float(row["kl"]) > 0 and row["kl_coef"] == "1.0"
    assert any(not torch.equal(a, b) for a, b in zip(weights["0.0"], weights["1.0"]))


def test_alarm_rules_on_synthetic_sequences():
    monitor = AlarmMonitor(length_rising_steps=3, overfit_checks=2)
    assert monitor.observe_step(kl=0.010, length=10, reward_std=0.5) == []
    assert any("learning rate" in m for m in monitor.observe_step(kl=0.035, length=11, reward_std=0.5))
    assert monitor.observe_step(kl=0.036, length=12, reward_std=0.5) == []
    assert any("length penalty" in m for m in monitor.observe_step(kl=0.037, length=13, reward_std=0.5))
    assert monitor.observe_step(kl=0.037, length=12, reward_std=0.5) == []  # the streak breaks
    assert any("no signal" in m for m in monitor.observe_step(kl=0.037, length=12, reward_std=0.0))
    assert monitor.observe_validation(val_reward=0.5, train_reward=0.1) == []
    assert monitor.observe_validation(val_reward=0.4, train_reward=0.2) == []
    assert any("memorising" in m for m in monitor.observe_validation(val_reward=0.3, train_reward=0.3))
    assert monitor.observe_validation(val_reward=0.35, train_reward=0.4) == []  # val recovered
    assert monitor.counts == {"alarm_kl_jump": 1, "alarm_length_rising": 1, "alarm_no_signal": 1, "alarm_overfit": 1}


def test_bad_dataset_row_exits_2_with_one_line(demo_argv, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    assert train_dapo.main(demo_argv + ["--dataset", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}:2:" in err[0]


def test_bf16_learner_with_gradient_checkpointing_trains(demo_argv, tmp_path):
    trainer = make_trainer(demo_argv + ["--max_steps", "1", "--learner_dtype", "bf16", "--rollout_dtype", "bf16",
                                        "--gradient_checkpointing", "true", "--save_every", "0", "--val_every", "0"])
    assert trainer.rollout.engine.model.dtype == torch.bfloat16
    assert next(trainer.learner.policy.parameters()).dtype == torch.float32  # fp32 master weights under bf16 autocast
    trainer.train()
    row = read_metrics(tmp_path / "run")[-1]
    assert math.isfinite(float(row["policy_loss"])) and float(row["grad_norm"]) > 0
    assert float(row["mismatch_mean"]) > 0  # bf16 rollout vs learner log-probs differ, and the metric shows it


# ----- bad input: one line on stderr, exit status 2, nothing written ----------------------------

@pytest.mark.parametrize("extra, expected, hidden_module", [
    (["--reward_fn", "no_such_module:fn"], r"reward_fn 'no_such_module:fn': cannot import module", None),
    (["--reward_fn", "math_verify"], r"reward_fn math_verify needs the math_verify package", "math_verify"),
    (["--eos_token_ids", "[999999]"], r"eos_token_ids: 999999 is outside the vocabulary .* \(101 ids", None),
    (["--device", "cuda"], r"device cuda: torch sees no CUDA device", None),
    (["--config", "{tmp}/missing.yaml"], r"config file not found: .*missing\.yaml", None),
    (["--config", "{tmp}/invalid.yaml"], r"invalid\.yaml: line \d+ is not valid YAML", None),
    (["--per_device_batch_size", "5"], r"48 sequences must split evenly", None),
    (["--report_to", "[csv, tensorboard]"], r"report_to tensorboard needs the tensorboard package", "tensorboard"),
], ids=["reward_fn", "math_verify_missing", "eos_id", "device", "config_file", "yaml", "batch_sizes",
        "tensorboard_missing"])
def test_bad_input_stops_with_one_line_before_writing_anything(demo_argv, tmp_path, capsys, monkeypatch, extra,
                                                               expected, hidden_module):
    (tmp_path / "invalid.yaml").write_text("run:\n  max_steps: 3\n  seed: [1\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    if hidden_module:
        monkeypatch.setitem(sys.modules, hidden_module, None)  # as if the package were not installed
    argv = demo_argv + ["--max_steps", "1"] + [arg.format(tmp=tmp_path) for arg in extra]  # short if it runs
    assert train_dapo.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(expected, err[0]), err
    assert not (tmp_path / "run").exists()


CONSTANT_REWARD = '''
def score(response, answer):
    return 1.0, True
'''


def test_a_reward_without_spread_stops_at_max_gen_batches(demo_argv, tmp_path, capsys, monkeypatch):
    (tmp_path / "constant_reward_for_test.py").write_text(CONSTANT_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # where a user's reward module would be importable from
    argv = demo_argv + ["--reward_fn", "constant_reward_for_test:score", "--max_gen_batches", "1", "--max_steps", "1"]
    assert train_dapo.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(r"error: step 1: only 0 of 6 groups .* after 1 generation batches "
                                          r"\(max_gen_batches\).*", err[0]), err
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == ["0"]  # what was written stays whole


def test_supported_architectures_train_and_others_are_refused_with_one_line(demo_assets, tmp_path, capsys):
    """A tiny Llama (one of learner.SUPPORTED_MODEL_TYPES besides the demo's Qwen3-MoE) trains a
    step with the demo's tokenizer; GPT-2, laid out otherwise, is refused before anything loads."""
    from transformers import AutoTokenizer, GPT2Config, LlamaConfig, LlamaForCausalLM

    import train_dapo

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "model")
    llama = tmp_path / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 bos_token_id=None)).save_pretrained(llama)
    tokenizer.save_pretrained(llama)
    gpt2 = tmp_path / "gpt2"
    GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)

    def run(model: Path) -> int:
        return train_dapo.main(["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(model),
                                "--dataset", str(demo_assets / "train.jsonl"), "--val_dataset", "",
                                "--output_dir", str(tmp_path / model.name / "run"), "--max_steps", "1",
                                "--learner_ranks", "1", "--dynamic_sampling", "false"])  # a random Llama is always wrong

    assert run(llama) == 0
    assert (tmp_path / "llama" / "run" / "checkpoints" / "step_00000001").is_dir()
    capsys.readouterr()
    assert run(gpt2) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type 'gpt2' is not supported (supported: qwen3_moe, qwen3, qwen2, llama)" in err
    assert not (tmp_path / "gpt2" / "run").exists()
