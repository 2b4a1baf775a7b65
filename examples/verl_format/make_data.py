"""Write the demo's problems in verl's dataset layout, as verl's own preprocessing scripts
(examples/data_preprocess/gsm8k.py) write theirs: OUT/train.parquet and OUT/val.parquet.

    python examples/verl_format/make_data.py OUT
"""
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from data_prep import demo_problems  # noqa: E402


def verl_row(index: int, question: str, answer: str, split: str) -> dict:
    return {"data_source": "demo/arithmetic", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index}}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        rows = [verl_row(i, p["prompt"], p["answer"], split) for i, p in enumerate(demo_problems())]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    print(f"wrote {out}/train.parquet and {out}/val.parquet ({len(rows)} rows each)")
