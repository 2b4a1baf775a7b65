"""Every algorithm option in a real training step, against slow, obviously-correct references.

Most checks take step 1's batch of the demo, run the learner's update on it with the whole batch
as one mini-batch, and capture the gradient the learner accumulated (micro-batch by micro-batch)
just before its optimizer step. The reference is the loss written out by hand from docs/algorithm.md
on the whole batch in one forward pass; an option that did nothing, or the wrong thing, would
move the gradient away from it. At step 1 the policy is the weights that generated the batch,
so old_logp is the policy's own log-prob and every ratio is 1.
"""
import csv
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train_dapo
from config import Derived, load_config
from device import select_platform
from engine import Sampling
from rollout import DynamicSampler
from tests.test_rollout import fake_batch

ROOT = Path(__file__).resolve().parents[1]
# The whole step (6 prompts x 8 responses) in one mini-batch of 6 micro-batches of 8.
ONE_MINIBATCH = ["--per_device_batch_size", "8", "--gradient_accumulation_steps", "6"]


def demo_args(assets: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(assets / "model"),
            "--dataset", str(assets / "train.jsonl"), "--val_dataset", str(assets / "val.jsonl"),
            "--output_dir", str(out), "--max_steps", "1", "--save_every", "0", "--val_every", "0",
            "--val_max_prompts", "24", "--log_every", "1", *extra]


def make_trainer(argv: list[str]) -> train_dapo.Trainer:
    cfg = load_config(argv)
    Path(cfg.run.output_dir).mkdir(parents=True, exist_ok=True)
    return train_dapo.Trainer(cfg, select_platform("cpu"), Derived.of(cfg, 1))


def read_rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def step_batch(demo_assets, tmp_path_factory):
    """Step 1's batch of the demo (the same for every option: generation does not read them)."""
    trainer = make_trainer(demo_args(demo_assets, tmp_path_factory.mktemp("collect")))
    batch, _ = trainer.collect(1)
    assert len(set(batch.response_lengths.tolist())) > 1  # the length penalty needs lengths that differ
    return batch


@pytest.fixture
def learner_step(demo_assets, tmp_path, step_batch):
    """``run(*options, batch=...)`` -> (trainer, the accumulated gradient of the one mini-batch, row)."""
    def run(*options: str, batch=step_batch):
        trainer = make_trainer(demo_args(demo_assets, tmp_path / "out", *ONE_MINIBATCH, *options))
        captured = []

        def capture(step: int) -> float:
            captured.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                             for p in trainer.learner.policy.parameters()])
            trainer.learner.optimizer.zero_grad(set_to_none=True)
            return 1.0

        trainer.learner.optimizer_step = capture
        trainer.step = 1
        row = trainer.update_policy(batch, trainer.compute_advantages(batch))
        assert len(captured) == 1, "the whole step should be one mini-batch"
        return trainer, captured[0], row
    return run


def reference_gradient(trainer, batch, loss_of) -> list[torch.Tensor]:
    """The gradient of ``loss_of(logp, entropy, mask, old_logp)`` on the whole batch at once."""
    learner, whole = trainer.learner, batch.trimmed()
    width = whole.response_ids.shape[1]
    old = learner.logprobs_of(learner.policy, batch, torch.arange(batch.response_ids.shape[0]))[:, :width]
    learner.policy.zero_grad(set_to_none=True)
    logp, entropy = learner.sequence_logprobs(learner.policy, whole, with_entropy=True)
    loss_of(logp, entropy, whole.response_mask, old).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in learner.policy.parameters()]
    learner.policy.zero_grad(set_to_none=True)
    return grads


def clipped_token_loss(logp, old, advantages):
    """docs/algorithm.md §4 token by token: -min(r A, clip(r, 0.8, 1.28) A), dual clip at 10 for A < 0."""
    ratio = torch.exp(logp - old)
    adv = advantages[:, None]
    loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    return torch.where(adv < 0, torch.minimum(loss, -10.0 * adv), loss)


def clipped_pg(logp, old, advantages, mask, normalizer, is_weights=None):
    """The token-mean policy loss (over ``normalizer`` tokens), optionally importance-weighted."""
    loss = clipped_token_loss(logp, old, advantages)
    if is_weights is not None:
        loss = loss * is_weights
    return (loss * mask).sum() / normalizer


def assert_same_gradient(actual, expected):
    # Six micro-batch forwards (each trimmed to its own widths) against one whole-batch forward:
    # the same sums in another order, float32 rounding ~1e-6 relative to the largest entry.
    scale = max(float(g.abs().max()) for g in expected)
    assert scale > 0
    worst = max(float((a - e).abs().max()) for a, e in zip(actual, expected))
    assert worst <= 2e-5 * scale, f"largest difference {worst:.3g} against a gradient scale of {scale:.3g}"


def test_the_default_update_is_the_token_mean_clipped_loss(learner_step, step_batch):
    trainer, grads, row = learner_step()
    advantages = trainer.compute_advantages(step_batch)
    expected = reference_gradient(trainer, step_batch, lambda logp, ent, mask, old: clipped_pg(
        logp, old, advantages, mask.float(), mask.sum()))
    assert_same_gradient(grads, expected)
    assert row["length_penalty"] == 0.0 and row["kl"] is None


def test_one_and_four_micro_batches_give_the_same_update(learner_step):
    _, one, _ = learner_step("--per_device_batch_size", "48", "--gradient_accumulation_steps", "1")
    _, four, _ = learner_step("--per_device_batch_size", "12", "--gradient_accumulation_steps", "4")
    assert_same_gradient(four, one)


def test_length_penalty_is_the_group_relative_score_function_term(learner_step, step_batch):
    trainer, grads, row = learner_step("--length_penalty_coef", "0.5")
    lengths = step_batch.response_lengths.tolist()
    group_mean = [sum(lengths[g:g + 8]) / 8 for g in range(0, len(lengths), 8)]
    rho = torch.tensor([length / group_mean[i // 8] for i, length in enumerate(lengths)])
    advantages = trainer.compute_advantages(step_batch)

    def loss(logp, ent, mask, old):
        tokens = mask.sum()
        penalty = 0.5 * sum((rho[i] - 1) * logp[i][mask[i]].sum() for i in range(len(lengths))) / tokens
        return clipped_pg(logp, old, advantages, mask.float(), tokens) + penalty
    assert_same_gradient(grads, reference_gradient(trainer, step_batch, loss))
    assert row["length_penalty"] != 0.0


@pytest.mark.parametrize("coeff", ["0.5", "-0.5"])
def test_entropy_coeff_is_a_bonus_when_positive(learner_step, step_batch, coeff):
    trainer, grads, row = learner_step("--entropy_coeff", coeff)
    advantages = trainer.compute_advantages(step_batch)
    expected = reference_gradient(trainer, step_batch, lambda logp, ent, mask, old: (
        clipped_pg(logp, old, advantages, mask.float(), mask.sum()) - float(coeff) * (ent * mask).sum() / mask.sum()))
    assert_same_gradient(grads, expected)
    assert row["entropy"] > 0


def test_tis_cap_weights_each_token_by_the_truncated_importance_ratio(learner_step, step_batch):
    # Rollout log-probs off by -1, 0 or +1 per row: weights min(e^1, 2) = 2, 1 and e^-1.
    offsets = torch.tensor([-1.0, 0.0, 1.0]).repeat(16)[:, None]
    skewed = replace(step_batch, rollout_logp=step_batch.rollout_logp + offsets * step_batch.response_mask)
    trainer, grads, row = learner_step("--tis_cap", "2.0", batch=skewed)
    advantages = trainer.compute_advantages(skewed)

    def loss(logp, ent, mask, old):
        weights = torch.exp(old - skewed.rollout_logp[:, :mask.shape[1]]).clamp(max=2.0)
        return clipped_pg(logp, old, advantages, mask.float(), mask.sum(), is_weights=weights)
    assert_same_gradient(grads, reference_gradient(trainer, skewed, loss))
    assert row["mismatch_mean"] > 0.5  # the metric sees the skew


def test_kl_term_uses_the_reference_model(learner_step, step_batch):
    # k1 (logp - ref_logp) has a gradient even where policy and reference agree, as at step 1.
    trainer, grads, row = learner_step("--kl_coef", "0.3", "--kl_type", "k1")
    advantages = trainer.compute_advantages(step_batch)
    assert trainer.learner.ref_model is not None and trainer.learner.ref_model is not trainer.learner.policy
    expected = reference_gradient(trainer, step_batch, lambda logp, ent, mask, old: (
        clipped_pg(logp, old, advantages, mask.float(), mask.sum()) + 0.3 * ((logp - old) * mask).sum() / mask.sum()))
    assert_same_gradient(grads, expected)
    assert row["kl_coef"] == 0.3 and abs(row["kl"]) < 1e-5  # policy == reference at step 1


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_mean_loss_modes(learner_step, step_batch, mode):
    trainer, grads, _ = learner_step("--loss_agg_mode", mode)
    advantages = trainer.compute_advantages(step_batch)

    def loss(logp, ent, mask, old):
        per_sequence = (clipped_token_loss(logp, old, advantages) * mask).sum(-1)
        if mode == "seq-mean-token-mean":
            per_sequence = per_sequence / mask.sum(-1)
        return per_sequence.sum() / len(per_sequence)
    assert_same_gradient(grads, reference_gradient(trainer, step_batch, loss))


def test_norm_adv_by_std_false_centres_without_scaling(demo_assets, tmp_path, step_batch):
    plain = make_trainer(demo_args(demo_assets, tmp_path / "a", "--norm_adv_by_std", "false"))
    rewards = step_batch.reward.view(-1, 8)
    assert torch.allclose(plain.compute_advantages(step_batch), (rewards - rewards.mean(1, keepdim=True)).view(-1))
    scaled = make_trainer(demo_args(demo_assets, tmp_path / "b")).compute_advantages(step_batch)
    assert not torch.allclose(plain.compute_advantages(step_batch), scaled)


def test_ppo_epochs_repeat_the_pass_over_the_step(demo_assets, tmp_path):
    rows = {}
    for epochs in (1, 2):
        out = tmp_path / str(epochs)
        make_trainer(demo_args(demo_assets, out, "--ppo_epochs", str(epochs))).train()
        rows[epochs] = read_rows(out)[-1]
    assert int(rows[2]["optimizer_steps"]) == 2 * int(rows[1]["optimizer_steps"]) == 12
    # The second pass starts from moved weights: its ratios leave 1 from its first mini-batch on.
    assert float(rows[2]["ppo_kl"]) != float(rows[1]["ppo_kl"])


def test_warmups_count_training_steps(demo_assets, tmp_path):
    """kl_coef_init holds for kl_warmup_steps training steps, and the learning rate of every
    optimizer step of training step s is lr * min(1, s / lr_warmup_steps)."""
    out = tmp_path / "warm"
    trainer = make_trainer(demo_args(demo_assets, out, "--max_steps", "3", "--kl_coef_init", "0.05",
                                     "--kl_warmup_steps", "2", "--kl_coef", "0.01", "--lr_warmup_steps", "2",
                                     "--learning_rate", "1e-4"))
    trainer.train()
    rows = read_rows(out)
    assert [float(r["kl_coef"]) for r in rows] == [0.05, 0.05, 0.01]
    assert [float(r["lr"]) for r in rows] == [5e-5, 1e-4, 1e-4]
    # Step 1 with warmup trains exactly like step 1 at half the learning rate without it.
    weights = []
    for name, options in (("warmup", ("--lr_warmup_steps", "2", "--learning_rate", "1e-4")),
                          ("half", ("--learning_rate", "5e-5"))):
        one = make_trainer(demo_args(demo_assets, tmp_path / name, *options))
        one.train()
        weights.append([p.detach().clone() for p in one.learner.policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_val_every_0_never_validates(demo_assets, tmp_path):
    make_trainer(demo_args(demo_assets, tmp_path / "run", "--max_steps", "2")).train()
    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == ["1", "2"] and all(r["val_acc"] == "" for r in rows)


def test_validation_samples_at_val_temperature_and_val_top_p(demo_assets, tmp_path, monkeypatch):
    import engine_builtin

    seen = []
    original = engine_builtin.generate
    monkeypatch.setattr(engine_builtin, "generate", lambda *a, **kw: seen.append(kw["sampling"]) or original(*a, **kw))
    for val_temperature in ("0.7", "0"):
        seen.clear()
        trainer = make_trainer(demo_args(demo_assets, tmp_path / val_temperature, "--val_temperature", val_temperature,
                                         "--val_top_p", "0.9", "--temperature", "1.2", "--top_p", "0.95"))
        trainer.rollout.validation_sums()
        expected = Sampling(0.7, 0.9, greedy=False) if val_temperature == "0.7" else Sampling(1.0, 0.9, greedy=True)
        assert seen and set(seen) == {expected}
        trainer.rollout.generate_shard(1, 1)
        assert seen[-1] == Sampling(1.2, 0.95, greedy=False)  # training keeps its own


def test_dynamic_sampling_metric_defaults_to_acc_for_rules_and_reward_for_reward_models():
    assert Derived.of(load_config([]), 1).dynamic_sampling_metric == "acc"
    assert Derived.of(load_config(["--reward_model", "rm"]), 1).dynamic_sampling_metric == "reward"
    assert Derived.of(load_config(["--dynamic_sampling_metric", "reward"]), 1).dynamic_sampling_metric == "reward"
    # An all-wrong group whose rewards differ only by overlong shaping carries no signal about
    # correctness: filtering on acc drops it, filtering on reward would train on it.
    wrong_but_long = fake_batch([-1.0, -1.0, -1.5, -1.0], group_size=4)  # prompt 0, nothing correct
    right_and_wrong = fake_batch([1.0, -1.0, 1.0, -1.0], group_size=4, first_prompt=1)
    both = type(right_and_wrong).concat([wrong_but_long, right_and_wrong])
    for metric, trained_prompt, informative in (("acc", 1, 1 / 2), ("reward", 0, 2 / 2)):
        sampler = DynamicSampler(load_config(["--prompts_per_step", "1"]).rollout, metric, reports_acc=True)
        batch, stats = sampler.collect(1, lambda k: ([both], 0, 0.0, (0.0, 0.0)), lambda full: None)
        assert set(batch.prompt_index.tolist()) == {trained_prompt} and stats["informative_frac"] == informative


def test_dynamic_sampling_pools_generation_batches_and_carries_the_surplus():
    rollout_cfg = load_config(["--prompts_per_step", "3", "--sample_num", "2"]).rollout
    sampler = DynamicSampler(rollout_cfg, "acc", reports_acc=True)
    batches = iter([fake_batch([1, 0, 0, 0, 1, 1], 2, first_prompt=0),  # 1 informative group (prompt 0)
                    fake_batch([0, 1, 1, 0, 1, 0], 2, first_prompt=3),  # 3 more (prompts 3, 4, 5)
                    fake_batch([1, 0, 1, 0, 0, 0], 2, first_prompt=6)])  # 2 more (prompts 6, 7)
    answers = []
    batch, stats = sampler.collect(1, lambda k: ([next(batches)], k, 0.5, (0.25 * k, 0.125)), answers.append)
    assert answers == [False, True] and stats["num_gen_batches"] == 2 and stats["carried_groups"] == 0
    assert batch.prompt_index.tolist() == [0, 0, 3, 3, 4, 4] and sampler.pool.num_groups == 1
    assert stats["informative_frac"] == 4 / 6 and stats["reward_malformed"] == 1 + 2 and stats["gen_time_s"] == 1.0
    assert (stats["weight_transfer_s"], stats["weight_load_s"]) == (0.25 + 0.5, 0.125 * 2)  # the syncs of both batches
    batch, stats = sampler.collect(2, lambda k: ([next(batches)], 0, 0.5, (0.0, 0.0)), answers.append)
    assert stats["carried_groups"] == 1 and batch.prompt_index.tolist() == [5, 5, 6, 6, 7, 7]
    assert answers[2:] == [True] and sampler.pool.num_groups == 0


def test_a_reward_model_drives_training(demo_assets, tmp_path):
    from tests.test_rewards import _save_tiny_reward_model

    reward_model = _save_tiny_reward_model(tmp_path / "rm")
    out = tmp_path / "run"
    trainer = make_trainer(demo_args(demo_assets, out, "--reward_model", reward_model))
    before = [p.detach().clone() for p in trainer.learner.policy.parameters()]
    trainer.train()
    row = read_rows(out)[-1]
    assert row["acc_mean"] == "" and float(row["reward_std"]) > 0  # scores, not right/wrong
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.learner.policy.parameters()))


def test_alarms_print_a_line_and_count_in_metrics(demo_argv, tmp_path, capsys, monkeypatch):
    (tmp_path / "constant_reward.py").write_text("def score(response, answer):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = demo_argv + ["--max_steps", "2", "--reward_fn", "constant_reward:score", "--dynamic_sampling", "false",
                        "--overlong_buffer_len", "0", "--save_every", "0"]
    assert train_dapo.main(argv) == 0
    alarms = [line for line in capsys.readouterr().err.splitlines() if "ALARM" in line]
    assert len(alarms) == 2
    for step, line in enumerate(alarms, start=1):
        assert line.startswith(f"warning: ALARM step {step}: every response in the batch got the same reward")
    assert [r["alarm_no_signal"] for r in read_rows(tmp_path / "run")[1:]] == ["1", "2"]


def test_one_and_two_learners_give_the_same_update_with_a_sharded_reference(demo_assets, tmp_path):
    """One process (one unsharded learner, which tests/test_ranks.py shows is a 1 rollout + 1
    learner job) vs 1 rollout rank + 2 FSDP2 learners (policy and KL reference sharded): the same
    samples, the same loss and gradient norm, nearly the same weights."""
    from safetensors.torch import load_file

    def args(out: Path, *extra: str) -> list[str]:
        return demo_args(demo_assets, out, "--kl_coef", "0.2", "--kl_type", "k1", "--save_every", "1", *extra)

    # 16 sequences per mini-batch either way: 2 micro-batches of 8 on one learner, 8 on each of two.
    assert train_dapo.main(args(tmp_path / "1", "--gradient_accumulation_steps", "2")) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           "train_dapo.py", *args(tmp_path / "3", "--gradient_accumulation_steps", "1",
                                                  "--learner_ranks", "2", "--dist_timeout_s", "60")],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_rows(tmp_path / "1")[-1], read_rows(tmp_path / "3")[-1]
    weights = {n: load_file(tmp_path / str(n) / "checkpoints" / "step_00000001" / "model" / "model.safetensors")
               for n in (1, 3)}
    assert one["reward_mean"] == two["reward_mean"] and one["optimizer_steps"] == two["optimizer_steps"] == "3"
    for key in ("policy_loss", "kl", "entropy", "grad_norm", "ppo_kl"):
        assert float(two[key]) == pytest.approx(float(one[key]), rel=1e-4, abs=1e-6), key
    # A fraction of ~400 tokens: a ratio within rounding of the clip bound may fall either side.
    assert float(two["pg_clipfrac"]) == pytest.approx(float(one["pg_clipfrac"]), abs=0.006)
    # Adam's first steps move each weight by about +-lr whatever the gradient's size, so a
    # gradient entry at rounding level may flip sign: allow a few such entries, no more.
    moved = [(weights[1][k] - weights[3][k]).abs() for k in weights[1]]
    assert max(float(d.max()) for d in moved) <= 6 * 2e-4
    assert sum(int((d > 1e-6).sum()) for d in moved) <= 1e-3 * sum(d.numel() for d in moved)
