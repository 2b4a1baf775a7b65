"""Padding-free forwards (``use_remove_padding``): a micro-batch's sequences packed into one row.

A padded micro-batch computes every row at the width of its longest prompt plus its longest
response; with DAPO's long tail of lengths most of that is padding. Packed, the real tokens of
every sequence lie end to end in one row of T tokens, each sequence's positions start at 0, and
attention stays inside each sequence; the log-probs and entropies come back in the padded
[rows, response width] layout, zero at padding, so the loss math (dapo_loss.py) is the same.

How attention is kept inside each sequence is said explicitly, per attention kernel of
transformers (the same in 5.5 and 5.19):
- flash attention (transformers' ``flash_attention_2``, on NPU its torch_npu varlen fused
  attention): ``cu_seq_lens_q/k`` and ``max_length_q/k``, where each sequence starts and ends;
- sdpa: a [1, 1, T, T] bool mask, causal within each sequence, built on the device (a 4-D mask
  is taken as it is);
- any other (eager): no mask and positions that restart at 0, from which transformers' masking
  finds the sequences itself (masking_utils.find_packed_sequence_indices, one host read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def is_flash(attn_implementation: str) -> bool:
    """Whether transformers runs this attention through its flash-attention path, which takes the
    sequences' bounds as cu_seq_lens (flash_attention_2/3, the kernels' flash variants): its own
    test, a name with "flash" in it."""
    from transformers.utils.generic import is_flash_attention_requested

    return is_flash_attention_requested(requested_attention_implementation=attn_implementation)


def attention_inputs(config: Any, packed: PackedRows, bounds_on_host: bool) -> dict[str, Any]:
    """The keyword arguments that confine a packed forward's attention to each sequence, for the
    attention kernel ``config`` names (module docstring). ``bounds_on_host``: the flash kernel
    reads cu_seq_lens on the host (torch_npu's), so they stay there instead of a copy back per layer."""
    implementation = config._attn_implementation
    if is_flash(implementation):
        device = "cpu" if bounds_on_host else packed.ids.device
        bounds = torch.tensor([0, *packed.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        longest = max(packed.lengths)
        return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}
    if implementation == "sdpa" and getattr(config, "sliding_window", None) is None:
        total = packed.sequence.shape[0]
        causal = torch.ones(total, total, dtype=torch.bool, device=packed.sequence.device).tril()
        return {"attention_mask": (causal & (packed.sequence[:, None] == packed.sequence[None, :]))[None, None]}
    return {}


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
