"""Rollout correction (rollout_correction.py, verl 0.9.1's rollout_is / rollout_rs): every mode on a
2x3 example worked out by hand, and against slow references that loop over rows and tokens in
plain Python; then in the learner's loss and in a demo run with an FP8 rollout."""
import math
from dataclasses import replace

import pytest
import torch

import rollout_correction as rc
import train_dapo
from config import ConfigError, load_config
from tests.test_algorithm_options import (assert_same_gradient, clipped_pg, learner_step, read_rows,  # noqa: F401
                                          reference_gradient, step_batch)

LN2, LN3 = math.log(2.0), math.log(3.0)
# The 2x3 example: log_ratio = old_logp - rollout_logp, ratios r = e^log_ratio.
#   row 0: log_ratio [ln 2, 0, -ln 2]   r [2, 1, 0.5]
#   row 1: log_ratio [ln 3, ln 3, pad]  r [3, 3]; the padding's old_logp is NaN, which must never count
# Per token, to 4 places (k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = r - 1 - log_ratio):
#   k1  row 0 [-0.6931, 0, 0.6931]   row 1 [-1.0986, -1.0986]   sums 0, -2.1972  means 0, -1.0986
#   k2  row 0 [0.2402, 0, 0.2402]    row 1 [0.6035, 0.6035]     sums 0.4805, 1.2069  means 0.1602, 0.6035
#                                                                 maxes 0.2402, 0.6035
#   k3  row 0 [0.3069, 0, 0.1931]    row 1 [0.9014, 0.9014]     sums 0.5, 1.8028  means 0.1667, 0.9014
#                                                                 maxes 0.3069, 0.9014
MASK = torch.tensor([[True, True, True], [True, True, False]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]])
OLD = ROLLOUT + torch.tensor([[LN2, 0.0, -LN2], [LN3, LN3, math.nan]])


def hand(**settings) -> rc.Correction:
    settings.setdefault("is_level", None)
    settings.setdefault("is_threshold", "2.0")
    return rc.correct(OLD, ROLLOUT, MASK, **settings)


# ----- importance weights by hand --------------------------------------------------------------

@pytest.mark.parametrize("level, threshold, normalize, weights, mean, peak, ess", [
    # token TIS at 2.5: [2, 1, 0.5], [min(3, 2.5) x 2]; sum 8.5 over 5 tokens, squares 4 + 1 + 0.25 + 6.25 + 6.25 = 17.75
    # ESS = 8.5^2 / (5 x 17.75) = 72.25 / 88.75
    ("token", "2.5", False, [[2, 1, 0.5], [2.5, 2.5, 0]], 1.7, 2.5, 72.25 / 88.75),
    # the same divided by its mean over the tokens, 1.7 (the metrics are those before the division)
    ("token", "2.5", True, [[2 / 1.7, 1 / 1.7, 0.5 / 1.7], [2.5 / 1.7, 2.5 / 1.7, 0]], 1.7, 2.5, 72.25 / 88.75),
    # token IcePop [0.6, 2.5]: 0.5 and both 3s fall outside and weigh 0; sum 3, squares 5: ESS 9 / 25
    ("token", "0.6_2.5", False, [[2, 1, 0], [0, 0, 0]], 0.6, 2.0, 9 / 25),
    # sequence TIS at 5: row weights e^0 = 1 and e^(2 ln 3) = 9 -> 5; max is the row weight before
    # truncation, 9 (as verl); sum 3 + 10 = 13, squares 3 + 50: ESS 169 / 265
    ("sequence", "5", False, [[1, 1, 1], [5, 5, 0]], 2.6, 9.0, 169 / 265),
    # normalised by the mean over the rows of the row weights, (1 + 5) / 2 = 3
    ("sequence", "5", True, [[1 / 3, 1 / 3, 1 / 3], [5 / 3, 5 / 3, 0]], 2.6, 9.0, 169 / 265),
    # sequence IcePop [0.5, 2]: row 1's 9 falls outside: sum 3, squares 3: ESS 9 / 15
    ("sequence", "0.5_2", False, [[1, 1, 1], [0, 0, 0]], 0.6, 9.0, 9 / 15),
])
def test_importance_weights_by_hand(level, threshold, normalize, weights, mean, peak, ess):
    out = hand(is_level=level, is_threshold=threshold, is_batch_normalize=normalize)
    assert torch.allclose(out.weights, torch.tensor(weights, dtype=torch.float32), atol=1e-6)
    assert out.metrics["rollout_is_mean"] == pytest.approx(mean, rel=1e-6)
    assert out.metrics["rollout_is_max"] == pytest.approx(peak, rel=1e-6)
    assert out.metrics["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)
    assert torch.equal(out.loss_mask, MASK) and out.metrics["rollout_rs_masked_fraction"] is None


def test_every_weight_outside_the_icepop_band_reports_zero_and_goes_on():
    # Ratios 2, 1, 0.5, 3, 3 against [1.2, 1.5]: every weight is 0. verl 0.9.1's ESS divides by
    # zero here; ours is 0 (no effective sample), and normalising leaves the zeros alone.
    for normalize in (False, True):
        out = hand(is_level="token", is_threshold="1.2_1.5", is_batch_normalize=normalize)
        assert torch.equal(out.weights, torch.zeros(2, 3))
        assert [out.metrics[k] for k in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size")] == [0, 0, 0]


def test_tis_cap_is_token_truncation_and_not_both():
    assert load_config(["--tis_cap", "2.0"]).algo.importance_sampling() == ("token", "2.0")
    assert load_config(["--rollout_is", "sequence", "--rollout_is_threshold", "0.5_2"]).algo.importance_sampling() == (
        "sequence", "0.5_2")
    with pytest.raises(ConfigError, match="tis_cap 2 is the old name of rollout_is token with rollout_is_threshold 2"):
        load_config(["--tis_cap", "2", "--rollout_is", "token"])


# ----- rejection by hand -----------------------------------------------------------------------

@pytest.mark.parametrize("modes, threshold, keep", [
    # k1 bands are on -log_ratio: [ln 0.6, ln 2.5] = [-0.5108, 0.9163] rejects row 0's -0.6931 and row 1
    ("token_k1", "0.6_2.5", [[0, 1, 1], [0, 0, 0]]),
    # one number U is the band [1/U, U]: [ln 0.4, ln 2.5] = [-0.9163, 0.9163] keeps row 0, not row 1's -1.0986
    ("token_k1", "2.5", [[1, 1, 1], [0, 0, 0]]),
    ("token_k2", "0.2", [[0, 1, 0], [0, 0, 0]]),  # 0.2402 > 0.2 and 0.6035 > 0.2
    ("token_k3", "0.25", [[0, 1, 1], [0, 0, 0]]),  # k3 is not symmetric: 0.3069 out, 0.1931 in
    ("seq_sum_k1", "0.12_2.5", [[1, 1, 1], [0, 0, 0]]),  # [ln 0.12, ln 2.5] = [-2.1203, 0.9163]: row 1's sum -2.1972 out
    ("seq_mean_k1", "0.12_2.5", [[1, 1, 1], [1, 1, 0]]),  # ... but its mean -1.0986 in
    ("seq_sum_k2", "1.0", [[1, 1, 1], [0, 0, 0]]),  # sums 0.4805 and 1.2069
    ("seq_mean_k2", "0.3", [[1, 1, 1], [0, 0, 0]]),  # means 0.1602 and 0.6035 (row 0's sum, 0.4805, would fail)
    ("seq_sum_k3", "0.6", [[1, 1, 1], [0, 0, 0]]),  # sums 0.5 and 1.8028
    ("seq_mean_k3", "0.2", [[1, 1, 1], [0, 0, 0]]),  # means 0.1667 and 0.9014 (row 0's sum, 0.5, would fail)
    ("seq_max_k2", "0.2", [[0, 0, 0], [0, 0, 0]]),  # maxes 0.2402 and 0.6035 (row 0's mean, 0.1602, would pass)
    ("seq_max_k3", "0.95", [[1, 1, 1], [1, 1, 0]]),  # maxes 0.3069 and 0.9014 (row 1's sum, 1.8028, would fail)
    # every check must pass: token_k1 keeps [[0, 1, 1], [0, 0, 0]], seq_mean_k1 [ln 0.4, ln 2.5] keeps row 0 only
    ("token_k1, seq_mean_k1", "0.6_2.5, 0.4_2.5", [[0, 1, 1], [0, 0, 0]]),
])
def test_rejection_by_hand(modes, threshold, keep):
    out = hand(rs_modes=modes, rs_threshold=threshold)
    keep = torch.tensor(keep, dtype=torch.bool)
    assert torch.equal(out.loss_mask, keep)
    rejected = MASK & ~keep
    assert out.metrics["rollout_rs_masked_fraction"] == pytest.approx(int(rejected.sum()) / 5)
    assert out.metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(int(rejected.any(-1).sum()) / 2)
    assert out.weights is None and out.metrics["rollout_is_mean"] is None


@pytest.mark.parametrize("argv, message", [
    (["--rollout_rs", "token_k4"], "rollout_rs: token_k4 mode is unknown; comma-separated among token_k1"),
    (["--rollout_rs", "seq_max_k1", "--rollout_rs_threshold", "2"], "seq_max_k1 mode is unknown"),
    (["--rollout_rs", "token_k2"], "rollout_rs needs rollout_rs_threshold"),
    (["--rollout_rs", "token_k2", "--rollout_rs_threshold", "0.5_2"], "token_k2 takes one upper bound"),
    (["--rollout_rs", "token_k2,seq_max_k3", "--rollout_rs_threshold", "1,2,3"], "3 thresholds for 2 rollout_rs modes"),
    # one bound U below 1: k1's band [1/U, U] would be empty and reject every token
    (["--rollout_rs", "token_k1", "--rollout_rs_threshold", "0.5"], "token_k1 with one bound U keeps ratios in"),
    (["--rollout_rs", "token_k2,seq_sum_k1", "--rollout_rs_threshold", "2,0.9"], "seq_sum_k1 with one bound U"),
    (["--rollout_is", "tokens"], "config key 'rollout_is' expects one of 'token', 'sequence', got 'tokens'"),
    (["--rollout_is", "token", "--rollout_is_threshold", "2_1"], "rollout_is_threshold '2_1': the lower bound is above"),
    (["--rollout_is_threshold", "-1"], "rollout_is_threshold '-1': bounds must be > 0"),
])
def test_bad_settings_are_one_line_user_errors(argv, message, demo_argv, capsys):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(argv)
    assert "\n" not in str(caught.value)
    assert train_dapo.main(demo_argv + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.split(":")[0] in err[0]


# ----- against slow references -----------------------------------------------------------------

def reference_weights(log_ratio, mask, level, threshold, normalize):
    """Row by row, token by token, in Python floats; also (mean, max, ESS) before normalising."""
    upper, lower = (float(x) for x in reversed(threshold.split("_"))) if "_" in threshold else (float(threshold), None)
    rows = [[float(v) for v, m in zip(row, row_mask) if m] for row, row_mask in zip(log_ratio.tolist(), mask.tolist())]
    weights, peaks = [], []
    for row in rows:
        logs = row if level == "token" else [sum(row)] * len(row)
        raw = [math.exp(min(max(x, -20.0), 20.0)) for x in logs]
        kept = [min(w, upper) if lower is None else (w if lower <= w <= upper else 0.0) for w in raw]
        weights.append(kept)
        peaks.append(max(kept) if level == "token" else math.exp(min(logs[0], 20.0)))
    flat = [w for row in weights for w in row]
    mean = sum(flat) / len(flat)
    ess = sum(flat) ** 2 / (len(flat) * sum(w * w for w in flat))
    scale = 1.0
    if normalize:
        scale = mean if level == "token" else sum(row[0] for row in weights) / len(weights)
    full = torch.zeros(log_ratio.shape, dtype=torch.float64)
    for i, row in enumerate(weights):
        full[i, :len(row)] = torch.tensor(row, dtype=torch.float64) / scale
    return full, (mean, max(peaks), ess)


def reference_keep(log_ratio, mask, modes, thresholds):
    """Which tokens pass every mode, from the definitions written out per token."""
    specs = thresholds.split(",")
    specs = specs * len(modes) if len(specs) == 1 else specs
    keep = mask.clone()
    for i, (row, row_mask) in enumerate(zip(log_ratio.tolist(), mask.tolist())):
        safe = [min(max(x, -20.0), 20.0) for x, m in zip(row, row_mask) if m]
        estimate = {"k1": [-x for x in safe], "k2": [x * x / 2 for x in safe], "k3": [math.exp(x) - 1 - x for x in safe]}
        for mode, spec in zip(modes, specs):
            scope, k = mode.rsplit("_", 1)
            values = estimate[k]
            if k == "k1":
                lower, upper = ((float(x) for x in spec.split("_")) if "_" in spec
                                else (1 / float(spec), float(spec)))
                passes = lambda v: math.log(lower) <= v <= math.log(upper)  # noqa: E731
            else:
                passes = lambda v: v <= float(spec)  # noqa: E731
            if scope == "token":
                for t, v in enumerate(values):
                    keep[i, t] &= passes(v)
            else:
                stat = {"seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}[scope](values)
                keep[i] &= passes(stat)
    return keep


@pytest.fixture(scope="module")
def random_rows():
    """40 rows of 1 to 30 tokens, the log-ratio's spread varying by row, one token far off."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 31, (40,), generator=g)
    mask = torch.arange(30)[None] < lengths[:, None]
    rollout = -3 * torch.rand(40, 30, generator=g)
    old = rollout + 0.3 * torch.rand(40, 1, generator=g) * torch.randn(40, 30, generator=g)
    old[5, 0] += 30.0  # past the safety bound
    return torch.where(mask, old, math.nan), rollout, mask


@pytest.mark.parametrize("level, threshold", [("token", "2.0"), ("token", "0.8_1.25"), ("sequence", "3"),
                                              ("sequence", "0.5_2.0")])
@pytest.mark.parametrize("normalize", [False, True])
def test_importance_weights_match_the_reference(random_rows, level, threshold, normalize):
    old, rollout, mask = random_rows
    out = rc.correct(old, rollout, mask, is_level=level, is_threshold=threshold, is_batch_normalize=normalize)
    expected, (mean, peak, ess) = reference_weights((old - rollout).double(), mask, level, threshold, normalize)
    assert torch.allclose(out.weights.double(), expected, rtol=1e-5, atol=1e-6)
    assert 0 < ess < 1
    for key, value in zip(("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size"), (mean, peak, ess)):
        assert out.metrics[key] == pytest.approx(value, rel=1e-5)


@pytest.mark.parametrize("modes, thresholds", [
    ("token_k1", "0.9_1.1"), ("token_k2", "0.02"), ("token_k3", "0.02"), ("seq_sum_k1", "0.5_2"),
    ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"), ("seq_mean_k1", "1.02"), ("seq_mean_k2", "0.01"),
    ("seq_mean_k3", "0.01"), ("seq_max_k2", "0.1"), ("seq_max_k3", "0.1"),
    ("token_k1,seq_max_k2,seq_mean_k3", "0.8_1.25,0.1,0.01"), ("token_k2,seq_sum_k3", "0.1"),
])
def test_rejection_matches_the_reference(random_rows, modes, thresholds):
    old, rollout, mask = random_rows
    out = rc.correct(old, rollout, mask, is_level=None, is_threshold="2", rs_modes=modes, rs_threshold=thresholds)
    keep = reference_keep((old - rollout).double(), mask, [m.strip() for m in modes.split(",")], thresholds)
    assert torch.equal(out.loss_mask, keep)
    rejected = mask & ~keep
    assert 0 < out.metrics["rollout_rs_masked_fraction"] < 1  # each case rejects some and keeps some
    assert out.metrics["rollout_rs_masked_fraction"] == pytest.approx(int(rejected.sum()) / int(mask.sum()))
    assert out.metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(float(rejected.any(-1).float().mean()))


# ----- in the learner, and in a run ------------------------------------------------------------

def test_rejected_tokens_leave_the_loss_and_its_token_count(learner_step, step_batch):
    # Rollout log-probs off by -1, 0 or +1 per row: log-ratios ~1, 0, -1. token_k1 with the band
    # [0.5, 2] keeps only the middle rows' tokens; their weights are 1 (the TIS cap of 2 is idle).
    offsets = torch.tensor([-1.0, 0.0, 1.0]).repeat(16)[:, None]
    skewed = replace(step_batch, rollout_logp=step_batch.rollout_logp + offsets * step_batch.response_mask)
    trainer, grads, row = learner_step("--rollout_is", "token", "--rollout_rs", "token_k1",
                                       "--rollout_rs_threshold", "2", batch=skewed)
    advantages = trainer.compute_advantages(skewed)
    kept_rows = (offsets == 0)

    def loss(logp, ent, mask, old):
        weights = torch.exp(old - skewed.rollout_logp[:, :mask.shape[1]]).clamp(max=2.0)
        kept = mask & kept_rows
        return clipped_pg(logp, old, advantages, kept.float(), kept.sum(), is_weights=weights)
    assert_same_gradient(grads, reference_gradient(trainer, skewed, loss))
    mask = skewed.response_mask
    assert row["rollout_rs_masked_fraction"] == pytest.approx(float((mask & ~kept_rows).sum() / mask.sum()))
    assert row["rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)


def test_an_fp8_rollout_run_reports_the_correction(demo_argv, tmp_path, capsys):
    argv = demo_argv + ["--max_steps", "2", "--val_every", "0", "--save_every", "0", "--rollout_dtype", "fp8",
                        "--rollout_is", "token", "--rollout_is_threshold", "2.0",
                        "--rollout_rs", "token_k3", "--rollout_rs_threshold", "0.001"]
    assert train_dapo.main(argv) == 0
    rows = read_rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert float(row["mismatch_mean"]) > 0  # FP8 weights: the learner disagrees with the rollout
        assert 0.5 < float(row["rollout_is_mean"]) < 1.5
        assert 1.0 < float(row["rollout_is_max"]) <= 2.0  # some weight above 1, none past the cap
        assert 0.5 < float(row["rollout_is_eff_sample_size"]) <= 1.0
        assert 0 < float(row["rollout_rs_masked_fraction"]) < 1
        assert 0 < float(row["rollout_rs_seq_masked_fraction"]) <= 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(" ess " in line and " rejected " in line for line in lines)
