"""Shared fixtures: the demo assets are built once per test session (about 15 s)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    from data_prep import build_demo_assets

    out = tmp_path_factory.mktemp("demo_assets")
    build_demo_assets(out, seed=0)
    return out


@pytest.fixture
def demo_argv(demo_assets, tmp_path) -> list[str]:
    """A few-second training run on the demo assets, one process."""
    return [
        "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
        "--model_path", str(demo_assets / "model"),
        "--dataset", str(demo_assets / "train.jsonl"),
        "--val_dataset", str(demo_assets / "val.jsonl"),
        "--output_dir", str(tmp_path / "run"),
        "--val_max_prompts", "24", "--val_every", "2", "--save_every", "2", "--log_every", "1",
    ]


# The files that take longest (measured on 2 cores, most time first) run first, so that the two
# workers of `./launch.sh test` (pytest-xdist, one file at a time) end close together instead of
# one of them starting a four-minute file when the other has nothing left.
LONGEST_FIRST = ("test_engine_vllm.py", "test_faults.py", "test_ranks.py", "test_accel_standin.py",
                 "test_learner_sharding.py", "test_stopping.py", "test_checkpoint.py", "test_train.py",
                 "test_algorithm_options.py", "test_data_prep.py", "test_npu_paths.py", "test_inputs_checked.py",
                 "test_rollout_correction.py", "test_engine_vllm_platform.py", "test_decode.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order
