"""FP8 against bf16 rollout weights on Qwen3-30B-A3B's layer geometry: memory, greedy agreement,
log-prob gap.

    python bench/fp8_rollout.py [--layers 2] [--vocab 8192] [--prompts 8] [--prompt_len 32] [--new_tokens 32]

Builds a Qwen3-MoE with the 30B-A3B layer shapes (hidden 2048, 32 query / 4 KV heads of 128,
128 experts with 8 active, moe_intermediate 768) and a smaller vocabulary, with random weights
(initializer_range 0.02, as the model's config), on the CPU, in fp32; makes a bf16 and an FP8
copy (fp8.py); prints the bytes of both rollout copies, how many greedy tokens agree over random
prompts (free-running, and on the same context), and the mean |logp_fp8 - logp_bf16| over
tokens sampled from the bf16 copy, with bf16 against fp32 beside it as the scale of rounding
that any bf16 rollout already carries. Random weights give nearly flat next-token
distributions, so a greedy choice flips at the smallest perturbation: read the agreement
beside the bf16-vs-fp32 row, and see tests/test_fp8.py for a trained model.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8 import convert_to_fp8, weight_bytes  # noqa: E402
from engine import Sampling  # noqa: E402
from engine_builtin import generate  # noqa: E402


def geometry_model(layers: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=4096,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def token_logprobs(model, ids: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """[N, R, V] float32 log-probs of every next token along ``response`` (teacher-forced)."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, response], 1)).logits[:, ids.shape[1] - 1:-1].float()
    return logits.log_softmax(-1)


def compare(name: str, test, reference, ids: torch.Tensor, new_tokens: int) -> None:
    """Greedy agreement (free-running and on the same context) and the log-prob gap on sampled tokens."""
    run = lambda model, **kw: generate(model, ids, torch.ones_like(ids, dtype=torch.bool),  # noqa: E731
                                       max_new_tokens=new_tokens, stop_ids=[-1], pad_id=0, **kw)
    greedy = run(reference, sampling=Sampling(greedy=True)).response_ids
    free = (run(test, sampling=Sampling(greedy=True)).response_ids == greedy).float().mean()
    forced = (token_logprobs(test, ids, greedy).argmax(-1) == token_logprobs(reference, ids, greedy).argmax(-1))
    sampled = run(reference, generator=torch.Generator().manual_seed(2)).response_ids
    pick = lambda logp: logp.gather(-1, sampled[..., None])[..., 0]  # noqa: E731
    gap = (pick(token_logprobs(test, ids, sampled)) - pick(token_logprobs(reference, ids, sampled))).abs()
    print(f"{name:<14} | greedy tokens equal: free-running {free:.3f}, same context {forced.float().mean():.3f} "
          f"| mean |dlogp| on sampled tokens {gap.mean():.4f} (max {gap.max():.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=32)
    args = parser.parse_args()
    start = time.perf_counter()
    fp32 = geometry_model(args.layers, args.vocab)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fp8 = convert_to_fp8(copy.deepcopy(fp32), torch.bfloat16).eval()
    print(f"built in {time.perf_counter() - start:.0f}s: {sum(p.numel() for p in fp32.parameters()) / 1e9:.2f}B params")
    ratio = weight_bytes(fp8) / weight_bytes(bf16)
    print(f"rollout weight bytes: bf16 {weight_bytes(bf16) / 2**30:.2f} GiB, fp8 {weight_bytes(fp8) / 2**30:.2f} GiB "
          f"(ratio {ratio:.3f})")
    ids = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(1))
    compare("fp8 vs bf16", fp8, bf16, ids, args.new_tokens)
    compare("bf16 vs fp32", bf16, fp32, ids, args.new_tokens)  # the rounding every bf16 rollout already has


if __name__ == "__main__":
    main()
