"""The built-in decode loop against vLLM (rollout_engine builtin / vllm) on the same prompts and
settings, and the weight sync into vLLM as a fraction of a generation batch.

    OMP_NUM_THREADS=1 python bench/rollout_engines.py [--rounds 5] [--widths 16 48] [--lengths 8 64]

On the demo model, fp32, temperature 1.0:
for every width (sequences per call) and length (new tokens, no stop token, so every response
is that long) both engines generate in turns, ``--rounds`` times; printed are the median seconds
of each and the median of the paired ratios builtin / vLLM (above 1: vLLM is faster). Then the
median time of loading every weight into each engine (engine.load_weights, the path of weight
sync after the broadcast: the load of metrics.csv's weight_load_s; vLLM's goes through its
weight-transfer protocol, by IPC and from a staging file) over the median time of its demo
generation batch (48 sequences, up
to 8 tokens, stopping at EOS), in alternating rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import load_config  # noqa: E402
from data_prep import build_demo_assets, load_prompts  # noqa: E402
from device import select_platform  # noqa: E402
from engine import Sampling, Seeds  # noqa: E402
from hf_weights import WeightFiles  # noqa: E402
from ranks import Layout  # noqa: E402
from rollout import build_engine, left_pad, load_rollout_model  # noqa: E402
from weight_sync import SharedMemoryWeights, staging_dir  # noqa: E402


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def engines(assets: Path, sequences: int, length: int):
    """Both engines for calls of up to ``sequences`` rows and ``length`` new tokens."""
    from transformers import AutoTokenizer

    argv = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(assets / "model"),
            "--prompts_per_step", str(sequences // 8), "--sample_num", "8", "--max_response_length", str(length)]
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    plat, layout = select_platform("cpu"), Layout(world_size=1, rank=0, num_learners=1)
    vllm = build_engine(load_config([*argv, "--rollout_engine", "vllm"]), plat, layout, tokenizer, rollout_copy=None)
    builtin = build_engine(load_config(argv), plat, layout, tokenizer,
                           lambda: load_rollout_model(assets / "model", "fp32", plat.device))
    return builtin, vllm, tokenizer


def generation_pair(builtin, vllm, ids, mask, length: int, stop_ids: list[int], rounds: int) -> dict[str, float]:
    """Paired timings of both engines on one call shape; the engines' length and stop ids are
    set for the measurement (a run sets them once from the config)."""
    for engine in (builtin, vllm):
        engine.max_new_tokens, engine.stop_ids = length, stop_ids
    seeds = Seeds.of(0, 1, 1, 0, range(ids.shape[0] // 8), 8)
    run = {name: (lambda e=engine: e.generate(ids, mask, sampling=Sampling(), seeds=seeds))
           for name, engine in (("builtin", builtin), ("vllm", vllm))}
    for call in run.values():
        call()  # first calls warm up (vLLM: its kernels)
    pairs = [(timed(run["builtin"]), timed(run["vllm"])) for _ in range(rounds)]
    return {"builtin": statistics.median(b for b, _ in pairs), "vllm": statistics.median(v for _, v in pairs),
            "ratio": statistics.median(b / v for b, v in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 48])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(tmp) / "assets"
        build_demo_assets(assets, seed=0)
        builtin, vllm, tokenizer = engines(assets, max(max(args.widths), 48), max(args.lengths))
        prompts = load_prompts(assets / "val.jsonl", tokenizer).prompt_ids
        print(f"demo model (head_dim 32), fp32, temperature 1.0, {args.rounds} paired rounds; "
              "ratio = builtin s / vLLM s (median of pairs)")
        for width in args.widths:
            ids, mask = left_pad([p for p in prompts[:width // 8] for _ in range(8)], 32, tokenizer.pad_token_id)
            for length in args.lengths:
                m = generation_pair(builtin, vllm, ids, mask, length, [], args.rounds)
                print(f"  {width:3d} sequences x {length:3d} tokens: builtin {m['builtin']:.3f} s  "
                      f"vLLM {m['vllm']:.3f} s  ratio {m['ratio']:.2f}")
        ids, mask = left_pad([p for p in prompts[:6] for _ in range(8)], 32, tokenizer.pad_token_id)
        batch = generation_pair(builtin, vllm, ids, mask, 8, [tokenizer.eos_token_id], args.rounds)
        files = WeightFiles(assets / "model")
        weights = lambda: [files.rows(n, s, 0, s[0]) for n, s in zip(vllm.weights.names, vllm.weights.shapes)]  # noqa: E731
        # vLLM's worker takes a bucket by IPC (the engine's own transport) or from a staging file
        # (an NPU below the IPC gate): both into the same engine, in alternating rounds.
        ipc = vllm.weights
        staged = SharedMemoryWeights(ipc.form, vllm, ipc.capacity, staging_dir())
        vllm.llm.init_weight_transfer_engine({"init_info": staged.init_info})

        def vllm_load(transport, tensors):
            vllm.weights = transport
            vllm.load_weights(tensors)
        loads = [(timed(lambda w=weights(): builtin.load_weights(w)), timed(lambda w=weights(): vllm_load(ipc, w)),
                  timed(lambda w=weights(): vllm_load(staged, w))) for _ in range(args.rounds)]
        for name, column, engine in (("builtin", 0, "builtin"), ("vllm by IPC", 1, "vllm"),
                                     ("vllm from a staging file", 2, "vllm")):
            load = statistics.median(row[column] for row in loads)
            print(f"weight load into {name}: {load:.3f} s = {load / batch[engine]:.2f} of its demo generation batch "
                  f"(48 sequences, up to 8 tokens: {batch[engine]:.3f} s)")
        vllm.close()


if __name__ == "__main__":
    main()
