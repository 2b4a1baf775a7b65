"""FP8 against bf16 rollout decode speed on the CPU, before and after the grouped FP8 experts
(issue 22, item 4), as paired medians in one run.

    OMP_NUM_THREADS=1 python bench/decode_fp8.py [--hidden 512] [--layers 4] [--experts 16] [--top_k 4]
        [--batch 48] [--prompt_len 16] [--steps 8] [--rounds 5]

Builds a random Qwen3-MoE wider than the demo (hidden 512, 4 layers, 16 experts by default) and
three rollout copies of it: bf16 (transformers' experts kernel for the CPU, grouped_mm), FP8 as
fp8.py builds it now, and FP8 with this build's former forward passes ("before": one expert at a
time, a host read per expert, and an fp32 then a bf16 copy of each weight per matmul; kept
here, as it was). Each round prefills ``batch`` prompts in every copy, then times ``steps``
greedy decode steps of each, the copies taking turns, so the machine's load falls on all alike.
Prints each copy's median step time and FP8 speed / bf16 speed (the issue's target: >= 0.7),
the median over rounds of the per-round ratios beside it; and how many greedy tokens the two
FP8 forms agree on.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from device import experts_implementation  # noqa: E402
from fp8 import Fp8Experts, Fp8Linear, convert_to_fp8  # noqa: E402


def legacy_fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    weight = (values.float() * scale.float().unsqueeze(-1)).to(x.dtype)
    return torch.nn.functional.linear(x, weight)


def legacy_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return legacy_fp8_linear(x, self.weight.values, self.weight.scale)


def legacy_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    hit = torch.zeros(self.num_experts, dtype=torch.bool, device=top_k_index.device)
    hit[top_k_index.flatten()] = True
    for expert in hit.nonzero().flatten().tolist():
        token, slot = torch.where(top_k_index == expert)
        gate_up = legacy_fp8_linear(hidden_states[token], self.gate_up_proj.values[expert],
                                    self.gate_up_proj.scale[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        down = legacy_fp8_linear(self.act_fn(gate) * up, self.down_proj.values[expert], self.down_proj.scale[expert])
        out.index_add_(0, token, (down * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def use_legacy_forward(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.forward = types.MethodType(legacy_linear_forward, module)
        elif isinstance(module, Fp8Experts):
            module.forward = types.MethodType(legacy_experts_forward, module)
    return model


def build(args) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.hidden // 64, num_key_value_heads=2, head_dim=64,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                            max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              experts_implementation=experts_implementation("cpu")).eval()
    return {"bf16": copy.deepcopy(policy).to(torch.bfloat16),
            "fp8 before": use_legacy_forward(convert_to_fp8(copy.deepcopy(policy), torch.bfloat16)),
            "fp8 after": convert_to_fp8(copy.deepcopy(policy), torch.bfloat16)}


@torch.no_grad()
def decode(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of each of ``steps`` greedy decode steps after a prefill of ``ids``, and the tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    token = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache}).logits[:, -1].argmax(-1)
    seconds, tokens = [], [token]
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(input_ids=token[:, None], use_cache=True, logits_to_keep=1, **{key: cache}).logits
        token = logits[:, -1].argmax(-1)
        seconds.append(time.perf_counter() - start)
        tokens.append(token)
    return seconds, torch.stack(tokens, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 512), ("layers", 4), ("experts", 16), ("top_k", 4), ("moe_intermediate", 256),
                          ("vocab", 4096), ("batch", 48), ("prompt_len", 16), ("steps", 8), ("rounds", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    models = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    steps = {name: [] for name in models}
    ratios = {name: [] for name in models if name != "bf16"}
    tokens = {}
    for _ in range(args.rounds):
        medians = {}
        for name, model in models.items():
            seconds, tokens[name] = decode(model, ids, args.steps)
            steps[name] += seconds
            medians[name] = statistics.median(seconds)
        for name in ratios:
            ratios[name].append(medians["bf16"] / medians[name])
    print(f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"moe_intermediate {args.moe_intermediate}, batch {args.batch}, torch threads {torch.get_num_threads()}; "
          f"{args.rounds} rounds x {args.steps} decode steps")
    bf16 = statistics.median(steps["bf16"])
    print(f"{'bf16':<11} {1e3 * bf16:8.1f} ms/step")
    for name in ratios:
        median = statistics.median(steps[name])
        print(f"{name:<11} {1e3 * median:8.1f} ms/step | FP8/bf16 speed {bf16 / median:.3f} "
              f"(median of per-round ratios {statistics.median(ratios[name]):.3f})")
    agree = (tokens["fp8 after"] == tokens["fp8 before"]).float().mean()
    print(f"greedy tokens equal, fp8 after vs before: {agree:.4f}")


if __name__ == "__main__":
    main()
