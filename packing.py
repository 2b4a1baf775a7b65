"""Padding-free forwards (``use_remove_padding``): a micro-batch's sequences packed into one row.

A padded micro-batch computes every row at the width of its longest prompt plus its longest
response; with DAPO's long tail of lengths most of that is padding. Packed, the real tokens of
every sequence lie end to end in one row of T tokens, each sequence's positions start at 0, and
attention stays inside each sequence; the log-probs and entropies come back in the padded
[rows, response width] layout, zero at padding, so the loss math (dapo_loss.py) is the same.

Attention is kept inside each sequence by an attention kernel of ours (VARLEN_ATTENTION) that
the learner's models run when they pack, given each sequence's bounds; the same under
transformers 5.5 and 5.19 (their attention interface, sdpa and NPU flash wrappers are alike).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from samples import SampleBatch


@dataclass(frozen=True)
class PackedRows:
    """The layout of one packed forward over the rows of a micro-batch (width P + R, padded).

    Index tensors live on the device the forward runs on; ``lengths`` on the host."""

    ids: torch.Tensor  # [1, T] the real tokens, sequence after sequence
    positions: torch.Tensor  # [1, T] each token's place in its own sequence
    sequence: torch.Tensor  # [T] which row each token comes from
    lengths: list[int]  # real tokens of each row
    tokens: torch.Tensor  # [T] each packed token's index in the padded rows flattened ([rows * (P + R)])
    predicting: torch.Tensor  # [M] the packed places whose outputs predict a real response token
    targets: torch.Tensor  # [M] those response tokens
    responses: torch.Tensor  # [M] their index in the padded responses flattened ([rows * R])
    rows: int
    width: int  # P + R
    response_width: int  # R

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    def unpack_responses(self, values: torch.Tensor) -> torch.Tensor:
        """[1, M] per-response-token values -> [rows, R], zero at padding (differentiable)."""
        flat = values.new_zeros(self.rows * self.response_width)
        return flat.index_put((self.responses,), values.reshape(-1)).view(self.rows, self.response_width)

    def unpack_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] per-token values -> [rows, P + R, ...], zero (False) at padding."""
        trailing = values.shape[2:]
        flat = values.new_zeros(self.rows * self.width, *trailing)
        return flat.index_put((self.tokens,), values[0]).view(self.rows, self.width, *trailing)

    def pack_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """[rows, P + R, ...] per-token values (routing ids) -> [1, T, ...] of the packed tokens."""
        return values.flatten(0, 1)[self.tokens][None]


def pack(batch: SampleBatch, device: torch.device) -> PackedRows:
    """The packed layout of ``batch``'s rows, computed on the host (the batch lives there) and
    moved to ``device``: no device value is read. A row's real tokens are its prompt's (left-padded)
    and its response's (right-padded); each response token is predicted by the output at the real
    token before it, in the same sequence."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    valid = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    rows, width = valid.shape
    response_width = batch.response_ids.shape[1]
    tokens = valid.flatten().nonzero().squeeze(1)
    place = valid.flatten().long().cumsum(0) - 1  # a real token's packed index
    lengths = valid.sum(1)
    response_valid = batch.response_mask.flatten()
    response_rows = torch.arange(rows).repeat_interleave(response_width)[response_valid]
    response_cols = torch.arange(response_width).repeat(rows)[response_valid]
    predicting = place[response_rows * width + width - response_width + response_cols] - 1
    # Real tokens run contiguously in every row, so the one before a response token is its predictor.
    assert bool(valid.flatten()[response_rows * width + width - response_width + response_cols - 1].all()), \
        "a response token follows padding: the rows are not left-padded prompts and right-padded responses"
    sequence = torch.arange(rows).repeat_interleave(lengths)
    starts = lengths.cumsum(0) - lengths
    positions = torch.arange(len(tokens)) - starts[sequence]
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return PackedRows(ids=move(ids.flatten()[tokens][None]), positions=move(positions[None]), sequence=move(sequence),
                      lengths=lengths.tolist(), tokens=move(tokens), predicting=move(predicting),
                      targets=move(batch.response_ids[batch.response_mask][None]),
                      responses=move(response_valid.nonzero().squeeze(1)), rows=rows, width=width,
                      response_width=response_width)


# Our attention kernel for packed forwards, registered with transformers under this name: each
# sequence's span of the packed row attends causally to itself alone, the bounds handed over as
# Python ints (``packed_bounds``), which FSDP2's root, moving every input tensor to the device,
# leaves on the host. On NPU: the Ascend extension's fused attention in its varlen (TND) form, through
# transformers' own wrapper (device.npu_varlen_attention), bounds from the host (as a tensor on the
# device they would be read back twice a layer). Elsewhere torch's sdpa a span at a time: one
# [T, T] mask over the packed row would cost (sum of lengths)^2 where the spans cost the sum of
# squared lengths (at 4 rows of 4096, 4x the work). Padded forwards (no bounds) are transformers' sdpa.
VARLEN_ATTENTION = "packed_varlen"


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface ([1, heads, T, head_dim] in, [1, T, heads, head_dim] out)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from device import npu_varlen_attention

    bounds = kwargs.pop("packed_bounds", None)
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    dropout = dropout if module.training else 0.0
    fused = npu_varlen_attention(query.device.type)
    if fused is not None:
        tnd = [t[0].transpose(0, 1) for t in (query, key, value)]  # [T, heads, head_dim]
        edges = torch.tensor(bounds, dtype=torch.int64)  # host memory: the kernel takes the lengths there
        out = fused(*tnd, edges, edges, dropout_p=dropout, softmax_scale=scaling, causal=True)
        return out[None], None
    spans = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], is_causal=True, scale=scaling,
        dropout_p=dropout, enable_gqa=key.shape[1] != query.shape[1])
        for start, stop in zip(bounds[:-1], bounds[1:])]
    return torch.cat(spans, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_attention() -> None:
    """Make VARLEN_ATTENTION a name transformers' models take (set_attn_implementation). No mask
    function goes with it: a packed forward then gets none (and transformers reads no device value
    looking for packed sequences); a padded one brings its own 4-D mask (learner.attention_mask_for)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)


def attention_inputs(config: Any, packed: PackedRows) -> dict[str, Any]:
    """The keyword arguments that confine a packed forward's attention to each sequence: the
    sequences' bounds for our kernel; for any other (eager, sdpa) none, and transformers finds the
    sequences from the positions that restart at 0 (masking_utils.find_packed_sequence_indices:
    one host read and a [T, T] mask)."""
    if config._attn_implementation != VARLEN_ATTENTION:
        return {}
    return {"packed_bounds": tuple(itertools.accumulate(packed.lengths, initial=0))}


def fill_by_tokens(tokens: torch.Tensor, rows: torch.Tensor, shares: list[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """``rows`` (this learner's) cut into micro-batches of at most ``budget`` real tokens each
    (``tokens`` [N]: every row's), in as many as the fullest of ``shares`` (every learner's rows,
    ``rows`` among them) needs: under FSDP2 each forward gathers every layer from all learners, so
    they all run the same number. A row longer than the budget is a micro-batch of its own.
    Computed on the host from lengths every learner holds: no collective, the same on each.

    First-fit decreasing (longest rows first, each into the first micro-batch it fits in); a
    learner that needs fewer splits its fullest micro-batches in two until it has as many."""
    count = max(len(_first_fit(tokens[share].tolist(), budget)) for share in shares)
    bins = _first_fit(tokens[rows].tolist(), budget)
    while len(bins) < count:  # each learner has as many rows as any other, so one can always split
        fullest = max((b for b in bins if len(b) > 1), key=lambda b: sum(tokens[rows[b]].tolist()))
        bins.remove(fullest)
        bins += [fullest[0::2], fullest[1::2]]  # longest first: alternate rows balance the halves
    return [rows[torch.tensor(sorted(b), dtype=torch.long)] for b in bins]


def _first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped first-fit decreasing into bins of at most ``budget``
    (a longer one alone), each bin's indices longest first."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        home = next((b for b, load in enumerate(loads) if load + lengths[index] <= budget), None)
        if home is None:
            bins.append([])
            loads.append(0)
            home = len(bins) - 1
        bins[home].append(index)
        loads[home] += lengths[index]
    return bins
