"""Rollout correction: importance weights and rejection for the gap between the engine that
generated a batch and the learner that trains on it (docs/algorithm.md §6), as verl 0.9.1 names
and defines it (``algorithm.rollout_correction``, its rollout_corr_helper.py).

Everything is a function of log_ratio = old_logp - rollout_logp [N, T]: the learner's recomputed
log-prob of each response token minus the rollout engine's, over ``mask`` [N, T] (True on
response tokens; values elsewhere may be anything and never count).

- Importance sampling (``rollout_is``): ``token`` weighs each token by exp(log_ratio);
  ``sequence`` weighs every token of a row by exp(the row's sum of log_ratio). A
  ``rollout_is_threshold`` "C" truncates the weights at C (TIS); "L_U" zeroes those outside
  [L, U] (IcePop) and keeps the rest as they are. The weights multiply the token loss, detached.
- Rejection (``rollout_rs``): comma-separated checks, each on a KL estimator of the token (k1 =
  -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio) per token, or per row
  as its sum, mean or max; a token stays in the loss only where every check passes. A k1 check
  takes a band of ratios "L_U" (log L <= k1 <= log U, a band on e^k1 = rollout p / learner p,
  as verl signs k1; one number U means 1/U_U); the others one upper bound on the estimator.

Every exp is of a log clamped to ±SAFETY_BOUND, so no weight overflows (verl's bound).

Pure like dapo_loss.py: tensors and plain values in, tensors and floats out; no config object.
Bad settings raise ValueError with one line that names the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

SAFETY_BOUND = 20.0  # |log ratio| before exp: e^20 ~ 4.9e8
IS_LEVELS = ("token", "sequence")
REJECTION_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                   "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# What correct() reports, verl's names without its "rollout_corr/" prefix; None where not in use.
# rollout_is_eff_sample_size is a fraction of the tokens, (sum w)^2 / (n sum w^2); where every
# weight is 0 (all outside an IcePop band) it is 0, where verl divides by zero.
METRICS = ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size",
           "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")


@dataclass(frozen=True)
class Band:
    """Kept where <= upper, and >= lower when lower is set."""

    upper: float
    lower: Optional[float] = None


@dataclass(frozen=True)
class RejectionCheck:
    mode: str  # one of REJECTION_MODES
    band: Band  # k1: ratios, compared in log space; k2, k3: an upper bound on the estimator


@dataclass(frozen=True)
class Correction:
    weights: Optional[Tensor]  # [N, T] detached importance weights, 0 off the mask; None without rollout_is
    loss_mask: Tensor  # [N, T] bool: the mask less the rejected tokens
    metrics: dict[str, Optional[float]]  # every name of METRICS


# ----- the settings ---------------------------------------------------------------------------


def _positive(text: str, key: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key} {spec!r}: {text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{key} {spec!r}: bounds must be > 0")
    return value


def _band(spec: str, key: str) -> Band:
    """"U", or "L_U" with 0 < L <= U."""
    first, underscore, second = spec.strip().partition("_")
    if not underscore:
        return Band(_positive(first, key, spec))
    band = Band(upper=_positive(second, key, spec), lower=_positive(first, key, spec))
    if band.lower > band.upper:
        raise ValueError(f"{key} {spec!r}: the lower bound is above the upper one")
    return band


def parse_is_threshold(spec: str) -> Band:
    """rollout_is_threshold: "C" truncates weights at C (TIS), "L_U" zeroes those outside [L, U] (IcePop)."""
    return _band(str(spec), "rollout_is_threshold")


def parse_rejection(modes: str, thresholds: Optional[str]) -> tuple[RejectionCheck, ...]:
    """rollout_rs (comma-separated modes; one given twice counts once, as in verl) with
    rollout_rs_threshold: one threshold for every mode, or one per mode in the same order."""
    names = list(dict.fromkeys(name.strip() for name in modes.split(",") if name.strip()))
    choices = f"comma-separated among {', '.join(REJECTION_MODES)}"
    if not names:
        raise ValueError(f"rollout_rs: no mode given; {choices}")
    for name in names:
        if name not in REJECTION_MODES:
            raise ValueError(f"rollout_rs: {name} mode is unknown; {choices}")
    if thresholds is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold (one for every mode, or one per mode)")
    specs = [spec.strip() for spec in str(thresholds).split(",") if spec.strip()]
    specs = specs * len(names) if len(specs) == 1 else specs
    if len(specs) != len(names):
        raise ValueError(f"rollout_rs_threshold: {len(specs)} thresholds for {len(names)} rollout_rs modes "
                         f"(give one for every mode, or one per mode)")
    checks = []
    for name, spec in zip(names, specs):
        band = _band(spec, "rollout_rs_threshold")
        if name.endswith("k1") and band.lower is None:
            if band.upper < 1:  # the band [1/U, U] is empty: every token would be rejected (verl refuses it too)
                raise ValueError(f"rollout_rs_threshold {spec!r}: {name} with one bound U keeps ratios in [1/U, U], "
                                 f"empty for U below 1; give U >= 1 or a 'lower_upper' band")
            band = Band(band.upper, 1.0 / band.upper)
        elif not name.endswith("k1") and band.lower is not None:
            raise ValueError(f"rollout_rs_threshold {spec!r}: {name} takes one upper bound (a 'lower_upper' band "
                             f"is for the k1 modes)")
        checks.append(RejectionCheck(name, band))
    return tuple(checks)


def check_settings(is_level: Optional[str], is_threshold: str, rs_modes: Optional[str],
                   rs_threshold: Optional[str]) -> None:
    """ValueError (one line naming the key) unless correct() can use these settings."""
    if is_level is not None and is_level not in IS_LEVELS:
        raise ValueError(f"rollout_is takes {', '.join(IS_LEVELS)} or null, got {is_level!r}")
    parse_is_threshold(is_threshold)  # even unused: a value no run can use is a mistake
    if rs_modes is not None:
        parse_rejection(rs_modes, rs_threshold)


# ----- the tensors ----------------------------------------------------------------------------


def _row_sums(values: Tensor, mask: Tensor) -> Tensor:
    """[N, 1]: each row's sum over its tokens."""
    return torch.where(mask, values, 0.0).sum(-1, keepdim=True)


def importance_weights(log_ratio: Tensor, mask: Tensor, level: str, band: Band, *,
                       batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """[N, T] detached weights, 0 off ``mask``, and their metrics (before the batch normalisation,
    which divides the weights by their mean over the tokens (token) or the rows (sequence))."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is takes {', '.join(IS_LEVELS)} or null, got {level!r}")
    mask = mask.bool()
    log_weight = log_ratio if level == "token" else _row_sums(log_ratio, mask)
    raw = torch.where(mask, torch.exp(log_weight.clamp(-SAFETY_BOUND, SAFETY_BOUND)), 0.0)
    if band.lower is None:
        weights = raw.clamp(max=band.upper)
    else:
        weights = torch.where((raw >= band.lower) & (raw <= band.upper), raw, 0.0)
    rows = mask.any(-1)
    total, squares, tokens = weights.sum(), weights.square().sum(), mask.sum()
    if level == "token":
        peak = weights[mask].max()
    else:  # as verl: the largest row weight before truncation (and before the bound below)
        peak = torch.exp(log_weight[rows].max().clamp(max=SAFETY_BOUND))
    metrics = {"rollout_is_mean": float(total / tokens), "rollout_is_max": float(peak),
               "rollout_is_eff_sample_size": float(total.square() / (tokens * squares)) if squares > 0 else 0.0}
    if batch_normalize:
        if level == "token":
            mean = total / tokens
        else:
            mean = (weights.sum(-1) / mask.sum(-1).clamp_min(1))[rows].mean()
        if mean > 1e-8:  # all weights 0 (IcePop): nothing to scale
            weights = weights / mean
    return weights.detach(), metrics


def _passes(check: RejectionCheck, estimates: dict[str, Tensor], mask: Tensor) -> Tensor:
    """Where ``check`` keeps the tokens: [N, T] for a token mode, [N, 1] for a sequence mode."""
    scope, estimator = check.mode.rsplit("_", 1)
    values = estimates[estimator]
    if scope == "token":
        stat = values
    elif scope == "seq_sum":
        stat = _row_sums(values, mask)
    elif scope == "seq_mean":
        stat = _row_sums(values, mask) / mask.sum(-1, keepdim=True).clamp_min(1)
    else:  # seq_max
        stat = torch.where(mask, values, -math.inf).amax(-1, keepdim=True)
    if estimator == "k1":
        return (stat >= math.log(check.band.lower)) & (stat <= math.log(check.band.upper))
    return stat <= check.band.upper


def rejection_mask(log_ratio: Tensor, mask: Tensor, checks: tuple[RejectionCheck, ...]) -> tuple[Tensor, dict[str, float]]:
    """[N, T] bool: the tokens of ``mask`` that pass every check; and the fractions of the tokens,
    and of the rows with tokens, that lost any."""
    mask = mask.bool()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    estimates = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep = mask
    for check in checks:
        keep = keep & _passes(check, estimates, mask)
    rejected, rows = mask & ~keep, mask.any(-1)
    return keep, {"rollout_rs_masked_fraction": float(rejected.sum() / mask.sum()),
                  "rollout_rs_seq_masked_fraction": float(rejected.any(-1)[rows].float().mean())}


def correct(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, is_level: Optional[str], is_threshold: str,
            is_batch_normalize: bool = False, rs_modes: Optional[str] = None,
            rs_threshold: Optional[str] = None) -> Correction:
    """verl's compute_rollout_correction_and_rejection_mask on one step's rows (old_logp,
    rollout_logp, mask [N, T]): the importance weights when ``is_level`` is set, the loss mask
    less the tokens ``rs_modes`` rejects when it is set, and METRICS. Weights and rejection are
    both computed over the whole ``mask``; a rejected token keeps its weight but leaves the loss."""
    mask = mask.bool()
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    log_ratio = old_logp.float() - rollout_logp.float()
    metrics: dict[str, Optional[float]] = dict.fromkeys(METRICS)
    weights, loss_mask = None, mask
    if is_level is not None:
        weights, is_metrics = importance_weights(log_ratio, mask, is_level, parse_is_threshold(is_threshold),
                                                 batch_normalize=is_batch_normalize)
        metrics.update(is_metrics)
    if rs_modes is not None:
        loss_mask, rs_metrics = rejection_mask(log_ratio, mask, parse_rejection(rs_modes, rs_threshold))
        metrics.update(rs_metrics)
    return Correction(weights, loss_mask, metrics)
