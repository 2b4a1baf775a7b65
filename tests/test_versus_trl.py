"""The parts of bench/versus_trl.py that hold without trl: TRL is given our reward, its
generation batches are timed at the right optimizer steps, and without trl the bench says how to
get it and exits 0."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from config import load_config  # noqa: E402
from rewards import resolve_rule, score_with_rule  # noqa: E402
from rollout import shaped_rewards  # noqa: E402
from versus_trl import HOW_TO_GET_TRL, batch_seconds, demo_argv, main, trl_reward, trl_speed  # noqa: E402


def test_trl_scores_a_completion_as_our_rollout_does_overlong_punishment_included():
    cfg = load_config(demo_argv(Path("assets"), Path("out"), 1))
    eos = 2
    # TRL hands conversational completions and their token ids, the EOS kept where one was sampled.
    texts, answers = ["7", "7", " 12", "12abc", "5555555"], ["7", "5", "12", "12", "5"]
    ids = [[23, eos], [23, eos], [4, 17, 18, eos], [17, 18, 71, 72, 73, 74, eos], [21] * 8]
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    theirs = trl_reward(cfg)(completions=completions, completion_ids=ids, answer=answers, trainer_state=None)
    ours = shaped_rewards(score_with_rule(resolve_rule(cfg.model.reward_fn), texts, answers),
                          torch.tensor([len(row) for row in ids]), max_response_length=cfg.rollout.max_response_length,
                          overlong_buffer_len=cfg.algo.overlong_buffer_len,
                          overlong_penalty_factor=cfg.algo.overlong_penalty_factor)
    assert theirs == ours.tolist()
    assert theirs[0] == 1.0 and theirs[1] == 0.0 and theirs[3] < 0.0 and theirs[4] < theirs[3]  # the penalty bites


def test_a_generation_batch_runs_from_one_sixth_optimizer_step_end_to_the_next():
    # The training's start, then the ends of 12 optimizer steps, 6 to a generation batch.
    ends = [0.0, 5.0, 5.1, 5.2, 5.3, 5.4, 5.5, 6.0, 6.1, 6.2, 6.3, 6.4, 7.5]
    assert batch_seconds(ends, 6) == [5.5, 2.0]


def test_trl_speed_leaves_out_the_warmup_batches_and_splits_the_rest():
    times = {"sequences": 48, "batch_s": [9.0, 2.0, 4.0, 3.0], "generation_s": [5.0, 0.5, 1.0, 0.75],
             "prepared_s": [6.0, 1.0, 2.0, 1.5]}
    speed = trl_speed(times, warmup=1)
    assert speed.samples_per_s == 48 / 3.0
    assert speed.parts == {"batch": 3.0, "generation": 0.75, "rewards+old logp": 0.75, "update": 1.5}


def test_without_a_python_that_has_trl_the_bench_says_how_to_make_one_and_exits_0(tmp_path, capsys):
    bare_python = tmp_path / "python"  # this interpreter without site-packages: no trl, whatever the venv holds
    bare_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare_python.chmod(0o755)
    for argv in ([], ["--trl-python", str(bare_python)], ["--trl-python", str(tmp_path / "no-such-python")]):
        assert main(argv) == 0
        assert capsys.readouterr().out == HOW_TO_GET_TRL + "\n"
