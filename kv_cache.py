"""The built-in engine's KV cache: one storage per engine, reused by every call, written in place.

Keys and values of every layer for up to ``rows`` x ``length`` positions (the most rows a call has
x its prompt width + max_new_tokens), an attention mask over those positions (additive, or bool
where the platform takes no other: device.attention_mask_dtype) and the column the next token's
key goes to. A call uses the leading rows and columns of that storage; no tensor grows with the
step (transformers' DynamicCache concatenates the whole cache every token), none is allocated
per call, and compacting finished rows moves rows within the storage. So every tensor a
compiled decode step mutates (keys, values, mask) keeps its address for the engine's life: they
are marked static addresses (torch._dynamo.mark_static_address): inductor skips CUDA graphs for
a graph that mutates any input not static (and re-records one when a static address moves). The
full tensors reach the compiled step (a slice made outside it would be a new tensor, not marked),
and the step slices them by Python ints (the rows, the attended length) it is specialised on.

A decode step attends over the filled prefix rounded up by :func:`attended_length`, not over the
whole storage, so a step's cost follows the context rather than the longest a call may reach.

How it reaches the model: transformers' attention modules compute q, k and v, then call the
attention function named by ``config._attn_implementation`` with the keyword arguments the model
was called with. :func:`cached_attention` is registered under ``ATTENTION``; the decode loop calls
the model with ``use_cache=False`` and ``kv_cache=<KVCache>``, so transformers keeps no cache of
its own, and with a 4-D mask, which transformers passes through untouched (its mask code, which
reads the mask on the host, never runs).

Rows are left-padded, so every row's next token goes to the same column.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from device import attention_mask_dtype

ATTENTION = "dapo_kv_cache"
# Attended lengths: multiples of 16 up to 64, then four per doubling (80, 96, 112, 128, 160, ...),
# so a step attends over at most a quarter more positions than are filled, and the step shapes a
# run compiles grow with the log of the context. bench/decode.py, a call from 17 to 4,096
# positions, against attending over exactly those filled: 1.02x the time with 27 shapes; powers of
# two 1.08x with 8; multiples of 16 1.00x with 255; the whole storage 1.23x.
ATTENDED_GRANULE = 16
ATTENDED_PER_DOUBLING = 4


def attended_length(filled: int, length: int) -> int:
    """The positions a decode step attends over when ``filled`` of them are written (the fed
    token's included), in a storage of ``length``: ``filled`` rounded up to the next attended
    length (ATTENDED_GRANULE, ATTENDED_PER_DOUBLING), at most ``length``."""
    below = 1 << max(filled - 1, 1).bit_length() - 1  # the largest power of two under filled
    granule = max(ATTENDED_GRANULE, below // ATTENDED_PER_DOUBLING)
    return min(-(-filled // granule) * granule, length)


def attended_lengths(length: int) -> int:
    """How many distinct lengths :func:`attended_length` gives in a storage of ``length``."""
    return len({attended_length(filled, length) for filled in range(1, length + 1)})


class KVCache:
    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers, self.kv_heads = config.num_hidden_layers, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype, self.device = dtype, device
        self.mask_dtype = attention_mask_dtype(device.type, dtype)
        self.closed, self.opened = (False, True) if self.mask_dtype == torch.bool else (float("-inf"), 0.0)
        self.capacity = (0, 0)  # (rows, length) of the storage
        self.keys: Optional[torch.Tensor] = None  # [layers, rows, kv heads, length, head dim]
        self.values: Optional[torch.Tensor] = None
        # [rows, length]: 0 (or True) where a key is attended, -inf (or False) elsewhere
        self.mask: Optional[torch.Tensor] = None
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the next token's key goes
        self.rows = 0  # the current batch's: the storage's leading rows
        self.filled = 0  # the column, on the host
        self.attended = 0  # attended_length of the next decode step

    def reserve(self, rows: int, length: int) -> None:
        """Storage for calls of up to ``rows`` rows and ``length`` positions: the tensors there
        are, unless they are smaller (then new ones, as large as both)."""
        rows, length = max(rows, self.capacity[0]), max(length, self.capacity[1])
        if (rows, length) == self.capacity:
            return
        self.keys = self.values = self.mask = None  # freed before the larger ones are allocated
        shape = (self.layers, rows, self.kv_heads, length, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.mask = torch.full((rows, length), self.closed, dtype=self.mask_dtype, device=self.device)
        for tensor in (self.keys, self.values, self.mask, self.column):
            torch._dynamo.mark_static_address(tensor)
        self.capacity = (rows, length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.mask) if t is not None)

    def prefill_mask(self, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Starts a call: the prompt's 4-D mask (causal, padding keys masked) and, for the decode
        steps, the mask over every position: the prompt's real tokens open, the rest closed until
        written."""
        self.rows, width = prompt_mask.shape
        assert self.rows <= self.capacity[0] and width < self.capacity[1], "reserve the cache for the call first"
        mask = self.mask[:self.rows]
        mask.fill_(self.closed)
        mask[:, :width].masked_fill_(prompt_mask, self.opened)
        self.column.fill_(width)
        self.filled, self.attended = width, attended_length(width + 1, self.capacity[1])
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & prompt_mask[:, None, :]
        # A padding position attends to nothing; letting it attend to everything instead keeps
        # its (never used) output finite, as transformers' own sdpa mask does.
        allowed |= ~allowed.any(-1, keepdim=True)
        return allowed[:, None]

    def decode_mask(self) -> torch.Tensor:
        """Opens the column of the token about to be fed (it attends to itself): the step's 4-D mask."""
        mask = self.mask[:self.rows]
        mask.index_fill_(1, self.column, self.opened)
        return mask[:, None, None, :self.attended]

    def advance(self) -> None:
        """After a decode step (outside it: a compiled step is specialised on ``attended``, not on
        the column)."""
        self.column.add_(1)
        self.filled += 1
        self.attended = attended_length(self.filled + 1, self.capacity[1])

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows from now on (finished rows compacted out), moved to the storage's
        leading rows."""
        size, filled = rows.numel(), self.filled
        for storage in (self.keys, self.values):
            storage[:, :size, :, :filled] = storage[:, :, :, :filled].index_select(1, rows)
        self.mask[:size, :filled] = self.mask[:, :filled].index_select(0, rows)
        self.rows = size

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values; those attended (prefill: the prompt's)."""
        keys, values = self.keys[layer, :self.rows], self.values[layer, :self.rows]
        steps = key.shape[2]
        if steps > 1:  # the prompt, from column 0
            keys[:, :, :steps].copy_(key)
            values[:, :, :steps].copy_(value)
            return keys[:, :, :steps], values[:, :, :steps]
        keys.index_copy_(2, self.column, key)
        values.index_copy_(2, self.column, value)
        return keys[:, :, :self.attended], values[:, :, :self.attended]


def cached_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor, *, kv_cache: KVCache, scaling: Optional[float] = None,
                     dropout: float = 0.0, sliding_window: Optional[int] = None,
                     **_: Any) -> tuple[torch.Tensor, None]:
    """Attention over the cache, in transformers' attention-function signature."""
    assert sliding_window is None, "the built-in engine's KV cache has no sliding-window attention"
    keys, values = kv_cache.write(module.layer_idx, key, value)
    rows, heads, steps, head_dim = query.shape
    groups = heads // keys.shape[1]
    if steps == 1:
        # One query per row: a key-value head's query heads become its query rows, so grouped
        # heads read the cache as it is, without a copy repeated per query head.
        out = F.scaled_dot_product_attention(query.reshape(rows, keys.shape[1], groups, head_dim), keys, values,
                                             attn_mask=attention_mask, scale=scaling)
        # reshape, not view: CUDA's kernels return [rows, groups, kv heads, dim] memory under this
        # shape, which no view merges into heads (the CPU's returns it contiguous)
        return out.reshape(rows, 1, heads, head_dim), None
    if groups > 1:  # the prompt, once per batch
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def attending_through_cache(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention is :func:`cached_attention` inside the block and what it was after
    it, so no other model holding the same config meets our attention function."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, cached_attention)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
