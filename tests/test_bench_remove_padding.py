"""bench/remove_padding.py: the steps it times have the lengths it says, padded as the trainer pads."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import remove_padding  # noqa: E402


def test_a_step_has_the_workloads_lengths_left_padded_prompts_in_buckets_and_right_padded_responses():
    work = remove_padding.Workload("w", Path("m"), [], 4, 2, torch.tensor([5, 130, 17, 64]), torch.tensor([3, 1, 9, 2]),
                                   128, [])
    batch = remove_padding.step_batch(work, vocab=50)
    assert batch.prompt_ids.shape == (4, 256) and batch.response_ids.shape == (4, 9)  # 130 -> the 256 bucket
    assert batch.prompt_mask.sum(1).tolist() == [5, 130, 17, 64] and batch.response_lengths.tolist() == [3, 1, 9, 2]
    assert batch.prompt_mask[:, -1].all() and not batch.prompt_mask[0, 0]  # left-padded
    assert (batch.prompt_ids[~batch.prompt_mask] == 0).all() and (batch.response_ids[batch.response_mask] >= 3).all()


def test_the_report_says_the_ratio_and_whether_the_target_is_met():
    work = remove_padding.Workload("(b) long tail", Path("m"), [], 2, 2, torch.tensor([10, 20]), torch.tensor([5, 50]),
                                   128, [])
    result = {"padded": {"computed_over_real": 1.8, "step_s": 8.0, "rounds": [8.0]},
              "packed": {"computed_over_real": 1.0, "step_s": 4.0, "rounds": [4.0]},
              "packed + budget": {"computed_over_real": 1.0, "step_s": 5.0, "rounds": [5.0]}}
    lines = remove_padding.report(work, result)
    assert "computed / real 1.80" in lines[1] and "2.00x padded" in lines[2]
    assert lines[-1].startswith("  computed / real <= 1.1 packed: met; the faster packed setting 2.00x padded")
