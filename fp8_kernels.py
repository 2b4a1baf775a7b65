"""FP8 weights' values and matmuls: e4m3 codes to and from float32, the conversion into one
shared workspace in the compute dtype, and the linear, grouped and batched matmuls fp8.py's
layers run. Moved out of device.py, which keeps what a platform can hold (fp8_storage_dtype);
the per-platform tables here say how these kernels run best on each one, measured."""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from device import fp8_storage_dtype, kind_of


# --- FP8 matmuls -------------------------------------------------------------------------------
# fp8.py holds weights as float8_e4m3fn values V with one float32 scale s per output row:
# W = V * s[:, None]. Every e4m3 value is exactly a bf16 (and fp32) value, so the matmuls below
# convert V, exactly, into one reused workspace in the compute dtype, multiply there, and apply s
# to the matmul's output rows in float32 (y = (x @ V.T) * s, rounded once more to x's dtype):
# the weight-only FP8 scheme of W8A16 kernels, where the scale sits in the epilogue. Against
# multiplying by bf16(V * s) (this build before) that moves where the rounding falls (float
# noise, tests/test_fp8_kernels.py), converts 1 byte per weight instead of building an fp32 and
# then a bf16 copy, and costs one multiply per output instead of one per weight.

# Every platform multiplies this way for now. Not written: a native scaled FP8 GEMM
# (torch._scaled_mm / _scaled_grouped_mm on CUDA sm90+, torch_npu's npu_quant_matmul /
# npu_grouped_matmul). It quantizes the activations to FP8 too, which changes the numbers well
# beyond float noise, and nothing here can measure it (no GPU or NPU run; the CPU has no
# _scaled_grouped_mm). It would go behind fp8_linear's and fp8_grouped_linear's signatures,
# chosen per platform beside FP8_TO_COMPUTE, with these functions as the fallback.


# How float8 values become compute-dtype values, per platform. "bits" (CPU, bf16): integer ops
# build the bf16 bit patterns, ~10x faster there than torch's float8 conversion, a scalar loop
# on the CPU. "cast" (the rest): torch's conversion (CUDA: a native kernel).
FP8_TO_COMPUTE = {"cpu": "bits", "cuda": "cast"}

# Elements encoded or decoded at once on FP8_AS_CODES platforms: bounds their int32 temporaries
# to 64 MiB each, where a layer's fused experts are ~400M weights.
FP8_CODE_CHUNK = 1 << 24


def fp8_values(scaled: torch.Tensor, stored_on: str) -> torch.Tensor:
    """``scaled`` (float32, |x| <= 448) rounded to e4m3 (to nearest, ties to even) and stored
    as fp8_storage_dtype(stored_on) gives: uint8 codes bit for bit torch's float8_e4m3fn."""
    if fp8_storage_dtype(stored_on) != torch.uint8:
        return scaled.to(torch.float8_e4m3fn)
    flat, codes = scaled.contiguous().view(-1), torch.empty(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for start in range(0, flat.numel(), FP8_CODE_CHUNK):
        part = slice(start, start + FP8_CODE_CHUNK)
        codes.view(-1)[part] = _e4m3_codes(flat[part])
    return codes


def _e4m3_codes(scaled: torch.Tensor) -> torch.Tensor:
    """c10's float32 -> float8_e4m3fn rounding (c10/util/Float8_e4m3fn.h), on int32 words."""
    bits = scaled.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    # normal results: drop 20 mantissa bits with round-to-nearest-even, rebias 127 -> 7
    odd = (magnitude >> 20) & 1
    normal = (magnitude + (0x7FFFF - (120 << 23)) + odd) >> 20
    # below e4m3's smallest normal (2^-6): adding 2^14 rounds |x| to a multiple of 2^-9, e4m3's
    # subnormal step, in the float32 adder; the low bits are then the code
    subnormal = (magnitude.view(torch.float32) + 2.0 ** 14).view(torch.int32) - (141 << 23)
    codes = torch.where(magnitude < (121 << 23), subnormal, normal) | ((bits >> 24) & 0x80)
    return codes.to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _e4m3_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 256 e4m3 values in ``dtype`` on ``device``, by code (made on the host, where float8 works)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(dtype).to(device)


def _decode_codes(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = the values of e4m3 ``codes`` (uint8), through the table: no float8 tensor."""
    table, flat = _e4m3_table(codes.device, out.dtype), codes.reshape(-1)
    for start in range(0, flat.numel(), FP8_CODE_CHUNK):
        part = slice(start, start + FP8_CODE_CHUNK)
        torch.index_select(table, 0, flat[part].to(torch.int32), out=out.view(-1)[part])
    return out


def fp8_values_as(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 values (float8_e4m3fn, or uint8 codes) as ``dtype`` values, exactly, in a new tensor."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    return _decode_codes(values, out) if values.dtype == torch.uint8 else out.copy_(values)


# One flat buffer per (device, dtype), as large as the largest FP8 weight converted so far, shared
# by every FP8 layer of the process: layers run one after another, and each matmul has read its
# weight before the next conversion overwrites it (the device runs a stream's kernels in order).
# Its size is one weight, the largest: a layer's fused experts (Qwen3-30B-A3B's gate_up_proj,
# 128 x 1536 x 2048 in bf16: 0.8 GB), never a bf16 copy of the model.
_FP8_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def free_fp8_workspace() -> None:
    """Drop the conversion buffers (the next FP8 matmul allocates them again)."""
    _FP8_WORKSPACE.clear()


# What the CPU's bit-level conversion leaves out: its values are V * 2^-120 (below). The matmuls
# apply the factor with the output scales, in float32, instead of a pass over every weight (on
# the CPU, a quarter of the conversion's time); the powers of two cancel exactly, so outputs are
# the same unless a matmul's output falls below bf16's normal range at 2^-120 (an output under
# ~3.5e-5 of its row's largest weight, where bf16 keeps fewer digits).
_BITS_FACTOR = 2.0 ** 120


def _fp8_values_scaled_as(values: torch.Tensor, dtype: torch.dtype, reuse: bool) -> tuple[torch.Tensor, float]:
    """(weight, factor): ``values`` == weight * factor exactly, weight in ``dtype`` in the shared
    workspace (or its own buffer: ``reuse`` False); factor 1 except on the CPU's bf16 path."""
    key, numel = (values.device, dtype), values.numel()
    buffer = _FP8_WORKSPACE.get(key) if reuse else None
    if buffer is None or buffer.numel() < numel:
        if reuse:
            _FP8_WORKSPACE.pop(key, None)  # free the smaller one before allocating
        buffer = torch.empty(numel, dtype=dtype, device=values.device)
        if reuse:
            _FP8_WORKSPACE[key] = buffer
    out = buffer[:numel].view(values.shape)
    if values.dtype == torch.uint8:  # codes (FP8_AS_CODES)
        return _decode_codes(values, out), 1.0
    if dtype != torch.bfloat16 or FP8_TO_COMPUTE.get(kind_of(values.device.type)) != "bits":
        return out.copy_(values), 1.0
    # e4m3 sign|eeee|mmm -> bf16 sign|0000eeee|mmm0000: the int8 sign-extends into int16, the shift
    # puts e and m under bf16's exponent and mantissa, the mask keeps the sign bit alone above
    # them. That is V * 2^-120 (bf16's exponent bias is 127, e4m3's 7; e = 0, e4m3's subnormals,
    # reads as bf16 subnormals with the same mantissa): _BITS_FACTOR.
    # Not NaN-preserving (e4m3's NaN, 0x7f, reads as 480; quantize() never writes it), and it
    # relies on the CPU not flushing subnormals (torch's default; under
    # torch.set_flush_denormal(True) e4m3's subnormals, |V| < 2^-6, would read as 0).
    # The shift and the mask run on int32 words holding two codes (half the element operations);
    # a code's bits shifted across into its neighbour's lane fall under the neighbour's mask.
    bits = out.view(torch.int16)
    bits.copy_(values.view(torch.int8))
    if numel % 2 == 0:
        bits.view(-1).view(torch.int32).bitwise_left_shift_(4).bitwise_and_(-0x780F7810)  # 0x87f087f0
    else:
        bits.bitwise_left_shift_(4).bitwise_and_(-0x7810)  # 0x87f0
    return out, _BITS_FACTOR


def _reuse_workspace(x: torch.Tensor) -> bool:
    """Whether a matmul on ``x`` may use the shared workspace: not when autograd would keep the
    weight for a backward pass (the next layer overwrites it), nor inside a compiled graph, which
    plans its own buffers: a graph that writes a tensor from outside it is not captured in a CUDA
    graph (the H200 check: FP8 decode compiled without graphs, 1.7x eager where bf16 gained 5.2x)."""
    return not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling()


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W = values * scale[:, None] (FP8 values, one float32 scale per output row):
    (x @ values.T) in x's dtype, then times the scales in float32, rounded to x's dtype."""
    weight, factor = _fp8_values_scaled_as(values, x.dtype, _reuse_workspace(x))
    return torch.nn.functional.linear(x, weight).mul_(scale if factor == 1.0 else scale * factor)


# Rows of (token, expert) pairs whose output scales are gathered at once: bounds the float32
# [rows, N] gather of a long prefill (S = tokens x top-k) to ~100 MB at N = 1536; a decode step
# is one chunk.
FP8_SCALE_CHUNK_ROWS = 16384


def _scale_rows_(out: torch.Tensor, scale: torch.Tensor, expert_of_row: torch.Tensor,
                 row_weight: Optional[torch.Tensor], factor: float) -> torch.Tensor:
    """out[i] *= scale[expert_of_row[i]] * factor (* row_weight[i]), in float32, rounded to out's dtype."""
    if row_weight is not None:
        row_weight = row_weight.to(scale.dtype)
    for start in range(0, out.shape[0], FP8_SCALE_CHUNK_ROWS):
        part = slice(start, start + FP8_SCALE_CHUNK_ROWS)
        row_factor = scale.index_select(0, expert_of_row[part])
        if factor != 1.0:
            row_factor.mul_(factor)
        if row_weight is not None:
            row_factor.mul_(row_weight[part, None])
        out[part].mul_(row_factor)
    return out


def fp8_grouped_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, offsets: Optional[torch.Tensor],
                       expert_of_row: torch.Tensor, row_weight: Optional[torch.Tensor] = None,
                       counts: Optional[list[int]] = None) -> torch.Tensor:
    """Row i of ``x`` (rows sorted by expert) times its expert's W.T: [S, K] -> [S, N], with
    ``values`` [E, N, K], ``scale`` [E, N], ``offsets`` [E] the int32 end of each expert's rows,
    ``expert_of_row`` [S]; each output row also times ``row_weight`` (the routing weight) if given.

    One grouped GEMM over every expert's converted weights (torch._grouped_mm, through
    transformers' dispatcher: the kernel the bf16 experts run), no host read. With ``counts`` (the
    rows of each expert, read on the host by the caller: platforms without _grouped_mm, long
    prefills), one matmul per expert that has rows instead.
    """
    weight, factor = _fp8_values_scaled_as(values, x.dtype, _reuse_workspace(x))
    if counts is None:
        out = _grouped_mm(x, weight.transpose(-2, -1), offsets)
    else:
        out, start = x.new_empty(x.shape[0], values.shape[1]), 0
        for expert, rows in enumerate(counts):
            if rows:
                out[start:start + rows] = torch.nn.functional.linear(x[start:start + rows], weight[expert])
            start += rows
    return _scale_rows_(out, scale, expert_of_row, row_weight, factor)


# Where converting a whole weight before its matmul spills the cache (the CPU: 2 MiB of L2 a core
# on the machines measured), the batched matmul converts and multiplies the experts in parts of
# at most this many bytes once converted, so that it reads each part from the cache its
# conversion has just written it to. GPUs and NPUs convert with one fused kernel at full
# bandwidth: one part, every expert.
FP8_PART_BYTES = {"cpu": 1 << 20}


def _expert_parts(values: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[start, stop) over the experts of ``values`` [E, N, K]: all of them, or parts of at most
    FP8_PART_BYTES once converted to ``dtype`` (one expert each at least)."""
    limit, experts = FP8_PART_BYTES.get(kind_of(values.device.type)), values.shape[0]
    size = experts if limit is None else max(1, limit // (values[0].numel() * dtype.itemsize))
    return [(start, min(start + size, experts)) for start in range(0, experts, size)]


def fp8_batched_linear(x: torch.Tensor, values: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Every expert's W.T on every row: x [T, K] (the same rows for each expert) or [E, T, K]
    -> [E, T, N], with ``values`` [E, N, K], ``scale`` [E, N] (None: x @ values.T, the scaling
    left to the caller). No grouped GEMM, no host read.

    Computed as W @ x.T ([E, N, T], returned as its [E, T, N] view): with few rows that is one
    matmul of E x N rows over the shared x.T, which the CPU runs ~2x faster than E matmuls of T
    rows (it repacks the second operand, here x, not the weights)."""
    reuse, products = _reuse_workspace(x), []
    for start, stop in _expert_parts(values, x.dtype):
        weight, factor = _fp8_values_scaled_as(values[start:stop], x.dtype, reuse)
        rows = x.transpose(-2, -1) if x.dim() == 2 else x[start:stop].transpose(-2, -1)
        products.append(torch.matmul(weight, rows))
    out = (products[0] if len(products) == 1 else torch.cat(products)).transpose(-2, -1)
    if scale is None:
        return out if factor == 1.0 else out.mul_(factor)
    return out.mul_(scale.unsqueeze(-2) if factor == 1.0 else scale.unsqueeze(-2) * factor)


@functools.lru_cache(maxsize=None)
def _grouped_mm_kernel() -> Any:
    try:  # transformers' dispatcher: torch's grouped kernel or its fallback, as the bf16 experts get
        from transformers.integrations.moe import _grouped_mm
        return _grouped_mm
    except ImportError:  # a transformers without it
        return torch._grouped_mm


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm_kernel()(x, weight, offs=offsets)


# Platforms whose FP8 experts run "dense" (fp8.DENSE_MAX_PAIRS) though they have a grouped GEMM:
# the CPU's is one small matmul per expert, each repacking its expert's weights, where the dense
# path is one matmul per cache-sized part of the converted weights (fp8_batched_linear).
FP8_DENSE_EXPERTS_FIRST = {"cpu"}

