"""The built-in engine's decode loop on a model wider than the demo's (issue 22), paired in one run.

    OMP_NUM_THREADS=1 python bench/decode.py [--device cpu] [--hidden 512] [--layers 4] [--experts 16] [--top_k 4]
        [--rows 16] [--prompt_len 16] [--short 32] [--long 512] [--context 4096] [--rounds 3] [--no-compile]
        [--check]

A random Qwen3-MoE (hidden 512, 4 layers, 16 experts top-4 by default), its bf16 and FP8
rollout copies; every case generates ``rows`` responses with no stop id (so every row runs the
whole length) after the same prompts, the cases taking turns within each round so that the
machine's load falls on all alike. Prints each case's tokens/s (prefill included) and, as the
median over rounds of the per-round ratios:

- long / short: tokens/s at ``long`` new tokens over ``short`` (issue 22: >= 0.8; the loop before
  it grew its cache by concatenation, so the longer the context, the slower each step);
- FP8 / bf16 (issue 22: >= 0.7 on the CPU);
- compiled / eager (rollout_compile: the decode step through torch.compile, in
  device.decode_compile_mode's mode; the first call, which compiles, is not timed);
- new / old: this loop against the one before kv_cache.py (kept below, as it was).

Then the attended length (kv_cache.attended_length): one bf16 decode step's time attending over
64, 128, ... ``context`` positions, and from those (interpolated) the time of a call's steps from
the prompt to ``context`` positions under three ways of rounding the filled prefix up, against
attending over exactly the filled positions, with the distinct step shapes each compiles (per
row count); and attending over the whole storage, as the loop before the filled prefix did.

``--device`` (auto, cpu, cuda or npu; cpu by default, device.select_platform): the models are
built on the CPU, as seeded there, and moved to the device, where their copies are made; every
time is read once the device has run the work queued before it.

``--check``, bench/accelerator_check.sh's "decode" line, instead: bf16 and FP8, each eager and
compiled (device.decode_compile_mode; on CUDA, CUDA graphs), ``short`` new tokens per row. Per
case its decode step's ms (the median over rounds of a call of ``short`` new tokens less a call of
one, which holds the prefill, over the ``short`` - 1 steps between) and tokens/s, its first
call's seconds (a compiled case's compile), the ratios of speeds compiled / eager and FP8 / bf16,
the host syncs of one bf16 eager call (CUDA only), and last "PASS decode: ..." or
"FAIL decode: <why>" (exit status 1).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine_builtin  # noqa: E402
from device import Platform, decode_compile_mode, select_platform  # noqa: E402
from engine import Generation, Sampling  # noqa: E402
from fp8 import convert_to_fp8  # noqa: E402
from kv_cache import attended_length, attending_through_cache  # noqa: E402
from moe_kernels import experts_implementation  # noqa: E402

SAMPLING = Sampling(temperature=1.0)


@torch.no_grad()
def old_generate(model, prompt_ids, prompt_mask, *, max_new_tokens, stop_ids, pad_id, sampling, generator):
    """The decode loop before kv_cache.py: transformers' DynamicCache and the attention mask
    grown by concatenation every token, a host read of "all stopped?" every token."""
    from transformers import DynamicCache

    n, device = prompt_ids.shape[0], prompt_ids.device
    attention = prompt_mask.long()
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
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
        attention = torch.cat([attention, torch.ones((n, 1), dtype=attention.dtype, device=device)], dim=-1)
        positions = positions[:, -1:] + 1
    return Generation(torch.stack(tokens, 1), torch.stack(masks, 1), torch.stack(logps, 1), ~finished)


def build(args, plat: Platform) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                            max_position_embeddings=args.prompt_len + args.long + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              experts_implementation=experts_implementation(plat.kind)).eval()
    # the copies made on the device: FP8 values stored as that device stores them, converted by its kernels
    policy.to(plat.device)
    return {"bf16": copy.deepcopy(policy).to(torch.bfloat16),
            "fp8": convert_to_fp8(copy.deepcopy(policy), torch.bfloat16)}


def prompts(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts of ``prompt_len`` random tokens, no padding (drawn on the CPU: the same on every device)."""
    ids = torch.randint(1, args.vocab, (args.rows, args.prompt_len), generator=torch.Generator().manual_seed(1))
    return ids.to(device), torch.ones(ids.shape, dtype=torch.bool, device=device)


def decode(model, ids, mask, new_tokens: int, decoder: engine_builtin._Decoder) -> Generation:
    """``new_tokens`` per row through the built-in loop, no stop id (every row runs the whole length)."""
    # the loop draws its uniform numbers on the logits' device, from this generator: it must be there too
    return engine_builtin.generate(model, ids, mask, max_new_tokens=new_tokens, stop_ids=[], pad_id=0,
                                   sampling=SAMPLING, generator=torch.Generator(device=ids.device).manual_seed(0),
                                   decoder=decoder)


def wall_seconds(plat: Platform, run: Callable[[], Any]) -> float:
    """The wall seconds of ``run()``: a device runs queued work after the call that queued it
    returns, so the clock is read once the device has finished, before and after."""
    plat.synchronize()
    start = time.perf_counter()
    run()
    plat.synchronize()
    return time.perf_counter() - start


def attended_step_seconds(plat: Platform, model, ids, mask, context: int, rounds: int) -> dict[int, float]:
    """The median seconds of one eager decode step attending over each power of two from 64 to
    ``context`` positions (the cache's attended length set by hand; what it reads is not the point)."""
    decoder = engine_builtin._Decoder(model, None)
    decoder.reserve(ids.shape[0], context)
    lengths = [64 << k for k in range((context // 64).bit_length())]
    token, positions = ids[:, -1], torch.full((ids.shape[0], 1), ids.shape[1], device=ids.device)
    times = {length: [] for length in lengths}
    with torch.no_grad(), attending_through_cache(model):
        decoder.prefill(ids, mask, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        for _ in range(rounds):
            for length in lengths:
                decoder.cache.attended = length
                times[length].append(wall_seconds(plat, lambda: decoder.step(token, positions)))
    return {length: statistics.median(each) for length, each in times.items()}


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


def bench(args) -> None:
    plat = select_platform(args.device)
    plat.bind()
    models = build(args, plat)
    ids, mask = prompts(args, plat.device)
    eager = {name: engine_builtin._Decoder(model, None) for name, model in models.items()}
    compiled = engine_builtin._Decoder(models["bf16"], decode_compile_mode(plat.kind, True, torch.bfloat16)) \
        if args.compile else None

    def new(name, length, decoder=None):
        return lambda: decode(models[name], ids, mask, length, decoder or eager[name])

    def old(length):
        return lambda: old_generate(models["bf16"], ids, mask, max_new_tokens=length, stop_ids=[], pad_id=0,
                                    sampling=SAMPLING, generator=torch.Generator(device=plat.device).manual_seed(0))

    cases = {"bf16 short": (new("bf16", args.short), args.short), "bf16 long": (new("bf16", args.long), args.long),
             "fp8 short": (new("fp8", args.short), args.short),
             "old short": (old(args.short), args.short), "old long": (old(args.long), args.long)}
    if compiled is not None:
        cases["compiled short"] = (new("bf16", args.short, compiled), args.short)
        # compiles the step for this shape
        print(f"compiling the decode step: {wall_seconds(plat, cases['compiled short'][0]):.1f} s")
    speed = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (run, length) in cases.items():
            speed[name].append(args.rows * length / wall_seconds(plat, run))
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(speed[a], speed[b]))  # noqa: E731
    print(f"{plat.device}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"{args.rows} rows, prompt {args.prompt_len}, short {args.short} / long {args.long} new tokens, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds")
    for name in cases:
        print(f"  {name:<15} {statistics.median(speed[name]):9.1f} tokens/s")
    print(f"long / short, this loop:       {ratio('bf16 long', 'bf16 short'):.3f}   (target >= 0.8)")
    print(f"long / short, the old loop:    {ratio('old long', 'old short'):.3f}")
    print(f"FP8 / bf16:                    {ratio('fp8 short', 'bf16 short'):.3f}   (target >= 0.7)")
    if compiled is not None:
        print(f"compiled / eager:              {ratio('compiled short', 'bf16 short'):.3f}")
    print(f"new / old loop, short:         {ratio('bf16 short', 'old short'):.3f}")
    print(f"new / old loop, long:          {ratio('bf16 long', 'old long'):.3f}")
    print_attended(attended_step_seconds(plat, models["bf16"], ids, mask, args.context, 5 * args.rounds),
                   args.prompt_len, args.context)


# --check ------------------------------------------------------------------------------------------
# In this order: the eager cases and the host syncs (counted on an eager bf16 call) before any
# compile, so that their numbers come whatever a compile or a graph capture does to the process.
CHECK_PARTS = ("bf16 eager", "fp8 eager", "host syncs", "bf16 compiled", "fp8 compiled")
# label: (a, b), a's decode speed over b's
SPEEDUPS = {"bf16 compiled / eager": ("bf16 compiled", "bf16 eager"),
            "fp8 compiled / eager": ("fp8 compiled", "fp8 eager"),
            "fp8 / bf16 eager": ("fp8 eager", "bf16 eager")}


def measure_case(name: str, plat: Platform, model, compile_mode: Optional[str], ids, mask, args) -> dict[str, float]:
    """One case of the check on its own decoder (a compiled step is compiled per decoder): a first
    call, untimed, which compiles a compiled step's shapes, then per round a call of ``short`` new
    tokens and one of a single token (the prefill and the first token, no decode step): the
    median of their difference over the ``short`` - 1 decode steps between."""
    decoder = engine_builtin._Decoder(model, compile_mode)
    call = lambda new_tokens: lambda: decode(model, ids, mask, new_tokens, decoder)  # noqa: E731
    graphs, graph_skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    first = wall_seconds(plat, call(args.short))
    per_step = [(wall_seconds(plat, call(args.short)) - wall_seconds(plat, call(1))) / (args.short - 1)
                for _ in range(args.rounds)]
    result = {"ms": 1000 * statistics.median(per_step), "first_s": first,
              "graphs": counters["stats"]["unique_graphs"] - graphs,
              "graph_skips": counters["inductor"]["cudagraph_skips"] - graph_skips}
    compiling = "" if compile_mode is None else f", graphs compiled: {result['graphs']}" + (
        f", {result['graph_skips']} CUDA-graph skips" if compile_mode == "reduce-overhead" else "")
    print(f"  {name:<14} {result['ms']:8.2f} ms/step {args.rows * 1000 / result['ms']:10.0f} tokens/s   "
          f"first call {first:.1f} s{compiling}")
    return result


def host_syncs(plat: Platform, model, ids, mask, args) -> Optional[int]:
    """How many times one eager call of ``short`` new tokens waits for the device: the
    synchronizing CUDA calls (device-to-host copies, stream synchronizations) torch warns of in
    its sync debug mode "warn", each a TORCH_WARN in c10's warn_or_error_on_sync, which reaches
    Python as a UserWarning. None off CUDA, where torch has no such mode."""
    syncs = None
    if plat.kind == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # each warning, not only the first from its line
            torch.cuda.set_sync_debug_mode("warn")
            try:
                decode(model, ids, mask, args.short, engine_builtin._Decoder(model, None))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing CUDA operation" in str(warning.message) for warning in caught)
    print(f"host syncs: n/a on {plat.kind}" if syncs is None else
          f"host syncs: {syncs} in {args.short} decode steps ({syncs / args.short:.2f} per step)")
    return syncs


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def check(args) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # the log keeps these lines in order among stderr's
    try:
        plat = select_platform(args.device)
        plat.bind()
        models = build(args, plat)
    except Exception as error:
        traceback.print_exc()
        print(f"FAIL decode: setting up {args.device} and the models: {one_line(error)}")
        return 1
    ids, mask = prompts(args, plat.device)
    mode = decode_compile_mode(plat.kind, True, torch.bfloat16)  # FP8 rollout models compute in bf16 too
    params = sum(p.numel() for p in models["bf16"].parameters())
    print(f"{plat.device_name() or plat.device}: {params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} "
          f"layers, {args.experts} experts top-{args.top_k}, vocab {args.vocab}), {args.rows} rows, prompt "
          f"{args.prompt_len}, {args.short} new tokens, {args.rounds} rounds; compiled: torch.compile mode {mode}")

    def part(name: str) -> Callable[[], Any]:
        if name == "host syncs":
            return lambda: host_syncs(plat, models["bf16"], ids, mask, args)
        dtype, kind = name.split()
        return lambda: measure_case(name, plat, models[dtype], mode if kind == "compiled" else None, ids, mask, args)

    results, failures = {}, {}
    for name in CHECK_PARTS:
        try:
            results[name] = part(name)()
        except Exception as error:  # named on the FAIL line; the other parts still run
            traceback.print_exc()
            failures[name] = one_line(error)
    ratios = {label: results[b]["ms"] / results[a]["ms"] for label, (a, b) in SPEEDUPS.items()
              if a in results and b in results}
    for label, ratio in ratios.items():
        print(f"{label + ' speed:':<30} {ratio:.2f}x")
    if failures:
        print("FAIL decode: " + "; ".join(f"{name}: {why}" for name, why in failures.items()))
        return 1
    print(passed(plat, args, params, mode, results, ratios))
    return 0


def passed(plat: Platform, args, params: int, mode: str, results: dict[str, Any], ratios: dict[str, float]) -> str:
    """The check's last line when every part ran."""
    def cases(dtype: str) -> str:
        eager, compiled = results[f"{dtype} eager"], results[f"{dtype} compiled"]
        skips = f", {compiled['graph_skips']} CUDA-graph skips" if mode == "reduce-overhead" else ""
        return (f"{dtype} eager {eager['ms']:.2f}, compiled {compiled['ms']:.2f} "
                f"({ratios[f'{dtype} compiled / eager']:.2f}x; compile {compiled['first_s']:.0f} s{skips})")

    syncs = results["host syncs"]
    return (f"PASS decode: {plat.device_name() or plat.device}, {params / 1e9:.2f}B params, {args.rows} rows x "
            f"{args.short} tokens; ms/step {cases('bf16')}, {cases('fp8')}; fp8/bf16 eager "
            f"{ratios['fp8 / bf16 eager']:.2f}x; host syncs "
            + (f"n/a on {plat.kind}" if syncs is None else f"{syncs / args.short:.2f}/step"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 512), ("layers", 4), ("experts", 16), ("top_k", 4), ("moe_intermediate", 256),
                          ("vocab", 4096), ("rows", 16), ("prompt_len", 16), ("short", 32), ("long", 512),
                          ("context", 4096), ("rounds", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda", "npu"))
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--check", action="store_true", help="the accelerator check's short run (module docstring)")
    args = parser.parse_args(argv)
    if args.check and args.short < 2:
        parser.error("--check times the decode steps after the first token: --short must be at least 2")
    if args.check:
        return check(args)
    bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
