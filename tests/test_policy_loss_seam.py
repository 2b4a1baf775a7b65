"""Trainer.policy_loss, the seam for the policy-gradient term alone: its default is DAPO's clipped
loss with the run's settings, and a subclass's own loss is the one a real training step uses."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import dapo_loss
import train_dapo
from config import load_config
from learner import PG_METRICS
from tests.test_dapo_loss import ragged_batch, reference_from_tensors
from tests.test_train import ROOT, make_trainer, read_metrics

# Not the defaults, so a default seam that ignored the run's settings would give other numbers.
CLIPS = ["--clip_ratio_low", "0.1", "--clip_ratio_high", "0.15", "--clip_ratio_c", "3.0"]
ONE_STEP = ["--max_steps", "1", "--save_every", "0", "--val_every", "0"]


def seam_of(trainer_class: type[train_dapo.Trainer], argv: list[str]):
    """``trainer_class``'s policy_loss bound to a stand-in holding only the run's config: the seam
    is tensors and numbers in, so it needs no model to be checked."""
    return trainer_class.policy_loss.__get__(SimpleNamespace(cfg=load_config(argv)))


@pytest.mark.parametrize("mode", dapo_loss.LOSS_AGG_MODES)
def test_the_default_seam_is_the_clipped_dapo_loss_with_the_runs_clip_ratios(demo_argv, mode):
    logp, old_logp, advantages, mask = ragged_batch()
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    normalizer = 11.0
    loss, metrics = seam_of(train_dapo.Trainer, demo_argv + CLIPS)(
        logp, old_logp, advantages, mask, loss_agg_mode=mode, normalizer=normalizer, is_weights=weights)
    # Bit for bit what the learner computed before the seam ...
    before, before_metrics = dapo_loss.policy_loss(
        logp, old_logp, advantages, mask, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=3.0,
        loss_agg_mode=mode, normalizer=normalizer, is_weights=weights)
    assert torch.equal(loss, before)
    assert metrics.keys() == before_metrics.keys() == set(PG_METRICS)
    assert all(torch.equal(metrics[key], before_metrics[key]) for key in PG_METRICS)
    # ... and the DAPO objective token by token (normalised by this call's own count there).
    own = mask.sum() if mode == "token-mean" else mask.shape[0]
    expected, clipfrac, lower, kl = reference_from_tensors(logp, old_logp, advantages, mask, mode, weights=weights,
                                                           low=0.1, high=0.15, c=3.0)
    assert_close(loss.item() * normalizer / float(own), expected)
    assert_close([metrics[key].item() for key in PG_METRICS], [clipfrac, lower, kl])


def test_a_subclass_loss_is_the_one_the_training_step_uses(demo_argv, tmp_path):
    """A loss of zero (the demo has no KL, entropy or length term, nor weight decay) leaves the
    weights as they were: the default loss, had the learner used it, would have moved them. Its
    calls get the stated arguments, and the metrics it does not report are empty."""
    calls = []

    class ZeroLoss(train_dapo.Trainer):
        def policy_loss(self, log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode, normalizer,
                        is_weights):
            calls.append(dict(shapes=[tuple(t.shape) for t in (log_prob, old_log_prob, response_mask)],
                              rows=advantages.shape, grad=log_prob.requires_grad, mask=response_mask.dtype,
                              tokens=int(response_mask.sum()), mode=loss_agg_mode, normalizer=normalizer,
                              weights=is_weights))
            return (log_prob * 0.0).sum(), {"ppo_kl": (old_log_prob - log_prob).detach()[response_mask].mean()}

    trainer = make_trainer(demo_argv + ONE_STEP, ZeroLoss)
    before = [p.detach().clone() for p in trainer.learner.policy.parameters()]
    trainer.train()
    assert all(torch.equal(p, b) for p, b in zip(trainer.learner.policy.parameters(), before, strict=True))
    # 48 rows, per_device_batch_size 8, no accumulation: six mini-batches of one micro-batch each,
    # each normalised by its own token count.
    assert len(calls) == 6 and sum(call["rows"][0] for call in calls) == 48
    for call in calls:
        rows = call["rows"][0]
        assert call["rows"] == (rows,) and call["shapes"][0][0] == rows
        assert call["shapes"][0] == call["shapes"][1] == call["shapes"][2]
        assert call["grad"] and call["mask"] == torch.bool
        assert (call["mode"], call["normalizer"], call["weights"]) == ("token-mean", call["tokens"], None)
    row = read_metrics(tmp_path / "run")[-1]
    assert float(row["policy_loss"]) == 0.0 and float(row["grad_norm"]) == 0.0
    assert row["pg_clipfrac"] == row["pg_clipfrac_lower"] == "" and math.isfinite(float(row["ppo_kl"]))


def test_a_policy_loss_reporting_an_unknown_metric_is_refused(demo_argv):
    class Misnamed(train_dapo.Trainer):
        def policy_loss(self, log_prob, old_log_prob, advantages, response_mask, **numbers):
            loss, metrics = super().policy_loss(log_prob, old_log_prob, advantages, response_mask, **numbers)
            return loss, {**metrics, "clipfrac": 0.0}

    trainer = make_trainer(demo_argv + ONE_STEP, Misnamed)
    batch, _ = trainer.collect(1)
    trainer.step = 1
    with pytest.raises(ValueError, match=r"\['clipfrac'\]; it may report pg_clipfrac, pg_clipfrac_lower, ppo_kl"):
        trainer.update_policy(batch, trainer.compute_advantages(batch))


def readme_loss_example() -> dict:
    """The namespace of README.md's policy_loss example, as a user would copy it."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n# my_reinforce.py") + len("```python\n")
    namespace = {"__name__": "my_reinforce"}
    exec(compile(text[start:text.index("```", start)], "my_reinforce.py", "exec"), namespace)
    return namespace


def test_the_readme_policy_loss_example_is_reinforce_and_trains(demo_argv, tmp_path):
    example = readme_loss_example()["ReinforceTrainer"]
    logp, old_logp, advantages, mask = ragged_batch()
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    loss, metrics = seam_of(example, demo_argv)(logp, old_logp, advantages, mask, loss_agg_mode="token-mean",
                                                normalizer=20, is_weights=weights)
    assert_close(loss, -(advantages[:, None] * logp * weights)[mask].sum() / 20)
    assert set(metrics) <= set(PG_METRICS)
    trainer = make_trainer(demo_argv + ONE_STEP, example)
    before = [p.detach().clone() for p in trainer.learner.policy.parameters()]
    trainer.train()
    assert any(not torch.equal(p, b) for p, b in zip(trainer.learner.policy.parameters(), before, strict=True))
    row = read_metrics(Path(tmp_path / "run"))[-1]
    assert math.isfinite(float(row["policy_loss"])) and row["pg_clipfrac"] == ""
