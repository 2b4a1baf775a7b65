"""DAPO loss math (docs/algorithm.md §1-5): advantages, policy loss, KL, reward and length shaping,
and memory-bounded log-probs / entropy from logits.

Every function is pure: tensors and plain numbers in, tensors out; no model, no process group,
no config object. Shapes: N sequences (prompts x group size, each prompt's responses
contiguous), T response positions, V vocabulary. `mask` [N, T] is 1 (or True) on real response
tokens and 0 on padding; values at masked positions may be arbitrary and never reach a loss or
a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Why chunk: a float32 copy of Qwen3 logits (vocabulary 151,936) is 0.6 MB per token, ~20 GB
# for a 32k-token micro-batch, more than the model itself needs. The log-prob and entropy
# kernels below upcast one block of rows at a time and keep at most two float32 buffers of this
# size alive, so their working memory is ~2 x LOGITS_CHUNK_BYTES whatever N x T is. 32 MiB is
# 55 rows of the Qwen3 vocabulary: big enough that per-block launch overhead is negligible.
LOGITS_CHUNK_BYTES = 32 * 2**20

Normalizer = float | Tensor | None


# --- advantages and dynamic sampling (§2, §3) -------------------------------------------------


def _grouped(values: Tensor, group_size: int) -> Tensor:
    """[N] -> [N // group_size, group_size]."""
    if group_size < 1 or values.dim() != 1 or values.numel() % group_size:
        raise ValueError(
            f"expected a 1-D tensor whose length is a multiple of group_size={group_size}, "
            f"got shape {tuple(values.shape)}"
        )
    return values.reshape(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6,
                     norm_by_std: bool = True) -> Tensor:
    """Group-relative advantages [N] from rewards [N]: (R - mean_g) / (std_g + eps), std unbiased.

    norm_by_std=False gives the Dr.GRPO form R - mean_g. A group of one has no peers: mean 0,
    std 1, so its advantage is its reward (divided by 1 + eps).
    """
    groups = _grouped(rewards if rewards.is_floating_point() else rewards.float(), group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(groups), torch.ones_like(groups)
    else:
        mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True)
    centered = groups - mean
    return (centered / (std + eps) if norm_by_std else centered).reshape(-1)


def informative_groups(metric: Tensor, group_size: int) -> Tensor:
    """Bool [N // group_size]: True where a group's metric values [N] are not all equal.

    A group with zero spread has all advantages zero and carries no gradient. A group of one
    is informative: its advantage is its raw reward.
    """
    groups = _grouped(metric, group_size)
    if group_size == 1:
        return torch.ones(groups.shape[0], dtype=torch.bool, device=groups.device)
    return (groups != groups[:, :1]).any(dim=1)


# --- aggregation and the policy loss (§4) -----------------------------------------------------


def _check_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")


def aggregate(values: Tensor, mask: Tensor, mode: str, normalizer: Normalizer = None) -> Tensor:
    """Reduce per-token values [N, T] over the valid tokens of mask [N, T] to a scalar.

    token-mean: sum of all valid values / normalizer (a token count).
    seq-mean-token-mean: sum over sequences of each one's token mean / normalizer (a sequence
    count); a sequence without valid tokens counts as 0. seq-mean-token-sum: the same with each
    sequence's token sum. Pass the count of the whole optimizer step (all micro-batches, all
    ranks) as normalizer so that micro-batch losses add up to the step's loss; None uses this
    call's own count.
    """
    _check_agg_mode(mode)
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"normalizer must be a positive token or sequence count, got {normalizer}")
    valid = mask.bool()
    # where, not multiply: inf or NaN garbage at padding cannot leak into the sum or gradient.
    masked = torch.where(valid, values, 0.0)
    if mode == "token-mean":
        total, own_count = masked.sum(), valid.sum().clamp_min(1)
    else:
        per_seq = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / valid.sum(dim=-1).clamp_min(1)
        total, own_count = per_seq.sum(), max(per_seq.numel(), 1)
    return total / (own_count if normalizer is None else normalizer)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.28,
                clip_ratio_c: float = 10.0, loss_agg_mode: str = "token-mean",
                normalizer: Normalizer = None,
                is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO clipped policy-gradient loss (clip-higher, dual clip) and its metrics.

    logp, old_logp, mask: [N, T]; advantages: [N] (broadcast over tokens) or [N, T];
    is_weights: optional [N, T] truncated importance weights, multiplied into the token loss
    and never differentiated. clip_ratio_low / clip_ratio_high are epsilons around a ratio of 1.
    Returns (scalar loss, metrics): metrics are detached masked means over this call's tokens of
    pg_clipfrac (the clip was active), pg_clipfrac_lower (the dual clip was active) and ppo_kl
    (old_logp - logp).
    """
    if clip_ratio_c <= 1:
        raise ValueError(
            f"clip_ratio_c must be > 1: it caps a negative-advantage token's loss at "
            f"clip_ratio_c * |A|, above the clipped range; got {clip_ratio_c}"
        )
    if not (0 <= clip_ratio_low < 1 and clip_ratio_high >= 0):
        raise ValueError(
            f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0 (epsilons around a ratio "
            f"of 1, e.g. 0.2 / 0.28); got {clip_ratio_low} / {clip_ratio_high}"
        )
    _check_agg_mode(loss_agg_mode)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)

    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    token_loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    if is_weights is not None:
        token_loss = token_loss * is_weights.detach()
    loss = aggregate(token_loss, mask, loss_agg_mode, normalizer)

    with torch.no_grad():
        def token_mean(values: Tensor) -> Tensor:
            return aggregate(values.to(token_loss.dtype), mask, "token-mean")

        metrics = {
            "pg_clipfrac": token_mean(clipped > unclipped),
            "pg_clipfrac_lower": token_mean(negative & (dual_bound < clip_loss)),
            "ppo_kl": token_mean(old_logp - logp),
        }
    return loss, metrics


# --- extra loss terms and reward shaping (§1, §5) ---------------------------------------------


def _kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def _kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()


def _kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Clamps keep exp finite when the policy has moved far from the reference.
    log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


def _kl_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return (logp - ref_logp).abs()


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _kl_k1, "kl": _kl_k1,
    "k2": _kl_k2, "mse": _kl_k2,
    "k3": _kl_k3, "low_var_kl": _kl_k3,
    "abs": _kl_abs,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [N, T] of the policy from the reference; kind k1|kl, k2|mse,
    k3|low_var_kl or abs."""
    try:
        estimator = _KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(_KL_ESTIMATORS)}") from None
    return estimator(logp, ref_logp)


def overlong_penalty(lengths: Tensor, *, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> Tensor:
    """DAPO soft overlong punishment [N] (float32) for response lengths [N].

    0 up to max_response_length - buffer_len, then falling linearly to -penalty_factor at
    max_response_length; all zeros when buffer_len is 0.
    """
    if not 0 <= buffer_len <= max_response_length:
        raise ValueError(
            f"overlong buffer_len must be in [0, max_response_length={max_response_length}], "
            f"got {buffer_len}"
        )
    lengths = lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    overshoot = lengths - (max_response_length - buffer_len)
    return torch.clamp(-overshoot / buffer_len * penalty_factor, max=0.0)


def group_length_ratio(lengths: Tensor, group_size: int) -> Tensor:
    """rho_i = |o_i| / (mean length of response i's group) (§5), one per response, float32.

    A group whose responses are all empty has rho 0 rather than NaN. Computed once per step on
    the whole batch (groups are contiguous there), before it is cut into mini-batches.
    """
    groups = _grouped(lengths.float(), group_size)
    mean = groups.mean(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (groups / mean).reshape(-1)


def length_penalty(logp: Tensor, mask: Tensor, length_ratio: Tensor, *, coef: float,
                   normalizer: Normalizer = None) -> Tensor:
    """coef * sum_i (rho_i - 1) * sum_t logp[i, t] / N (§5): the score-function gradient of the
    expected relative length, with the group mean as baseline.

    logp, mask: [N, T]; length_ratio: [N], rho from :func:`group_length_ratio` (a constant, no
    gradient). Minimising it lowers the log-probability of responses longer than their group's
    mean and raises that of shorter ones; equal lengths contribute nothing. N is ``normalizer``
    (the mini-batch's loss normaliser, so micro-batch terms add up to the mini-batch's term) or,
    when None, this call's token count.
    """
    weight = (length_ratio.detach().to(logp.dtype) - 1).unsqueeze(-1)
    return coef * aggregate(weight * logp, mask, "token-mean", normalizer)


# --- log-probs and entropy from logits, in bounded memory (§5) --------------------------------


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """At least float32: bf16 / fp16 logits lose too much in logsumexp over a large vocabulary."""
    return torch.promote_types(logits.dtype, torch.float32)


def _row_blocks(num_rows: int, vocab: int, dtype: torch.dtype, chunk_bytes: int) -> Iterator[slice]:
    """Slices of rows whose [rows, vocab] copy in dtype fits in chunk_bytes (at least one row)."""
    rows_per_block = max(1, chunk_bytes // (vocab * dtype.itemsize))
    for start in range(0, num_rows, rows_per_block):
        yield slice(start, min(start + rows_per_block, num_rows))


def _scaled_block(logits: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """logits / temperature in dtype, always a fresh copy so in-place ops on it are safe."""
    return logits.to(dtype, copy=True).div_(temperature)


# The per-block helpers below are functions, not loop bodies, so that a block's float32
# buffers are freed on return, before the next block allocates its own.


def _logprobs_block(logits: Tensor, tokens: Tensor, dtype: torch.dtype,
                    temperature: float) -> tuple[Tensor, Tensor]:
    """(logsumexp, log-prob of tokens) [rows] of logits [rows, V] / temperature."""
    scaled = _scaled_block(logits, dtype, temperature)
    logsumexp = torch.logsumexp(scaled, dim=-1)
    return logsumexp, scaled.gather(1, tokens[:, None]).squeeze(1) - logsumexp


def _logprobs_block_grad(logits: Tensor, tokens: Tensor, logsumexp: Tensor, grad_logprobs: Tensor,
                         temperature: float) -> Tensor:
    """Gradient [rows, V] of the token log-probs: (onehot(token) - softmax) / temperature."""
    probs = _scaled_block(logits, logsumexp.dtype, temperature).sub_(logsumexp[:, None]).exp_()
    grad_out = grad_logprobs[:, None] / temperature
    return probs.mul_(-grad_out).scatter_add_(1, tokens[:, None], grad_out)


def _entropy_block(logits: Tensor, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor]:
    """(logsumexp, entropy) [rows] of softmax(logits [rows, V] / temperature)."""
    log_probs = _scaled_block(logits, dtype, temperature)
    logsumexp = torch.logsumexp(log_probs, dim=-1)
    log_probs.sub_(logsumexp[:, None])
    return logsumexp, -log_probs.exp().mul_(log_probs).sum(dim=-1)


def _entropy_block_grad(logits: Tensor, logsumexp: Tensor, entropy: Tensor, grad_entropy: Tensor,
                        temperature: float) -> Tensor:
    """Gradient [rows, V] of the entropy: -p (log p + H) / temperature."""
    log_probs = _scaled_block(logits, entropy.dtype, temperature).sub_(logsumexp[:, None])
    grad_out = grad_entropy[:, None] / -temperature
    return log_probs.exp().mul_(log_probs.add_(entropy[:, None])).mul_(grad_out)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / T)[token] over [rows, V] logits, computed block by block.

    Autograd through a Python loop would keep every block's float32 softmax alive for backward
    (a full float32 copy again), so backward recomputes each block from the saved logits.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, tokens: Tensor, temperature: float,
                chunk_bytes: int) -> Tensor:
        dtype = _compute_dtype(logits)
        logsumexp = logits.new_empty(logits.shape[0], dtype=dtype)
        logprobs = torch.empty_like(logsumexp)
        for rows in _row_blocks(logits.shape[0], logits.shape[1], dtype, chunk_bytes):
            logsumexp[rows], logprobs[rows] = _logprobs_block(logits[rows], tokens[rows], dtype,
                                                              temperature)
        ctx.save_for_backward(logits, tokens, logsumexp)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprobs: Tensor) -> tuple[Tensor | None, ...]:
        logits, tokens, logsumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _row_blocks(logits.shape[0], logits.shape[1], logsumexp.dtype, ctx.chunk_bytes):
            grad_logits[rows] = _logprobs_block_grad(logits[rows], tokens[rows], logsumexp[rows],
                                                     grad_logprobs[rows], ctx.temperature)
        return grad_logits, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits / T) over [rows, V] logits, computed block by block (see
    _TokenLogprobs for why backward recomputes)."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, temperature: float, chunk_bytes: int) -> Tensor:
        dtype = _compute_dtype(logits)
        logsumexp = logits.new_empty(logits.shape[0], dtype=dtype)
        entropy = torch.empty_like(logsumexp)
        for rows in _row_blocks(logits.shape[0], logits.shape[1], dtype, chunk_bytes):
            logsumexp[rows], entropy[rows] = _entropy_block(logits[rows], dtype, temperature)
        ctx.save_for_backward(logits, logsumexp, entropy)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        logits, logsumexp, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _row_blocks(logits.shape[0], logits.shape[1], entropy.dtype, ctx.chunk_bytes):
            grad_logits[rows] = _entropy_block_grad(logits[rows], logsumexp[rows], entropy[rows],
                                                    grad_entropy[rows], ctx.temperature)
        return grad_logits, None, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, *,
                   chunk_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """log softmax(logits / temperature) at tokens: logits [N, T, V] (any float dtype), tokens
    [N, T] valid ids everywhere (pad with any id) -> [N, T] in float32 (float64 for float64
    logits). Differentiable; never holds more than a chunk_bytes block of upcast logits (plus
    one scratch block), in forward or backward. Non-contiguous logits are first copied in their
    own dtype."""
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    flat = _TokenLogprobs.apply(logits.reshape(-1, vocab), tokens.reshape(-1).long(),
                                float(temperature), chunk_bytes)
    return flat.view(tokens.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, *,
                        chunk_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """Entropy of softmax(logits / temperature): logits [N, T, V] -> [N, T] in float32 (float64
    for float64 logits). Differentiable, in the same bounded memory as token_logprobs."""
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    flat = _Entropy.apply(logits.reshape(-1, vocab), float(temperature), chunk_bytes)
    return flat.view(logits.shape[:-1])
