"""Data and rewards as verl users bring them: verl's dataset layout read as it is, verl-style
reward functions, and reward functions or data that cannot work refused with one line before
any model loads."""
import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import train_dapo
from data_prep import RowInfo, demo_problems, read_rows
from rewards import resolve_rule, score_with_rule

ROOT = Path(__file__).resolve().parents[1]


def gsm8k_row(index: int, question: str, answer: str) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index, "answer": f"#### {answer}", "question": question}}


def dapo_math_row(index: int, question: str, answer: str) -> dict:
    """A row of DAPO-Math-17k as verl's DAPO recipe reads it."""
    return {"data_source": "math_dapo", "prompt": [{"content": question, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{index}"}}


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def demo_rows(layout) -> list[dict]:
    return [layout(i, row["prompt"], row["answer"]) for i, row in enumerate(demo_problems())]


def test_verl_layouts_read_as_they_are(tmp_path):
    gsm8k = read_rows(write_parquet(demo_rows(gsm8k_row)[:3], tmp_path / "gsm8k.parquet"))
    assert gsm8k.answers == [row["answer"] for row in demo_problems()[:3]]  # reward_model.ground_truth
    assert gsm8k.messages[0] == [{"role": "user", "content": demo_problems()[0]["prompt"]}]
    assert gsm8k.infos[1].data_source == "openai/gsm8k" and gsm8k.infos[1].extra_info["index"] == 1
    dapo = read_rows(write_jsonl(demo_rows(dapo_math_row)[:3], tmp_path / "dapo.jsonl"))
    assert dapo.answers == gsm8k.answers and dapo.infos[2] == RowInfo("math_dapo", {"index": "id-2"})
    dotted = read_rows(tmp_path / "gsm8k.parquet", answer_key="extra_info.answer")
    assert dotted.answers[0] == f"#### {demo_problems()[0]['answer']}"
    plain = read_rows(write_jsonl([{"prompt": "1+1=", "answer": "2", "reward_model": {"ground_truth": "3"}}],
                                  tmp_path / "plain.jsonl"))
    assert plain.answers == ["2"] and plain.infos == [RowInfo()]  # an `answer` of its own comes first


VERL_REWARD = '''
calls = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append((data_source, extra_info["index"]))
    right = solution_str.strip() == ground_truth
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": solution_str}


def partial_credit(data_source, solution_str, ground_truth, extra_info=None):
    # Its score and its acc disagree: a wrong number earns 0.5, and a right answer with spaces
    # around it loses 1.5 (an overlong penalty, as verl's DAPO applies to a correct response).
    answer = solution_str.strip()
    right = answer == ground_truth
    score = (1.0 if right else 0.5 if answer.isdigit() else -1.0) - (1.5 if answer != solution_str else 0.0)
    return {"score": score, "acc": right}


def bare_float(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def raises(data_source, solution_str, ground_truth, extra_info=None):
    return extra_info["missing"]


def returns_text(response, answer):
    return "right"


def one_argument(response):
    return 1.0
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("verl_reward", None)
    yield
    sys.modules.pop("verl_reward", None)


def test_verl_reward_functions_get_verls_arguments_and_may_return_a_float_or_a_dict(reward_module):
    infos = [RowInfo("openai/gsm8k", {"index": 4}), RowInfo("openai/gsm8k", {"index": 5})]
    scored = score_with_rule(resolve_rule("verl_reward:compute_score"), ["7", "8"], ["7", "7"], infos)
    assert (scored.scores, scored.correct, scored.num_malformed) == ([1.0, -1.0], [True, False], 0)
    assert sys.modules["verl_reward"].calls == [("openai/gsm8k", 4), ("openai/gsm8k", 5)]
    partial = score_with_rule(resolve_rule("verl_reward:partial_credit"), ["7", "8", " 7 ", "x"], ["7"] * 4,
                              infos * 2)
    assert (partial.scores, partial.correct) == ([1.0, 0.5, -0.5, -1.0], [True, False, True, False])  # correct: acc
    floats = score_with_rule(resolve_rule("verl_reward:bare_float"), ["7", "8"], ["7", "7"], infos)
    assert (floats.scores, floats.correct) == ([1.0, 0.0], [True, False])  # correct: score > 0
    assert not resolve_rule("demo_arithmetic").verl_style


def run_argv(demo_assets: Path, out: Path, dataset: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(demo_assets / "model"),
            "--dataset", str(dataset), "--val_dataset", str(dataset), "--output_dir", str(out), "--max_steps", "1",
            "--val_max_prompts", "12", "--val_every", "1", "--log_every", "1", *extra]


def test_verl_data_and_a_verl_reward_train_with_no_other_flag(demo_assets, reward_module, tmp_path):
    dataset = write_parquet(demo_rows(gsm8k_row), tmp_path / "train.parquet")
    out = tmp_path / "run"
    assert train_dapo.main(run_argv(demo_assets, out, dataset, "--reward_fn", "verl_reward:compute_score")) == 0
    calls = sys.modules["verl_reward"].calls
    assert len(calls) > 48 and {source for source, _ in calls} == {"openai/gsm8k"}
    assert {index for _, index in calls} <= set(range(100)) and len({index for _, index in calls}) > 6
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    scores = {response["score"] for row in logged for response in row["responses"]}
    assert scores == {-1.0, 1.0} and all(row["answer"] for row in logged)  # the dict's score; ground_truth


@pytest.mark.parametrize("reward_fn, said", [
    ("verl_reward:raises", "train.jsonl:1): KeyError: 'missing'"),
    ("verl_reward:returns_text", "train.jsonl:1): TypeError: returned str 'right'"),
    ("verl_reward:one_argument", "takes (response); expected fn(response, answer)"),
])
def test_a_reward_function_that_cannot_score_is_refused_before_any_model_loads(
        demo_assets, reward_module, tmp_path, capsys, reward_fn, said):
    dataset = write_jsonl(demo_rows(gsm8k_row), tmp_path / "train.jsonl")
    out = tmp_path / "run"
    assert train_dapo.main(run_argv(demo_assets, out, dataset, "--reward_fn", reward_fn)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not out.exists()


def test_a_missing_reference_answer_is_refused_naming_the_key_the_file_and_the_row(demo_assets, tmp_path, capsys):
    rows = demo_rows(dapo_math_row)
    del rows[2]["reward_model"]["ground_truth"]
    dataset = write_jsonl(rows, tmp_path / "train.jsonl")
    out = tmp_path / "run"
    assert train_dapo.main(run_argv(demo_assets, out, dataset)) == 2  # demo_arithmetic compares with the answer
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.jsonl:3: no reference answer at answer_key 'answer'" in err, err
    assert not out.exists()


def readme_example_lines() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Your own model, data and reward", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.replace("\\\n", " ").splitlines()


def test_the_readme_verl_example_runs_as_written(demo_assets, tmp_path):
    """The README's lines, with the demo model of this session, its folder under tmp_path and one step."""
    lines = readme_example_lines()
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line.replace("runs/verl_demo", str(tmp_path / "verl_demo")))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        while "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[0] == "python"
        if words[1] == "train_dapo.py":
            words += ["--model_path", str(demo_assets / "model"), "--max_steps", "1", "--val_max_prompts", "12"]
        proc = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "verl_demo" / "run" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["step"] for row in rows] == ["0", "1"] and rows[0]["val_acc"] and rows[1]["acc_mean"]
