"""data_prep.py: dataset loading and errors, the stats / reward-check CLIs, demo assets (demo_model.py); buckets.py."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data_prep
import demo_model
from buckets import batch_max_widths, bucket_bound, bucketed_batches, padding_fraction, propose_bucket_size
from data_prep import DataError, build_demo_assets, load_prompts, low_spread_warning
from demo_model import build_demo_tokenizer, one_intra_op_thread

REPO = Path(__file__).resolve().parent.parent
# "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n" in the character-level demo vocabulary:
# 1 + len("user\n") + len("3+4=") + 1 + len("\n") + 1 + len("assistant\n") tokens.
DEMO_PROMPT_TOKENS = 1 + 5 + 4 + 1 + 1 + 1 + 10


def run_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, str(REPO / "data_prep.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def demo_dir(demo_assets) -> Path:
    return demo_assets  # built once per session in conftest.py


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


# --- demo assets --------------------------------------------------------------------------------


def test_demo_rebuild_over_existing_assets_is_bit_identical(demo_dir, tmp_path):
    """Over a complete earlier build, with 3 intra-op threads where the session's build had 1:
    the same bytes (the build runs on one thread of its own), and the caller's RNG and threads kept."""
    rebuilt = tmp_path / "demo"
    shutil.copytree(demo_dir, rebuilt)  # a complete earlier build that the new one overwrites
    (rebuilt / "model" / "model.safetensors").write_bytes(b"stale")
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not 1, so a build that left its own single thread behind shows
    try:
        info = build_demo_assets(rebuilt, seed=0)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)

    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    for name in ["model/model.safetensors", "model/tokenizer.json", "model/config.json", "train.jsonl", "val.jsonl"]:
        assert (rebuilt / name).read_bytes() == (demo_dir / name).read_bytes(), name
    first = json.loads((demo_dir / "demo_info.json").read_text())
    assert {k: v for k, v in info.items() if k != "build_seconds"} == \
        {k: v for k, v in first.items() if k != "build_seconds"}
    assert sorted(p.name for p in rebuilt.iterdir()) == ["demo_info.json", "model", "train.jsonl", "val.jsonl"]


def test_demo_model_and_tokenizer_load_with_auto_classes(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model")
    tok = AutoTokenizer.from_pretrained(demo_dir / "model")
    config = model.config
    assert config.model_type == "qwen3_moe"
    assert (config.num_hidden_layers, config.hidden_size, config.num_local_experts, config.num_experts_per_tok) == \
        (2, 64, 8, 2)
    assert config.norm_topk_prob
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|im_end|>", "<|endoftext|>", "left")
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert len(tok) == config.vocab_size

    text = tok.apply_chat_template([{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # specials are single tokens
    assert tok.decode(ids) == text


def test_demo_warm_start_is_low_but_operand_dependent(demo_dir):
    """Recompute the greedy accuracy of the saved model with plain generate and compare to the info."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((demo_dir / "demo_info.json").read_text())
    assert 0.05 <= info["greedy_accuracy"] <= 0.40
    assert info["distinct_answers"] > 1 and info["warm_start_target_met"]

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "model").eval()
    tok = AutoTokenizer.from_pretrained(demo_dir / "model")
    rows = [json.loads(line) for line in (demo_dir / "val.jsonl").read_text().splitlines()]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    # Exact by construction: the build measured with the same batches (every prompt has the same
    # length, so none is padded) on one intra-op thread, so every forward pass here sees the same
    # shapes and thread count as there. Other batches may take other kernels, whose rounding can
    # flip a near-tied greedy token and the accuracy with it.
    responses = []
    batch_size = demo_model.WARM_START_EVAL_BATCH
    with torch.no_grad(), one_intra_op_thread():
        for start in range(0, len(texts), batch_size):
            batch = tok(texts[start:start + batch_size], add_special_tokens=False, return_tensors="pt")
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
            responses += tok.batch_decode(out[:, batch["input_ids"].shape[1]:])
    correct = sum(resp.startswith(r["answer"] + "<|im_end|>") for resp, r in zip(responses, rows))
    assert correct / len(rows) == info["greedy_accuracy"]
    assert len({resp.split("<|im_end|>")[0] for resp in responses}) == info["distinct_answers"]


def test_demo_task_files(demo_dir):
    val = [json.loads(line) for line in (demo_dir / "val.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (demo_dir / "train.jsonl").read_text().splitlines()]
    expected = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    assert val == expected
    assert sorted(train, key=json.dumps) == sorted(expected, key=json.dumps) and train != expected


# --- loading ------------------------------------------------------------------------------------


def test_load_prompts_renders_string_and_message_prompts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "2+2="}], "answer": 4},
        {"prompt": [{"role": "user", "content": "5+1="}]},
    ])
    plain = load_prompts(path, tokenizer)
    assert plain.prompt_texts[0] == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    assert len(plain.prompt_ids[0]) == DEMO_PROMPT_TOKENS
    assert plain.answers == ["3", "4", None] and plain.source_rows == [1, 2, 3]

    with_system = load_prompts(path, tokenizer, system_prompt="Sys.")
    assert with_system.prompt_texts[0].startswith("<|im_start|>system\nSys.<|im_end|>\n<|im_start|>user\n1+2=")
    assert with_system.prompt_texts[1].startswith("<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\n2+2=")
    assert "Sys." not in with_system.prompt_texts[1]
    for text, ids in zip(with_system.prompt_texts, with_system.prompt_ids):
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # no extra BOS or doubled specials


@pytest.mark.parametrize("row, message", [
    ({"question": "1+1="}, "missing field 'prompt'"),
    ({"prompt": None}, "missing field 'prompt'"),
    ({"prompt": 7}, "'prompt' must be a string or a list of chat messages"),
    ({"prompt": [{"role": "user"}]}, "string 'role' and 'content'"),
    ({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "must have role 'user'"),
    ({"prompt": "1+1=", "answer": [2]}, "'answer' must be a string or a number"),
])
def test_bad_row_names_file_and_line(tokenizer, tmp_path, row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}, row])
    with pytest.raises(DataError) as caught:
        load_prompts(path, tokenizer)
    assert str(caught.value).startswith(f"{path}:3: ") and message in str(caught.value)


def test_broken_json_line_and_skip_bad_rows(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    lines = ['{"prompt": "1+1="}', "", '{"prompt": 5}', '{"prompt": "2+2=", ', '{"prompt": "3+3="}']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:3: 'prompt' must be"):
        load_prompts(path, tokenizer)
    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:3: not valid JSON"):
        load_prompts(path, tokenizer)

    path.write_text("\n".join(lines) + "\n")
    prompts = load_prompts(path, tokenizer, skip_bad_rows=True)
    assert prompts.num_bad_rows == 2 and prompts.source_rows == [1, 5]
    assert prompts.prompt_texts[1].startswith("<|im_start|>user\n3+3=")


def test_json_and_parquet_rows_are_numbered(tokenizer, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": 3, "answer": "4"}]
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"list\.json: row 2: 'prompt' must be"):
        load_prompts(as_list, tokenizer)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"version": 1, "data": rows[:1]}))
    assert load_prompts(nested, tokenizer).answers == ["2"]
    json_lines = write_jsonl(tmp_path / "lines.json", [rows[0], rows[0]])
    assert load_prompts(json_lines, tokenizer).source_rows == [1, 2]
    broken_document = tmp_path / "broken.json"
    broken_document.write_text('{\n  "data": [\n    {"prompt": "1+1="},\n  ]\n}\n')
    with pytest.raises(DataError, match=r"broken\.json:4: not valid JSON"):
        load_prompts(broken_document, tokenizer)
    # A raw U+2028 is legal inside a JSON string and must not split the line.
    separator = tmp_path / "separator.jsonl"
    separator.write_text('{"prompt": "1+1=\u2028"}\n{"prompt": 5}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"separator\.jsonl:2: 'prompt' must be"):
        load_prompts(separator, tokenizer)

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": None, "answer": "4"}]), table)
    with pytest.raises(DataError, match=r"d\.parquet: row 2: missing field 'prompt'"):
        load_prompts(table, tokenizer)
    parquet = load_prompts(table, tokenizer, skip_bad_rows=True)
    assert parquet.answers == ["2"] and parquet.num_bad_rows == 1

    for name, content in [("missing.jsonl", None), ("d.csv", "prompt\n1+1=\n"), ("empty.jsonl", "\n\n")]:
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(DataError, match=name.replace(".", r"\.")):
            load_prompts(tmp_path / name, tokenizer)


def test_chat_template_failure_names_the_row(tokenizer, tmp_path):
    strict = build_demo_tokenizer()
    strict.chat_template = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                            "{%- endif %}{{ m['content'] }}{%- endfor %}")
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+1="}, {"prompt": [{"role": "tool", "content": "x"}, {"role": "user", "content": "y"}]}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: chat template failed \(.*no tools"):
        load_prompts(path, strict)
    assert load_prompts(path, strict, skip_bad_rows=True).num_bad_rows == 1


def test_overlong_prompts_drop_or_truncate_left(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1="}, {"prompt": "1+1=" * 5}, {"prompt": "2+2=" * 9}])
    full = load_prompts(path, tokenizer)
    lengths = [len(ids) for ids in full.prompt_ids]
    assert lengths == [DEMO_PROMPT_TOKENS, DEMO_PROMPT_TOKENS + 16, DEMO_PROMPT_TOKENS + 32]
    limit = DEMO_PROMPT_TOKENS + 16

    dropped = load_prompts(path, tokenizer, max_prompt_length=limit)
    assert dropped.num_overlong_dropped == 1 and dropped.num_truncated == 0
    assert dropped.source_rows == [1, 2] and dropped.prompt_ids == full.prompt_ids[:2]

    truncated = load_prompts(path, tokenizer, max_prompt_length=limit, overlong_prompts="truncate_left")
    assert truncated.num_truncated == 1 and truncated.num_overlong_dropped == 0
    assert truncated.prompt_ids[2] == full.prompt_ids[2][-limit:]
    kept_text = truncated.prompt_texts[2]
    assert full.prompt_texts[2].endswith(kept_text) and kept_text.endswith("<|im_start|>assistant\n")
    assert tokenizer(kept_text, add_special_tokens=False)["input_ids"] == truncated.prompt_ids[2]
    with pytest.raises(ValueError, match="overlong_prompts"):
        load_prompts(path, tokenizer, overlong_prompts="truncate_right")


# --- buckets.py ---------------------------------------------------------------------------------


def test_bucket_bound_and_padding_by_hand():
    assert [bucket_bound(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 4, 4, 8, 8, 12]
    lengths = [1, 2, 3, 10]
    # Buckets of 4: widths 4, 4, 4, 12 -> 24 tokens, 16 real.
    assert padding_fraction(lengths, [bucket_bound(n, 4) for n in lengths]) == pytest.approx(8 / 24)
    assert batch_max_widths(lengths, [[0, 3], [2, 1]]) == [10, 3, 3, 10]
    # Padding to each batch's longest: 10 + 3 + 3 + 10 = 26 tokens, 16 real.
    assert padding_fraction(lengths, batch_max_widths(lengths, [[0, 3], [2, 1]])) == pytest.approx(10 / 26)


def test_bucketed_batches_cover_every_index_once_without_mixing_buckets():
    rng = random.Random(123)
    lengths = [rng.choice([rng.randint(1, 100), rng.randint(900, 1000)]) for _ in range(203)]
    state = random.getstate()
    batches = bucketed_batches(lengths, batch_size=8, bucket_size=64, seed=1)
    assert random.getstate() == state  # the global RNG is neither used nor moved
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(1 <= len(batch) <= 8 for batch in batches)
    for batch in batches:
        assert len({bucket_bound(lengths[i], 64) for i in batch}) == 1
    # Only the last batch of each bucket may be short.
    num_buckets = len({bucket_bound(n, 64) for n in lengths})
    assert sum(len(batch) < 8 for batch in batches) <= num_buckets


def test_bucketed_batches_order_depends_only_on_seed_and_epoch():
    lengths = [random.Random(7).randint(1, 300) for _ in range(100)]
    first = bucketed_batches(lengths, 4, 32, seed=5, epoch=2)
    assert bucketed_batches(lengths, 4, 32, seed=5, epoch=2) == first
    assert bucketed_batches(lengths, 4, 32, seed=6, epoch=2) != first
    assert bucketed_batches(lengths, 4, 32, seed=5, epoch=3) != first
    with pytest.raises(ValueError):
        bucketed_batches(lengths, 0, 32, seed=0)


def test_bucketing_pads_less_than_the_global_max_on_skewed_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(950)] + [rng.randint(1500, 2000) for _ in range(50)]
    bucketed = [bucket_bound(n, 256) for n in lengths]
    global_max = [max(lengths)] * len(lengths)
    assert padding_fraction(lengths, bucketed) < padding_fraction(lengths, global_max)
    batches = bucketed_batches(lengths, 16, 256, seed=0)
    # Within a bucket, padding to the batch's longest never exceeds padding to the bound.
    assert padding_fraction(lengths, batch_max_widths(lengths, batches)) <= padding_fraction(lengths, bucketed)


def test_propose_bucket_size():
    # The article's case: prompts around 800 tokens -> 1024 pads 224/1024 = 22% <= 25%.
    assert propose_bucket_size([800] * 10) == 1024
    # 23-token prompts: 8 pads 1/24; 16 and 32 pad 9/32 = 28% > 25%.
    assert propose_bucket_size([23] * 10) == 8
    # Mean 800 spread over 300..1300: 1024 pads 39% (300..1024 -> 1024, the rest -> 2048); 512 pads 24%.
    assert propose_bucket_size(list(range(300, 1301))) == 512


# --- stats CLI ----------------------------------------------------------------------------------


def test_stats_cli_prints_percentiles_and_bucket_proposal(demo_dir, tmp_path):
    plot = tmp_path / "lengths.png"
    result = run_cli("stats", "--dataset", str(demo_dir / "train.jsonl"), "--model_path", str(demo_dir / "model"),
                     "--max_prompt_length", "20", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    n = DEMO_PROMPT_TOKENS
    assert "prompts: 100 (bad rows skipped: 0)" in lines
    assert f"prompt tokens: min {n} mean {n}.0 p50 {n}.0 p90 {n}.0 p99 {n}.0 max {n}" in lines
    assert "over max_prompt_length 20: 100 (100.0%)" in lines
    assert any(line.startswith("proposed bucket_size: 8 ") for line in lines)
    assert "padding, bucket_size 8 (batches padded to the bucket bound): 4.2% (1 distinct widths)" in lines
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_cli_broken_line_is_one_error_line(demo_dir, tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1="}) for i in range(10)]
    rows[6] = '{"prompt": "6+1=",'
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(rows) + "\n")
    result = run_cli("stats", "--dataset", str(path), "--model_path", str(demo_dir / "model"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"{path}:7: not valid JSON" in result.stderr and "Traceback" not in result.stderr


def test_cli_bad_input_exits_2_with_one_line(demo_dir, tmp_path, capsys):
    val = str(demo_dir / "val.jsonl")
    cases = [
        (["reward-check", "--dataset", val, "--reward_fn", "no_such_rule"], "unknown reward_fn 'no_such_rule'"),
        (["stats", "--dataset", val, "--model_path", str(tmp_path)], "not a model folder (no config.json)"),
        (["stats", "--dataset", str(tmp_path / "none.jsonl"), "--model_path", str(demo_dir / "model")],
         "none.jsonl: no such file"),
    ]
    for argv, message in cases:
        assert data_prep.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


# --- reward-check CLI ---------------------------------------------------------------------------


def test_low_spread_warning_rule():
    assert "reward std 0.000 over 100 samples" in low_spread_warning([1.0] * 100)
    assert low_spread_warning([0.0, 1.0] * 50) is None
    assert low_spread_warning([9.9, 10.1] * 5) is not None  # std 0.1 < 5% of mean 10
    assert low_spread_warning([-0.0004, 0.0004] * 5) is not None  # std 4e-4 < 1e-3 near zero mean


def test_reward_check_reference_answers(demo_dir, tmp_path):
    plot = tmp_path / "reward.png"
    result = run_cli("reward-check", "--dataset", str(demo_dir / "val.jsonl"), "--reward_fn", "demo_arithmetic",
                     "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "reward: count 100 mean 1.0000 std 0.0000 min 1.0000" in result.stdout
    assert "correct: 100 of 100 (100.0%); malformed: 0" in result.stdout
    assert "warning" not in result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reward_check_constant_reward_on_policy_samples_warns(demo_dir, tmp_path):
    (tmp_path / "constant_reward.py").write_text(
        "def score(response, answer):\n    return 0.5, False\n")
    result = run_cli("reward-check", "--dataset", str(demo_dir / "val.jsonl"), "--reward_fn", "constant_reward:score",
                     "--model_path", str(demo_dir / "model"), "--num_samples", "20", "--max_new_tokens", "4",
                     env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert result.returncode == 0, result.stderr
    assert "reward: count 20 mean 0.5000 std 0.0000" in result.stdout
    assert "warning: reward std 0.000 over 20 samples: this reward gives the policy no signal" in result.stderr
