"""The built-in engine's KV cache: allocated once per generation batch, written in place.

Keys and values of every layer for rows x (prompt width + max_new_tokens) positions, an attention
mask over those positions (additive, or bool where the platform takes no other:
device.attention_mask_dtype) and the column the next token's key goes to; no tensor grows with
the step (transformers' DynamicCache concatenates the whole cache every token).

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


class KVCache:
    def __init__(self, config: Any, *, rows: int, length: int, device: torch.device) -> None:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers, self.rows, self.length, self.device = config.num_hidden_layers, rows, length, device
        self.keys: Optional[torch.Tensor] = None  # [layers, rows, kv heads, length, head dim], on first write
        self.values: Optional[torch.Tensor] = None
        # [rows, length]: 0 (or True) where a key is attended, -inf (or False) elsewhere
        self.mask: Optional[torch.Tensor] = None
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the next token's key goes

    def prefill_mask(self, prompt_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The prompt's 4-D mask (causal, padding keys masked) and, for the decode steps, the
        mask over every position: the prompt's real tokens open, the rest closed until written."""
        width = prompt_mask.shape[1]
        mask_dtype = attention_mask_dtype(self.device.type, dtype)
        closed, self.opened = (False, True) if mask_dtype == torch.bool else (float("-inf"), 0.0)
        self.mask = torch.full((self.rows, self.length), closed, dtype=mask_dtype, device=self.device)
        self.mask[:, :width].masked_fill_(prompt_mask, self.opened)
        self.column.fill_(width)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & prompt_mask[:, None, :]
        # A padding position attends to nothing; letting it attend to everything instead keeps
        # its (never used) output finite, as transformers' own sdpa mask does.
        allowed |= ~allowed.any(-1, keepdim=True)
        return allowed[:, None]

    def decode_mask(self) -> torch.Tensor:
        """Opens the column of the token about to be fed (it attends to itself): the step's 4-D mask."""
        self.mask.index_fill_(1, self.column, self.opened)
        return self.mask[:, None, None, :]

    def advance(self) -> None:
        self.column.add_(1)

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows from now on (finished rows compacted out)."""
        self.keys, self.values, self.mask = (t.index_select(1 if t.dim() == 5 else 0, rows)
                                             for t in (self.keys, self.values, self.mask))
        self.rows = rows.numel()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values; its keys and values so far (prefill: the prompt's)."""
        if self.keys is None:
            shape = (self.layers, self.rows, key.shape[1], self.length, key.shape[3])
            self.keys = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values = torch.zeros(shape, dtype=value.dtype, device=value.device)
        keys, values = self.keys[layer], self.values[layer]
        steps = key.shape[2]
        if steps > 1:  # the prompt, from column 0
            keys[:, :, :steps].copy_(key)
            values[:, :, :steps].copy_(value)
            return keys[:, :, :steps], values[:, :, :steps]
        keys.index_copy_(2, self.column, key)
        values.index_copy_(2, self.column, value)
        return keys, values


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
        return out.view(rows, heads, 1, head_dim).transpose(1, 2), None
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
