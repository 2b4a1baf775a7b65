"""What a checkpoint every step costs: the 8-rank demo with save_every 1 and with saving off.

    python bench/checkpoint_cost.py [--steps 40] [--nproc 8]

Prints the median save time as a fraction of the median step time (save_every 1), the median
step time with and without saving, and their ratio. The lead saves while the rollout ranks
generate the next step, so the ratio is the real price; the fraction is what saving would cost
if it stalled everything. Generation time is shown for both, to see that saving leaves it alone.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from demo_runs import bench_arguments, medians, run_demo


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0])
    keys = ("step_time_s", "gen_time_s", "save_time_s")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for every in (0, 1):
            metrics = run_demo(Path(tmp) / f"save_every_{every}", args.nproc, args.steps, "--save_every", str(every))
            results[every] = medians(metrics, args.skip, keys)
    saving, plain = results[1], results[0]
    print(f"{args.nproc} ranks, {args.steps} steps, medians over steps {args.skip + 1}..{args.steps}:")
    for every, m in results.items():
        print(f"  save_every {every}: step {m['step_time_s']:.3f} s  gen {m['gen_time_s']:.3f} s  "
              f"save {m['save_time_s']:.3f} s")
    print(f"  save time / step time (save_every 1): {saving['save_time_s'] / saving['step_time_s']:.3f}")
    print(f"  step time ratio save_every 1 / save_every 0: {saving['step_time_s'] / plain['step_time_s']:.3f}")


if __name__ == "__main__":
    main()
