"""The built-in engine's decode loop on a model wider than the demo's (issue 22), paired in one run.

    OMP_NUM_THREADS=1 python bench/decode.py [--hidden 512] [--layers 4] [--experts 16] [--top_k 4]
        [--rows 16] [--prompt_len 16] [--short 32] [--long 512] [--context 4096] [--rounds 3] [--no-compile]

A random Qwen3-MoE (hidden 512, 4 layers, 16 experts top-4 by default), its bf16 and FP8
rollout copies; every case generates ``rows`` responses with no stop id (so every row runs the
whole length) after the same prompts, the cases taking turns within each round so that the
machine's load falls on all alike. Prints each case's tokens/s (prefill included) and, as the
median over rounds of the per-round ratios:

- long / short: tokens/s at ``long`` new tokens over ``short`` (issue 22: >= 0.8; the loop before
  it grew its cache by concatenation, so the longer the context, the slower each step);
- FP8 / bf16 (issue 22: >= 0.7 on the CPU);
- compiled / eager (rollout_compile: the decode step through torch.compile, inductor; the first
  call, which compiles, is not timed);
- new / old: this loop against the one before kv_cache.py (kept below, as it was).

Then the attended length (kv_cache.attended_length): one bf16 decode step's time attending over
64, 128, ... ``context`` positions, and from those (interpolated) the time of a call's steps from
the prompt to ``context`` positions under three ways of rounding the filled prefix up, against
attending over exactly the filled positions, with the distinct step shapes each compiles (per
row count); and attending over the whole storage, as the loop before the filled prefix did.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine_builtin  # noqa: E402
from device import decode_compile_mode, experts_implementation  # noqa: E402
from engine import Generation, Sampling  # noqa: E402
from fp8 import convert_to_fp8  # noqa: E402
from kv_cache import attended_length, attending_through_cache  # noqa: E402


@torch.no_grad()
def old_generate(model, prompt_ids, prompt_mask, *, max_new_tokens, stop_ids, pad_id, sampling, generator):
    """The decode loop before kv_cache.py: transformers' DynamicCache and the attention mask
    grown by concatenation every token, a host read of "all stopped?" every token."""
    from transformers import DynamicCache

    n = prompt_ids.shape[0]
    attention = prompt_mask.long()
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    finished = torch.zeros(n, dtype=torch.bool)
    tokens, logps, masks = [], [], []
    cache = DynamicCache(config=model.config)
    next_input, positions = prompt_ids, (attention.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max_new_tokens):
        out = model(input_ids=next_input, attention_mask=attention, position_ids=positions, use_cache=True,
                    logits_to_keep=1, past_key_values=cache)
        logits = out.logits[:, -1, :].float() / sampling.temperature
        token = logits.argmax(-1) if sampling.greedy else torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0))
        masks.append(~finished)
        finished = finished | torch.isin(token, stop)
        if bool(finished.all()):
            break
        next_input = token[:, None]
        attention = torch.cat([attention, torch.ones((n, 1), dtype=attention.dtype)], dim=-1)
        positions = positions[:, -1:] + 1
    return Generation(torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1), ~finished)


def build(args) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                            max_position_embeddings=args.prompt_len + args.long + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              experts_implementation=experts_implementation("cpu")).eval()
    return {"bf16": copy.deepcopy(policy).to(torch.bfloat16),
            "fp8": convert_to_fp8(copy.deepcopy(policy), torch.bfloat16)}


def attended_step_seconds(model, ids, mask, context: int, rounds: int) -> dict[int, float]:
    """The median seconds of one eager decode step attending over each power of two from 64 to
    ``context`` positions (the cache's attended length set by hand; what it reads is not the point)."""
    decoder = engine_builtin._Decoder(model, None)
    decoder.reserve(ids.shape[0], context)
    lengths = [64 << k for k in range((context // 64).bit_length())]
    token, positions = ids[:, -1], torch.full((ids.shape[0], 1), ids.shape[1])
    seconds = {length: [] for length in lengths}
    with torch.no_grad(), attending_through_cache(model):
        decoder.prefill(ids, mask, torch.arange(ids.shape[1]).expand_as(ids))
        for _ in range(rounds):
            for length in lengths:
                decoder.cache.attended = length
                start = time.perf_counter()
                decoder.step(token, positions)
                seconds[length].append(time.perf_counter() - start)
    return {length: statistics.median(times) for length, times in seconds.items()}


def print_attended(seconds: dict[int, float], prompt_len: int, context: int) -> None:
    lengths = list(seconds)
    step = lambda attended: np.interp(attended, lengths, [seconds[n] for n in lengths])  # noqa: E731
    filled = range(prompt_len + 1, context + 1)
    exact = sum(step(f) for f in filled)
    print(f"a decode step attending over {', '.join(str(n) for n in lengths)} positions: "
          + ", ".join(f"{seconds[n] * 1000:.1f}" for n in lengths) + " ms")
    rules = {"multiples of 16": lambda f: -(-f // 16) * 16,
             "four per doubling (this loop)": lambda f: attended_length(f, context),
             "powers of two": lambda f: 1 << (f - 1).bit_length()}
    print(f"a call's steps from {prompt_len + 1} to {context} filled positions, against attending over exactly them:")
    for name, rule in rules.items():
        attended = [min(rule(f), context) for f in filled]
        print(f"  {name:<30} {sum(step(a) for a in attended) / exact:.3f}   {len(set(attended))} step shapes")
    print(f"  {'the whole storage':<30} {step(context) * len(filled) / exact:.3f}   1 step shape")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 512), ("layers", 4), ("experts", 16), ("top_k", 4), ("moe_intermediate", 256),
                          ("vocab", 4096), ("rows", 16), ("prompt_len", 16), ("short", 32), ("long", 512),
                          ("context", 4096), ("rounds", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args(argv)
    models = build(args)
    ids = torch.randint(1, args.vocab, (args.rows, args.prompt_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    sampling = Sampling(temperature=1.0)
    eager = {name: engine_builtin._Decoder(model, None) for name, model in models.items()}
    compiled = engine_builtin._Decoder(models["bf16"], decode_compile_mode("cpu", True)) if args.compile else None

    def new(name, length, decoder=None):
        return lambda: engine_builtin.generate(models[name], ids, mask, max_new_tokens=length, stop_ids=[], pad_id=0,
                                               sampling=sampling, generator=torch.Generator().manual_seed(0),
                                               decoder=decoder or eager[name])

    def old(length):
        return lambda: old_generate(models["bf16"], ids, mask, max_new_tokens=length, stop_ids=[], pad_id=0,
                                    sampling=sampling, generator=torch.Generator().manual_seed(0))

    cases = {"bf16 short": (new("bf16", args.short), args.short), "bf16 long": (new("bf16", args.long), args.long),
             "fp8 short": (new("fp8", args.short), args.short),
             "old short": (old(args.short), args.short), "old long": (old(args.long), args.long)}
    if compiled is not None:
        cases["compiled short"] = (new("bf16", args.short, compiled), args.short)
        start = time.perf_counter()
        cases["compiled short"][0]()  # compiles the step for this shape
        print(f"compiling the decode step: {time.perf_counter() - start:.1f} s")
    speed = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (run, length) in cases.items():
            start = time.perf_counter()
            run()
            speed[name].append(args.rows * length / (time.perf_counter() - start))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(speed[a], speed[b]))  # noqa: E731
    print(f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, {args.rows} rows, "
          f"prompt {args.prompt_len}, short {args.short} / long {args.long} new tokens, torch threads "
          f"{torch.get_num_threads()}, {args.rounds} rounds")
    for name in cases:
        print(f"  {name:<15} {statistics.median(speed[name]):9.1f} tokens/s")
    print(f"long / short, this loop:       {ratio('bf16 long', 'bf16 short'):.3f}   (target >= 0.8)")
    print(f"long / short, the old loop:    {ratio('old long', 'old short'):.3f}")
    print(f"FP8 / bf16:                    {ratio('fp8 short', 'bf16 short'):.3f}   (target >= 0.7)")
    if compiled is not None:
        print(f"compiled / eager:              {ratio('compiled short', 'bf16 short'):.3f}")
    print(f"new / old loop, short:         {ratio('bf16 short', 'old short'):.3f}")
    print(f"new / old loop, long:          {ratio('bf16 long', 'old long'):.3f}")
    print_attended(attended_step_seconds(models["bf16"], ids, mask, args.context, 5 * args.rounds), args.prompt_len,
                   args.context)


if __name__ == "__main__":
    main()
