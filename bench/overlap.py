"""Does rollout really run one step ahead? The 8-rank demo with max_staleness 0 and 1.

    python bench/overlap.py [--steps 40] [--nproc 8]

Prints, for both settings, the median step time and the median overlap =
(generation time + training time) / step time: about 1 or less when generation and training
take turns, above 1 when generation of step j+1 runs while step j trains. The first steps
(start-up, first touches) are left out of the medians.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from demo_runs import bench_arguments, medians, run_demo


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0])
    keys = ("step_time_s", "gen_time_s", "train_time_s", "overlap")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            metrics = run_demo(Path(tmp) / f"staleness_{staleness}", args.nproc, args.steps,
                               "--max_staleness", str(staleness), "--save_every", "0")
            results[staleness] = medians(metrics, args.skip, keys)
    print(f"{args.nproc} ranks, {args.steps} steps, medians over steps {args.skip + 1}..{args.steps}:")
    for staleness, m in results.items():
        print(f"  max_staleness {staleness}: step {m['step_time_s']:.3f} s  gen {m['gen_time_s']:.3f} s  "
              f"train {m['train_time_s']:.3f} s  overlap {m['overlap']:.2f}")
    print(f"  step time ratio staleness 1 / staleness 0: "
          f"{results[1]['step_time_s'] / results[0]['step_time_s']:.3f}")


if __name__ == "__main__":
    main()
