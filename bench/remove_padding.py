"""Padding-free learner forwards (use_remove_padding, use_dynamic_bsz): computed / real tokens and
the learner's step time, padded vs packed, on two workloads, in one run.

    PYTHONPATH=. python bench/remove_padding.py [--out runs/bench_remove_padding] [--rounds 3]

The learner alone (learner.Learner.update: old log-probs, KL reference, the update), one process,
fp32 on this machine's device, on hand-made steps whose lengths follow a spread:
(a) the demo: its model and config (micro-batches of 8 rows, log-prob forwards of 48), 48 rows of
    10-16 prompt tokens and the demo's short responses (1-8 tokens, ~2.6 on average);
(b) a long tail shaped like configs/qwen3_30b_a3b_dapo.yaml's at 1/8 of its lengths (prompts up
    to 256 in 128-token buckets, log-normal around 100; responses up to 256, log-normal around
    90 with DAPO's long tail, a tenth cut at the limit), 64 rows in micro-batches of 4, on a small
    Qwen3-MoE built here (4 layers, hidden 128, 16 experts top-2).
Each workload runs padded (use_remove_padding false), packed (by rows, as configured) and packed
by a token budget (use_dynamic_bsz; ppo_max_token_len_per_gpu = a padded micro-batch's
full-length tokens, the memory the rows plan for; log-prob forwards twice that), one untimed step
each first, then ``--rounds`` rounds in turn; printed: computed / real tokens over the three
phases (the learner's meter), the median step time of each setting, and the targets
(computed / real <= 1.1 packed; packed >= 1.3x faster than padded on (b)).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    name: str
    model: Path
    argv: list[str]
    rows: int
    group_size: int
    prompt_lengths: torch.Tensor  # [rows]
    response_lengths: torch.Tensor  # [rows]
    prompt_bucket: int
    budget_argv: list[str]


def lognormal(count: int, median: float, sigma: float, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    values = torch.exp(torch.randn(count, generator=generator) * sigma) * median
    return values.round().clamp(low, high).long()


def step_batch(work: Workload, vocab: int, seed: int = 0) -> Any:
    """One step's samples with ``work``'s lengths: prompts left-padded to their bucket's bound,
    responses right-padded to the longest."""
    from samples import SampleBatch

    generator = torch.Generator().manual_seed(seed)
    rows = work.rows
    width_p = int(-(-int(work.prompt_lengths.max()) // work.prompt_bucket) * work.prompt_bucket)
    width_r = int(work.response_lengths.max())
    prompt_mask = torch.arange(width_p)[None, :] >= width_p - work.prompt_lengths[:, None]
    response_mask = torch.arange(width_r)[None, :] < work.response_lengths[:, None]
    rewards = torch.randint(0, 2, (rows,), generator=generator).float()
    return SampleBatch(
        prompt_ids=torch.randint(3, vocab, (rows, width_p), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, vocab, (rows, width_r), generator=generator) * response_mask,
        response_mask=response_mask, rollout_logp=torch.zeros(rows, width_r) - 1.0, reward=rewards, score=rewards,
        correct=rewards > 0, truncated=torch.zeros(rows, dtype=torch.bool),
        prompt_index=torch.arange(rows) // work.group_size, version=torch.zeros(rows, dtype=torch.long),
        group_size=work.group_size)


def long_tail_model(demo_model: Path, out: Path) -> Path:
    """A small Qwen3-MoE with room for 512 positions, random weights, the demo's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    config = AutoConfig.from_pretrained(demo_model)
    config.update({"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
                   "num_experts": 16, "num_experts_per_tok": 2, "max_position_embeddings": 1024})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_model / name).is_file():
            shutil.copy(demo_model / name, out / name)
    return out


def workloads(assets: Path, out: Path) -> list[Workload]:
    generator = torch.Generator().manual_seed(0)
    demo_argv = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--kl_coef", "0.01"]
    demo_responses = torch.distributions.Geometric(probs=0.45).sample((48,)).long().add(1).clamp(1, 8)
    demo = Workload("(a) demo", assets / "model", demo_argv, 48, 8, torch.randint(10, 17, (48,), generator=generator),
                    demo_responses, 32, ["--ppo_max_token_len_per_gpu", str(8 * (64 + 8)),
                                         "--log_prob_max_token_len_per_gpu", str(2 * 8 * (64 + 8))])
    responses = lognormal(64, 90, 0.8, 4, 256, generator)
    responses[torch.randperm(64, generator=generator)[:6]] = 256  # the long tail: cut at max_response_length
    tail_argv = demo_argv + ["--max_prompt_length", "256", "--max_response_length", "256", "--bucket_size", "128",
                             "--prompts_per_step", "8", "--sample_num", "8", "--per_device_batch_size", "4",
                             "--gradient_accumulation_steps", "4", "--log_prob_batch_size", "8"]
    tail = Workload("(b) long tail", long_tail_model(assets / "model", out / "long_tail_model"), tail_argv, 64, 8,
                    lognormal(64, 100, 0.6, 16, 256, generator), responses, 128,
                    ["--ppo_max_token_len_per_gpu", str(4 * 512), "--log_prob_max_token_len_per_gpu", str(8 * 512)])
    return [demo, tail]


SETTINGS = {"padded": ["--use_remove_padding", "false"], "packed": ["--use_remove_padding", "true"],
            "packed + budget": ["--use_remove_padding", "true", "--use_dynamic_bsz", "true"]}


def learner_for(work: Workload, assets: Path, out: Path, setting: str) -> Any:
    from config import Derived, load_config
    from device import select_platform
    from learner import Learner
    from ranks import Layout

    argv = [*work.argv, "--model_path", str(work.model), "--dataset", str(assets / "train.jsonl"),
            "--output_dir", str(out / "run"), "--learner_dtype", "fp32", "--learner_ranks", "1",
            *SETTINGS[setting], *(work.budget_argv if "budget" in setting else [])]
    cfg = load_config(argv)
    return Learner(cfg, select_platform(cfg.run.device), Derived.of(cfg, 1), Layout(world_size=1, rank=0, num_learners=1),
                   None, resume=None)


def measure(work: Workload, assets: Path, out: Path, rounds: int) -> dict[str, dict[str, float]]:
    import dapo_loss

    learners = {setting: learner_for(work, assets, out, setting) for setting in SETTINGS}
    vocab = next(iter(learners.values())).policy.config.vocab_size
    batch = step_batch(work, vocab)
    advantages = dapo_loss.group_advantages(batch.reward, batch.group_size)
    times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    for round_ in range(rounds + 1):  # round 0: the untimed warm-up
        for setting, learner in learners.items():
            start = time.perf_counter()
            learner.update(batch, advantages, step=1)
            if round_:
                times[setting].append(time.perf_counter() - start)
    result = {}
    for setting, learner in learners.items():
        real = sum(counts[0] for counts in learner.meter.tokens.values())
        computed = sum(counts[1] for counts in learner.meter.tokens.values())
        result[setting] = {"computed_over_real": computed / real, "step_s": statistics.median(times[setting]),
                           "rounds": times[setting]}
    return result


def report(work: Workload, result: dict[str, dict[str, float]]) -> list[str]:
    padded = result["padded"]["step_s"]
    lines = [f"{work.name}: {work.rows} rows, prompts {int(work.prompt_lengths.min())}-{int(work.prompt_lengths.max())} "
             f"tokens, responses {int(work.response_lengths.min())}-{int(work.response_lengths.max())} "
             f"(mean {work.response_lengths.float().mean():.1f})"]
    for setting, numbers in result.items():
        rounds = ", ".join(f"{t:.3f}" for t in numbers["rounds"])
        lines.append(f"  {setting:<16} computed / real {numbers['computed_over_real']:.2f}   learner step "
                     f"{numbers['step_s']:.3f} s (rounds {rounds})   {padded / numbers['step_s']:.2f}x padded")
    packed = min(result["packed"]["step_s"], result["packed + budget"]["step_s"])
    lines.append(f"  computed / real <= 1.1 packed: {'met' if result['packed']['computed_over_real'] <= 1.1 else 'NOT met'}; "
                 f"the faster packed setting {padded / packed:.2f}x padded (target on the long tail: >= 1.3x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_remove_padding")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--assets", type=Path, default=None, help="demo assets (built under --out when absent)")
    args = parser.parse_args()
    assets = args.assets or args.out / "demo_assets"
    if not (assets / "model" / "config.json").is_file():
        from data_prep import build_demo_assets

        build_demo_assets(assets, seed=0)
    torch.manual_seed(0)
    for work in workloads(assets, args.out):
        print("\n".join(report(work, measure(work, assets, args.out, args.rounds))), flush=True)


if __name__ == "__main__":
    main()
