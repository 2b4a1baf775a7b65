"""Tests for dapo_loss: every loss against slow per-token Python code or hand-worked values."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dapo_loss import (
    LOGITS_CHUNK_BYTES,
    LOSS_AGG_MODES,
    aggregate,
    entropy_from_logits,
    group_advantages,
    group_length_ratio,
    informative_groups,
    kl_penalty,
    length_penalty,
    overlong_penalty,
    policy_loss,
    token_logprobs,
)

LOW, HIGH, DUAL = 0.2, 0.28, 10.0


# --- reference implementations ----------------------------------------------------------------


def reference_policy_loss(logp, old_logp, adv, mask, mode, *, low=LOW, high=HIGH, c=DUAL,
                          weights=None):
    """The DAPO objective token by token in Python floats; returns (loss, clipfrac, lower, kl)."""
    num_seqs, num_pos = len(logp), len(logp[0])
    seq_sums, seq_lens = [0.0] * num_seqs, [0] * num_seqs
    clipped = lower = kl = 0.0
    for i in range(num_seqs):
        for t in range(num_pos):
            if not mask[i][t]:
                continue
            a = adv[i][t]
            r = math.exp(min(max(logp[i][t] - old_logp[i][t], -20.0), 20.0))
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            loss = max(l1, l2)
            if a < 0 and -a * c < loss:
                loss = -a * c
                lower += 1
            clipped += l2 > l1
            kl += old_logp[i][t] - logp[i][t]
            seq_sums[i] += loss * (weights[i][t] if weights else 1.0)
            seq_lens[i] += 1
    tokens = sum(seq_lens)
    if mode == "token-mean":
        value = sum(seq_sums) / tokens
    elif mode == "seq-mean-token-sum":
        value = sum(seq_sums) / num_seqs
    else:
        value = sum(s / n for s, n in zip(seq_sums, seq_lens) if n) / num_seqs
    return value, clipped / tokens, lower / tokens, kl / tokens


def reference_from_tensors(logp, old_logp, adv, mask, mode, **kwargs):
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    weights = kwargs.pop("weights", None)
    return reference_policy_loss(logp.tolist(), old_logp.tolist(), adv.tolist(), mask.tolist(), mode,
                                 weights=None if weights is None else weights.tolist(), **kwargs)


# Log-ratios that put a token in every clip region for both signs of A (low 0.2, high 0.28):
# r = 0.5 below 1-low, 0.9 and 1.2 inside, 1.5 above 1+high, 30 past the dual clip (c = 10),
# and +-25, beyond the +-20 clamp of the log-ratio.
REGION_LOG_RATIOS = [math.log(0.5), math.log(0.9), 0.0, math.log(1.2), math.log(1.5),
                     math.log(30.0), 25.0, -25.0]


def region_batch(dtype=torch.float64):
    """Five sequences of eight tokens, A in {1, -1, 0, 2.5, -0.7}, ragged lengths."""
    gen = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(5, 8, generator=gen, dtype=dtype) * 3
    logp = old_logp + torch.tensor(REGION_LOG_RATIOS, dtype=dtype)
    advantages = torch.tensor([1.0, -1.0, 0.0, 2.5, -0.7], dtype=dtype)
    lengths = torch.tensor([8, 8, 6, 8, 3])
    mask = torch.arange(8) < lengths[:, None]
    return logp, old_logp, advantages, mask


def ragged_batch(num_seqs=8, num_pos=7, seed=1):
    """Random batch whose ratios straddle both clip bounds; lengths 1..num_pos."""
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(num_seqs, num_pos, generator=gen, dtype=torch.float64) * 4
    logp = old_logp + torch.randn(num_seqs, num_pos, generator=gen, dtype=torch.float64) * 0.4
    advantages = torch.randn(num_seqs, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, num_pos + 1, (num_seqs,), generator=gen)
    mask = torch.arange(num_pos) < lengths[:, None]
    return logp, old_logp, advantages, mask


# --- policy loss ------------------------------------------------------------------------------


def test_policy_loss_hand_worked_values():
    # One sequence, per-token A (the [N, T] form), low 0.2, high 0.28, c 10:
    #   A= 1, r=1.5 : l1=-1.5, l2=-1.28          -> -1.28  (clip-higher active)
    #   A= 1, r=0.5 : l1=-0.5, l2=-0.8           -> -0.5   (no clip for A>0 below 1-low)
    #   A=-1, r=0.5 : l1= 0.5, l2= 0.8           ->  0.8   (clipped at 1-low)
    #   A=-1, r=20  : l1=20,   l2= 1.28 -> 20, dual clip min(20, 10) -> 10
    #   A= 0, r=3   :                            ->  0
    #   A= 2, r=1   :                            -> -2
    # token-mean = (-1.28 - 0.5 + 0.8 + 10 + 0 - 2) / 6 = 7.02 / 6 = 1.17
    ratios = [1.5, 0.5, 0.5, 20.0, 3.0, 1.0]
    old_logp = torch.full((1, 6), -2.0, dtype=torch.float64)
    logp = old_logp + torch.tensor([ratios], dtype=torch.float64).log()
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.bool)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask)
    assert_close(loss, torch.tensor(1.17, dtype=torch.float64))
    assert_close(metrics["pg_clipfrac"], torch.tensor(2 / 6, dtype=torch.float64))  # tokens 1, 3
    assert_close(metrics["pg_clipfrac_lower"], torch.tensor(1 / 6, dtype=torch.float64))  # token 4
    assert_close(metrics["ppo_kl"], torch.tensor(-sum(map(math.log, ratios)) / 6, dtype=torch.float64))
    # seq-mean-token-sum of one sequence is the plain sum 7.02.
    loss_sum, _ = policy_loss(logp, old_logp, advantages, mask, loss_agg_mode="seq-mean-token-sum")
    assert_close(loss_sum, torch.tensor(7.02, dtype=torch.float64))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_python_loop_in_every_clip_region(mode):
    logp, old_logp, advantages, mask = region_batch()
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, loss_agg_mode=mode)
    expected, clipfrac, lower, kl = reference_from_tensors(logp, old_logp, advantages, mask, mode)
    assert_close(loss.item(), expected)
    assert_close(metrics["pg_clipfrac"].item(), clipfrac)
    assert_close(metrics["pg_clipfrac_lower"].item(), lower)
    assert_close(metrics["ppo_kl"].item(), kl)
    assert 0 < lower < clipfrac  # the batch really exercises both clips


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_python_loop_on_random_batch_with_is_weights(mode):
    logp, old_logp, advantages, mask = ragged_batch()
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    loss, _ = policy_loss(logp, old_logp, advantages, mask, loss_agg_mode=mode, is_weights=weights,
                          clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=3.0)
    expected, *_ = reference_from_tensors(logp, old_logp, advantages, mask, mode, weights=weights,
                                          low=0.1, high=0.15, c=3.0)
    assert_close(loss.item(), expected)


def test_is_weights_are_not_differentiated():
    logp, old_logp, advantages, mask = ragged_batch()
    logp.requires_grad_()
    weights = torch.rand(logp.shape, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old_logp, advantages, mask, is_weights=weights)
    loss.backward()
    assert weights.grad is None
    assert logp.grad.abs().sum() > 0


def test_sequence_advantages_broadcast_like_token_advantages():
    logp, old_logp, advantages, mask = ragged_batch()
    per_seq, _ = policy_loss(logp, old_logp, advantages, mask)
    per_token, _ = policy_loss(logp, old_logp, advantages[:, None].expand_as(logp), mask)
    assert_close(per_seq, per_token)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_contribute_no_loss_and_no_gradient(mode):
    logp, old_logp, advantages, mask = ragged_batch()
    token_advantages = advantages[:, None].expand_as(logp).clone()
    clean, _ = policy_loss(logp, old_logp, token_advantages, mask, loss_agg_mode=mode)

    garbage = torch.where(torch.rand(logp.shape) < 0.5, 1e30, -1e30).double()
    noisy_logp = torch.where(mask, logp, garbage).requires_grad_()
    noisy_old = torch.where(mask, old_logp, -garbage)
    noisy_adv = torch.where(mask, token_advantages, garbage)
    loss, metrics = policy_loss(noisy_logp, noisy_old, noisy_adv, mask, loss_agg_mode=mode)
    loss.backward()

    assert_close(loss, clean)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.equal(noisy_logp.grad[~mask], torch.zeros_like(noisy_logp.grad[~mask]))
    assert noisy_logp.grad[mask].abs().sum() > 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_micro_batches_with_global_normalizer_reproduce_the_whole_batch(mode, num_micro_batches):
    logp, old_logp, advantages, mask = ragged_batch()
    whole_logp = logp.clone().requires_grad_()
    whole, _ = policy_loss(whole_logp, old_logp, advantages, mask, loss_agg_mode=mode)
    whole.backward()

    normalizer = mask.sum().item() if mode == "token-mean" else mask.shape[0]
    split_logp = logp.clone().requires_grad_()
    total = 0.0
    for rows in torch.arange(mask.shape[0]).chunk(num_micro_batches):
        part, _ = policy_loss(split_logp[rows], old_logp[rows], advantages[rows], mask[rows],
                              loss_agg_mode=mode, normalizer=normalizer)
        part.backward()  # gradients accumulate in split_logp.grad as in gradient accumulation
        total = total + part.detach()
    assert_close(total, whole.detach())
    assert_close(split_logp.grad, whole_logp.grad)


def test_micro_batches_with_their_own_token_counts_do_not_add_up():
    # Why the global normalizer exists: ragged micro-batches each divided by their own token
    # count weight tokens unequally, so even their average differs from the whole-batch mean.
    logp, old_logp, advantages, mask = ragged_batch()
    whole, _ = policy_loss(logp, old_logp, advantages, mask)
    halves = [policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows])[0]
              for rows in torch.arange(mask.shape[0]).chunk(2)]
    assert not torch.allclose(sum(halves) / 2, whole)


def test_equal_clip_ratios_reproduce_symmetric_ppo():
    gen = torch.Generator().manual_seed(3)
    old_logp = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    logp = old_logp + (torch.rand(6, 9, generator=gen, dtype=torch.float64) * 2 - 1)  # r in [1/e, e]
    advantages = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.ones(6, 9, dtype=torch.bool)
    eps = 0.2
    loss, _ = policy_loss(logp, old_logp, advantages, mask, clip_ratio_low=eps, clip_ratio_high=eps)
    ratio = torch.exp(logp - old_logp)
    textbook = -torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages).mean()
    assert_close(loss, textbook)


def test_extreme_log_ratios_stay_finite():
    # r is clamped to exp(+-20): A=1,  r=e^20  -> -1.28;  A=1,  r=e^-20 -> -e^-20;
    #                             A=-1, r=e^20  -> 10 (dual clip); A=-1, r=e^-20 -> 0.8.
    old_logp = torch.zeros(2, 2)
    logp = torch.tensor([[1000.0, -1000.0], [1000.0, -1000.0]], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0])
    loss, metrics = policy_loss(logp, old_logp, advantages, torch.ones(2, 2))
    loss.backward()
    assert_close(loss, torch.tensor((-1.28 - math.exp(-20) + 10 + 0.8) / 4))
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_gradcheck(mode):
    # Log-ratios stay inside (log 0.8, log 1.28) or far outside it, never near a clip kink.
    gen = torch.Generator().manual_seed(4)
    old_logp = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2
    log_ratio = torch.rand(3, 5, generator=gen, dtype=torch.float64) * 0.3 - 0.15
    log_ratio[0, 0], log_ratio[1, 1], log_ratio[2, 2] = 0.6, -0.7, 3.0
    advantages = torch.tensor([0.8, -1.3, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.5
    logp = (old_logp + log_ratio).requires_grad_()

    def loss_of(x):
        return policy_loss(x, old_logp, advantages, mask, loss_agg_mode=mode, is_weights=weights)[0]

    assert torch.autograd.gradcheck(loss_of, (logp,))


def test_policy_loss_rejects_bad_settings():
    logp, old_logp, advantages, mask = ragged_batch()
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(logp, old_logp, advantages, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="valid modes: token-mean, seq-mean-token-mean"):
        policy_loss(logp, old_logp, advantages, mask, loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match="clip_ratio_low must be in"):
        policy_loss(logp, old_logp, advantages, mask, clip_ratio_low=1.1)


# --- aggregation ------------------------------------------------------------------------------


def test_aggregate_hand_worked_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last sequence is empty
    assert_close(aggregate(values, mask, "token-mean"), torch.tensor(7 / 3))  # (1+2+4)/3
    assert_close(aggregate(values, mask, "token-mean", normalizer=10), torch.tensor(0.7))
    assert_close(aggregate(values, mask, "seq-mean-token-mean"), torch.tensor(5.5 / 3))  # (1.5+4+0)/3
    assert_close(aggregate(values, mask, "seq-mean-token-sum"), torch.tensor(7 / 3))  # (3+4+0)/3
    assert_close(aggregate(values, mask, "seq-mean-token-sum", normalizer=2), torch.tensor(3.5))


def test_aggregate_without_valid_tokens_is_zero_not_nan():
    values = torch.full((2, 3), float("nan"), requires_grad=True)
    mask = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        result = aggregate(values, mask, mode)
        result.backward()
        assert result.item() == 0.0
        assert torch.equal(values.grad, torch.zeros(2, 3))


# --- advantages and dynamic sampling ----------------------------------------------------------


# float64 and a relative tolerance of 1e-12 in the advantage tests: at float32 tolerance (1.3e-6)
# a division by 1 + 1e-6 cannot be told from a division by 1, so the default eps would go unchecked.
EXACT = {"rtol": 1e-12, "atol": 0.0}


def test_group_advantages_hand_worked():
    # Group 1 [1,-1,-1,-1]: mean -0.5, unbiased var (1.5^2 + 3 * 0.5^2) / 3 = 1, std 1.
    # Group 2 [1,1,-1,-1]: mean 0, var 4/3, std 2/sqrt(3): A = +-1 / (2/sqrt(3) + 1e-6) ~ +-0.866.
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    std2 = 2 / math.sqrt(3)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64) / (1 + 1e-6)
    expected = torch.cat([expected, torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64) / (std2 + 1e-6)])
    assert_close(group_advantages(rewards, 4), expected, **EXACT)


def test_group_advantages_eps_is_added_to_the_std():
    # Rewards [0, d] with d = sqrt(2) * 1e-6: mean d/2, unbiased std d/sqrt(2) = 1e-6 = eps, so
    # A = +-(d/2) / (1e-6 + 1e-6) = +-1/(2 sqrt(2)), half of the +-1/sqrt(2) that std alone gives;
    # eps under the square root, 1e-6 / sqrt(1e-12 + 1e-6) ~ 1e-3, would be another number again.
    rewards = torch.tensor([0.0, math.sqrt(2) * 1e-6], dtype=torch.float64)
    half = 1 / (2 * math.sqrt(2))
    assert_close(group_advantages(rewards, 2), torch.tensor([-half, half], dtype=torch.float64), **EXACT)
    assert_close(group_advantages(rewards, 2, eps=0.0), torch.tensor([-2 * half, 2 * half], dtype=torch.float64),
                 **EXACT)


def test_group_advantages_constant_group_is_zero_and_groups_stay_separate():
    # Constant groups have std 0 (or rounding noise, when the mean of 0.7s is not exactly 0.7):
    # eps keeps them at 0 (or ~1e-10) where centered / std alone would give NaN or inf.
    rewards = torch.tensor([0.75, 0.75, 0.75, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 3)
    assert torch.equal(advantages[:3], torch.zeros(3, dtype=torch.float64))
    assert advantages[3:6].abs().max() < 1e-9
    # Group 3 [1, 0, 1]: mean 2/3, unbiased std 1/sqrt(3).
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3], dtype=torch.float64) / (1 / math.sqrt(3) + 1e-6)
    assert_close(advantages[6:], expected, **EXACT)


def test_group_advantages_singleton_group_is_raw_reward_over_one_plus_eps():
    rewards = torch.tensor([1.0, -1.0, 0.25], dtype=torch.float64)
    assert_close(group_advantages(rewards, 1), rewards / (1 + 1e-6), **EXACT)
    assert_close(group_advantages(rewards, 1, eps=0.25), rewards / 1.25, **EXACT)
    assert torch.equal(group_advantages(rewards, 1, norm_by_std=False), rewards)


def test_group_advantages_without_std_normalisation():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1], dtype=torch.int64)  # integer rewards are accepted
    assert_close(group_advantages(rewards, 3, norm_by_std=False),
                 torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))
    assert_close(group_advantages(rewards.double(), 3, norm_by_std=False, eps=0.5),
                 torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3], dtype=torch.float64), **EXACT)


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)


def test_informative_groups():
    metric = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.4])
    assert informative_groups(metric, 3).tolist() == [False, True, False, True]
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0]), 1).tolist() == [True, True, True]
    assert informative_groups(torch.tensor([True, True, True, False]), 2).tolist() == [False, True]


# --- KL, overlong and length penalties --------------------------------------------------------


def test_kl_estimators_hand_worked():
    logp = torch.tensor([[-1.0, -2.0]])
    ref_logp = torch.tensor([[-2.0, -1.0]])
    # d = ref - logp = [-1, 1]: k3 = exp(d) - d - 1 = [e^-1, e - 2]
    assert_close(kl_penalty(logp, ref_logp, "k1"), torch.tensor([[1.0, -1.0]]))
    assert_close(kl_penalty(logp, ref_logp, "k2"), torch.tensor([[0.5, 0.5]]))
    assert_close(kl_penalty(logp, ref_logp, "k3"), torch.tensor([[math.exp(-1), math.e - 2]]))
    assert_close(kl_penalty(logp, ref_logp, "abs"), torch.tensor([[1.0, 1.0]]))
    # k3 clamps: d = 30 -> clamp to 20 -> exp(20) - 21 -> clamp to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0


def test_kl_k3_is_non_negative_and_aliases_agree():
    gen = torch.Generator().manual_seed(5)
    logp = -torch.rand(16, 32, generator=gen) * 10
    ref_logp = -torch.rand(16, 32, generator=gen) * 10
    assert (kl_penalty(logp, ref_logp, "k3") >= 0).all()
    for name, alias in [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")]:
        assert torch.equal(kl_penalty(logp, ref_logp, name), kl_penalty(logp, ref_logp, alias))
    with pytest.raises(ValueError, match="valid kinds: k1, kl, k2, mse, k3, low_var_kl, abs"):
        kl_penalty(logp, ref_logp, "k4")


def test_overlong_penalty_boundaries():
    # L_max 20, L_buf 4, f 1: free up to 16, then linear to -1 at 20.
    lengths = torch.tensor([0, 10, 16, 17, 18, 20])
    penalty = overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=1.0)
    assert penalty.dtype == torch.float32
    assert_close(penalty, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0]))
    scaled = overlong_penalty(lengths, max_response_length=20, buffer_len=4, penalty_factor=0.5)
    assert_close(scaled, penalty * 0.5)
    disabled = overlong_penalty(lengths, max_response_length=20, buffer_len=0, penalty_factor=1.0)
    assert torch.equal(disabled, torch.zeros(6))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_response_length=20, buffer_len=21, penalty_factor=1.0)


def test_group_length_ratio_hand_worked():
    # Group 1 lengths [1, 3]: mean 2, rho [0.5, 1.5]. Group 2 [4, 4]: rho [1, 1]. Group 3 [0, 0]: 0, not NaN.
    rho = group_length_ratio(torch.tensor([1, 3, 4, 4, 0, 0]), group_size=2)
    assert rho.dtype == torch.float32
    assert torch.equal(rho, torch.tensor([0.5, 1.5, 1.0, 1.0, 0.0, 0.0]))
    assert torch.equal(group_length_ratio(torch.tensor([2, 6]), group_size=1), torch.ones(2))  # its own mean
    with pytest.raises(ValueError, match="group_size"):
        group_length_ratio(torch.tensor([1, 2, 3]), group_size=2)


def test_length_penalty_value_and_gradient_hand_worked():
    # One group, lengths 1 and 3: rho [0.5, 1.5]. Summed log-probs -1 and -2-4-6 = -12; 4 tokens.
    # value = coef * ((0.5 - 1) * -1 + (1.5 - 1) * -12) / 4 = coef * (0.5 - 6) / 4 = -1.375 coef.
    # The 99s sit at masked positions and must not count.
    logp = torch.tensor([[-1.0, 99.0, 99.0], [-2.0, -4.0, -6.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    rho = group_length_ratio(mask.sum(-1), group_size=2)
    value = length_penalty(logp, mask, rho, coef=0.1)
    assert_close(value, torch.tensor(-0.1375, dtype=torch.float64), rtol=1e-12, atol=0)
    value.backward()
    # d value / d logp[i, t] = coef * (rho_i - 1) / N on valid tokens, 0 on padding.
    expected = torch.tensor([[-0.5, 0, 0], [0.5, 0.5, 0.5]], dtype=torch.float64) * 0.1 / 4
    assert_close(logp.grad, expected, rtol=1e-12, atol=0)


def test_length_penalty_pushes_long_responses_down_and_short_ones_up():
    # A gradient step on the penalty (minimising it) moves each response's summed log-probability
    # against (rho - 1): the longer-than-average response loses, the shorter one gains, and a
    # group of equal lengths is left alone.
    lengths = torch.tensor([2, 6, 4, 4])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    logp = torch.full((4, 6), -1.0, requires_grad=True)
    length_penalty(logp, mask, group_length_ratio(lengths, group_size=2), coef=1.0).backward()
    push = -(logp.grad * mask).sum(-1)  # the change of each summed log-prob under gradient descent
    assert push[0] > 0 > push[1]
    assert torch.equal(push[2:], torch.zeros(2))


def test_length_penalty_with_empty_rows_is_finite():
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    value = length_penalty(logp, torch.zeros(2, 3), torch.tensor([0.5, 1.5]), coef=1.0)
    value.backward()
    assert value.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, 3))


# --- log-probs and entropy from logits --------------------------------------------------------


def reference_logprobs_and_entropy(logits, tokens, temperature):
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, tokens[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [4 * 11 * 4, 2**20])  # 4 rows per block (ragged) / one block
def test_logprobs_and_entropy_match_log_softmax(dtype, chunk_bytes):
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).to(dtype)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)
    temperature = 0.7

    leaf = logits.clone().requires_grad_()
    logp = token_logprobs(leaf, tokens, temperature, chunk_bytes=chunk_bytes)
    entropy = entropy_from_logits(leaf, temperature, chunk_bytes=chunk_bytes)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference_logprobs_and_entropy(leaf, tokens, temperature)

    # Same upcast inputs on both sides: float32-level agreement even for bf16 logits; the
    # gradients are rounded to the logits' dtype on both sides.
    assert_close(logp, ref_logp)
    assert_close(entropy, ref_entropy)
    for ours, ref in [(logp, ref_logp), (entropy, ref_entropy)]:
        (grad,) = torch.autograd.grad((ours * upstream).sum(), leaf)
        (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), leaf, retain_graph=True)
        assert grad.dtype == dtype
        assert_close(grad, ref_grad)


def test_logprobs_and_entropy_gradcheck():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3), generator=gen)
    two_rows = 2 * 7 * 8  # blocks of two rows: three blocks for six rows
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, tokens, 0.6, chunk_bytes=two_rows), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: entropy_from_logits(x, 1.3, chunk_bytes=two_rows), (logits,))


def test_logprobs_reject_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)


class LiveStorageBytes(TorchDispatchMode):
    """The peak of bytes held by tensor storages that ops allocate inside the mode, while alive.

    It counts what tensors hold, not what the process holds (RSS follows malloc's thresholds and
    reuse of freed memory), so the figure is the same on every machine; torch's MemTracker
    measures the same way. An output that shares an input's storage (a view, an in-place op)
    allocates nothing; a new storage counts until it is freed, whenever that happens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._release_on_free: dict[int, weakref.ref] = {}  # storage address -> its weak reference

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        outputs = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for output in tree_flatten(outputs)[0]:
            if isinstance(output, Tensor):
                storage = output.untyped_storage()
                address = storage.data_ptr()
                if storage.nbytes() and address not in inputs and address not in self._release_on_free:
                    self._count(storage, address)
        return outputs

    def _count(self, storage: torch.UntypedStorage, address: int) -> None:
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._release_on_free[address] = weakref.ref(storage, lambda _: self._release(address, nbytes))

    def _release(self, address: int, nbytes: int) -> None:
        self.live -= nbytes
        del self._release_on_free[address]


def peak_bytes(fn):
    """(fn's result, the peak of bytes that fn allocated and held at once)."""
    with LiveStorageBytes() as tracker:
        result = fn()
    return result, tracker.peak


def test_logprobs_and_entropy_peak_memory_is_bounded_for_qwen3_vocabulary():
    # Logits [4, 128, 151936] bf16: 148 MiB; one float32 copy 297 MiB (log_softmax on it holds
    # two); the gradient (bf16) 148 MiB. The kernels' own claim: at most two float32 blocks of
    # LOGITS_CHUNK_BYTES (32 MiB) at a time, plus vectors of one float per row (2 KiB here).
    vocab = 151936
    gen = torch.Generator().manual_seed(12)
    logits = torch.empty(4, 128, vocab, dtype=torch.bfloat16).uniform_(-8, 8, generator=gen).requires_grad_()
    tokens = torch.randint(0, vocab, (4, 128), generator=gen)
    blocks = 2 * LOGITS_CHUNK_BYTES + 2**20
    grad = logits.numel() * logits.element_size()

    def backward(output: Tensor) -> None:
        output.sum().backward()
        logits.grad = None

    # Forward with autograd recording: a naive loop would keep every float32 block for backward.
    logprobs, logprobs_forward = peak_bytes(lambda: token_logprobs(logits, tokens, 0.7))
    entropy, entropy_forward = peak_bytes(lambda: entropy_from_logits(logits, 0.7))
    _, logprobs_backward = peak_bytes(lambda: backward(logprobs))
    _, entropy_backward = peak_bytes(lambda: backward(entropy))
    peaks = {"logprobs_forward": logprobs_forward, "entropy_forward": entropy_forward,
             "logprobs_backward": logprobs_backward, "entropy_backward": entropy_backward}
    mib = {name: round(value / 2**20, 1) for name, value in peaks.items()}
    # Lower bounds: a float32 row must be upcast, and backward must allocate the gradient, so a
    # probe that missed the kernels' allocations cannot pass.
    assert min(logprobs_forward, entropy_forward) >= vocab * 4, mib
    assert min(logprobs_backward, entropy_backward) >= grad, mib
    assert max(logprobs_forward, entropy_forward) <= blocks, mib
    assert max(logprobs_backward, entropy_backward) <= grad + blocks, mib


@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_length_penalty_split_with_the_minibatch_normalizer_matches_whole_batch(pieces):
    gen = torch.Generator().manual_seed(11)
    logp = -torch.rand(8, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([1, 6, 2, 5, 3, 4, 6, 1])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(torch.float64)
    rho = group_length_ratio(lengths, group_size=4)  # once, on the whole batch
    whole_logp = logp.clone().requires_grad_(True)
    whole = length_penalty(whole_logp, mask, rho, coef=0.7)
    whole.backward()
    split_logp = logp.clone().requires_grad_(True)
    total = sum(length_penalty(part, m, r, coef=0.7, normalizer=mask.sum())
                for part, m, r in zip(split_logp.chunk(pieces), mask.chunk(pieces), rho.chunk(pieces)))
    total.backward()
    assert_close(total, whole, rtol=1e-12, atol=0)
    assert_close(split_logp.grad, whole_logp.grad, rtol=1e-12, atol=0)
    assert whole.item() != 0.0
