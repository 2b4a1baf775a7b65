"""The memory plan against bytes counted by hand, on the demo model and on Qwen3-30B-A3B."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_dapo
from config import Derived, load_config
from memory_plan import biggest_overflow, make_plan, table

ROOT = Path(__file__).resolve().parents[1]


def hand_count(c) -> dict[str, int]:
    """Parameters of a Qwen3-MoE config written out layer by layer, and what FP8 stores of them."""
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    hidden, experts, inter = c["hidden_size"], c.get("num_local_experts") or c["num_experts"], c["moe_intermediate_size"]
    linear = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
              "gate_up": (experts * 2 * inter, hidden), "down": (experts * hidden, inter)}  # (rows, columns)
    small = 2 * c["head_dim"] + 2 * hidden + experts * hidden  # q/k norms, two layer norms, router
    layers = c["num_hidden_layers"]
    embed = c["vocab_size"] * hidden
    others = layers * small + embed + hidden + (0 if c["tie_word_embeddings"] else embed)
    quantized = layers * sum(rows * cols for rows, cols in linear.values())
    rows = layers * sum(rows for rows, _ in linear.values())
    return {"params": quantized + others, "fp8_bytes": quantized + 4 * rows + 2 * others}


def test_the_demo_models_plan_is_the_hand_computed_one(demo_assets, tmp_path):
    from transformers import AutoConfig

    c = json.loads((demo_assets / "model" / "config.json").read_text())
    counted = hand_count(c)
    assert counted["params"] == 229_056  # as README says of the demo model
    # The FP8 copy is measured with its buffers: the rotary embedding's float32 inverse
    # frequencies, twice (transformers keeps the original beside the current ones).
    rotary_buffers = 2 * c["head_dim"] // 2 * 4
    model_config = AutoConfig.from_pretrained(demo_assets / "model")
    for dtype, kl in (("fp32", "0"), ("fp8", "0.1")):
        argv = ["--model_path", str(demo_assets / "model"), "--rollout_dtype", dtype, "--kl_coef", kl,
                "--prompts_per_step", "6", "--sample_num", "8", "--max_prompt_length", "64",
                "--max_response_length", "8", "--per_device_batch_size", "8", "--gradient_accumulation_steps", "1"]
        cfg = load_config(argv)
        plan = make_plan(cfg, Derived.of(cfg, 8), model_config, 2**30, with_reference=kl != "0")
        params = counted["params"]
        assert plan["model"]["params"] == params
        # 6 rollout ranks: one prompt x 8 responses each, 64 + 8 tokens, K and V of 2 layers x 2 heads x 16.
        assert plan["rollout_rank"]["kv_cache"] == 8 * 72 * 2 * 2 * 2 * 16 * (4 if dtype == "fp32" else 2)
        weights = 4 * params if dtype == "fp32" else counted["fp8_bytes"] + rotary_buffers
        assert plan["rollout_rank"]["weights"] == weights
        shard = params // 2 + params % 2  # FSDP2 over 2 learner ranks
        device, host = plan["learner_rank"]["device"], plan["learner_rank"]["host"]
        # fp32 master weights, and beside them the frozen KL reference in the bf16 FSDP2 computes in.
        assert device["params"] == 4 * shard + (2 * shard if kl != "0" else 0)
        assert (device["grads"], device["optimizer"]) == (4 * shard, 8 * shard)
        # Nothing whole on the host: each learner's copy of its weight and AdamW shards for a checkpoint.
        assert (host["params"], host["grads"], host["optimizer"], host["checkpoint_copy"]) == (0, 0, 0, 12 * shard)
        # Rollout ranks read one parameter at a time: the largest is a layer's fused gate_up experts.
        largest = c["num_local_experts"] * 2 * c["moe_intermediate_size"] * c["hidden_size"]
        assert plan["rollout_rank_host_at_start"] == largest * (4 + 4 + 1)  # fp32 files, fp32, encoded bytes
        assert plan["node_host_total"] == 2 * host["total"] + 6 * plan["rollout_rank_host_at_start"]
        assert plan["fits"] is True
        offloaded = make_plan(load_config(argv + ["--learner_offload", "true"]), Derived.of(cfg, 8), model_config,
                              2**30, with_reference=kl != "0")["learner_rank"]
        assert offloaded["device"]["total"] == offloaded["device"]["activations"] == device["activations"]
        assert [offloaded["host"][k] for k in ("params", "grads", "optimizer")] == \
            [device["params"], 4 * shard, 8 * shard]


DEMO_SHAPE = ["--prompts_per_step", "6", "--sample_num", "8", "--max_prompt_length", "64",
              "--max_response_length", "8", "--per_device_batch_size", "8", "--gradient_accumulation_steps", "1"]


def reward_model_hand_count(c) -> int:
    """Parameters of a Qwen3 sequence-classification config written out: no lm_head, a score head."""
    assert not c["attention_bias"] and not c["tie_word_embeddings"]
    hidden, head_dim, heads, kv_heads = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim  # q, o; k, v; q/k norms
    layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden  # gate, up, down; two layer norms
    return c["num_hidden_layers"] * layer + c["vocab_size"] * hidden + hidden + hidden * len(c["id2label"])


def test_a_reward_model_is_counted_on_each_rollout_rank_in_the_rollouts_compute_dtype(demo_assets, tmp_path):
    from transformers import AutoConfig

    from tests.test_rewards import _save_tiny_reward_model

    reward_model = _save_tiny_reward_model(tmp_path / "reward_model")
    params = reward_model_hand_count(json.loads((tmp_path / "reward_model" / "config.json").read_text()))
    assert params == 1 * (2 * 32 * 32 + 2 * 32 * 16 + 16 + 3 * 32 * 64 + 64) + 103 * 32 + 32 + 32  # 11,024
    model_config = AutoConfig.from_pretrained(demo_assets / "model")
    for rollout_dtype, bytes_per_param in (("bf16", 2), ("fp8", 2), ("fp32", 4)):  # FP8 rollout computes in bf16
        argv = ["--model_path", str(demo_assets / "model"), "--rollout_dtype", rollout_dtype, *DEMO_SHAPE]
        without = make_plan(load_config(argv), Derived.of(load_config(argv), 8), model_config, None,
                            with_reference=False)
        cfg = load_config(argv + ["--reward_model", reward_model])
        plan = make_plan(cfg, Derived.of(cfg, 8), model_config, None, with_reference=False)
        rollout = plan["rollout_rank"]
        assert plan["reward_model"]["params"] == params
        assert rollout["reward_model"] == params * bytes_per_param
        assert rollout["total"] == without["rollout_rank"]["total"] + params * bytes_per_param
        assert plan["learner_rank"] == without["learner_rank"]  # the learners never load it
        # A device with room for the rollout rank's policy side but not for its reward model too.
        tight = make_plan(cfg, Derived.of(cfg, 8), model_config, rollout["total"] - 1, with_reference=False)
        assert tight["fits"] is False and biggest_overflow(tight).startswith("a rollout rank needs")
        # One process holds it too, on its one device.
        single = make_plan(cfg, Derived.of(cfg, 1), model_config, None, with_reference=False)
        assert single["rollout_rank"]["reward_model"] == params * bytes_per_param
        assert single["one_process"]["steady_state"] == single["learner_rank"]["device"]["total"] + \
            single["rollout_rank"]["total"]


def test_a_reward_model_folder_without_a_config_is_said_to_be_left_out(demo_assets, tmp_path):
    from transformers import AutoConfig

    cfg = load_config(["--model_path", str(demo_assets / "model"), "--reward_model", str(tmp_path / "absent"),
                       *DEMO_SHAPE])
    plan = make_plan(cfg, Derived.of(cfg, 8), AutoConfig.from_pretrained(demo_assets / "model"), None,
                     with_reference=False)
    assert plan["reward_model"]["bytes"] is None and "reward_model" not in plan["rollout_rank"]
    assert f"reward_model     not counted: {tmp_path / 'absent'} has no config.json" in table(plan, [])


def test_one_process_holds_the_learner_and_the_rollout_on_one_device_and_plans_the_fp32_copy(demo_assets):
    from transformers import AutoConfig

    c = json.loads((demo_assets / "model" / "config.json").read_text())
    counted = hand_count(c)
    params, rotary_buffers = counted["params"], 2 * c["head_dim"] // 2 * 4
    experts, hidden, inter = c["num_local_experts"], c["hidden_size"], c["moe_intermediate_size"]
    largest = max(experts * 2 * inter * hidden, c["vocab_size"] * hidden)  # fused gate_up experts, or the embedding
    model_config = AutoConfig.from_pretrained(demo_assets / "model")
    for rollout_dtype, kl in (("fp32", "0"), ("bf16", "0.1"), ("fp8", "0")):
        cfg = load_config(["--model_path", str(demo_assets / "model"), "--rollout_dtype", rollout_dtype,
                           "--kl_coef", kl, *DEMO_SHAPE])
        plan = make_plan(cfg, Derived.of(cfg, 1), model_config, None, with_reference=kl != "0")
        learner, rollout, single = plan["learner_rank"]["device"], plan["rollout_rank"], plan["one_process"]
        # The learner (bf16, so FSDP2 over its one rank): fp32 weights (and the KL reference, bf16 as
        # FSDP2 computes in bf16), gradients and AdamW, then the larger of the activations (an
        # estimate) and AdamW's one-shard temporary.
        weights = 4 * params + (2 * params if kl != "0" else 0)
        learner_total = weights + 4 * params + 8 * params + max(learner["activations"], 4 * params)
        # The rollout side: every sequence of the step on this one device (6 x 8 of 64 + 8 tokens).
        compute = 4 if rollout_dtype == "fp32" else 2
        rollout_weights = {"fp32": 4 * params, "bf16": 2 * params, "fp8": counted["fp8_bytes"] + rotary_buffers}
        kv_cache = 48 * 72 * 2 * 2 * 2 * 16 * compute
        rollout_total = rollout_weights[rollout_dtype] + kv_cache + rollout["activations"]
        assert (learner["params"], learner["total"], rollout["total"]) == (weights, learner_total, rollout_total)
        # Steady state: both roles together. Start-up: the learner's weights and the rollout copy's fp32
        # copy of the policy, one parameter of which is cast beside its original (the fp32 copy is
        # the rollout copy itself when the rollout is fp32).
        steady = learner_total + rollout_total
        start_up = weights + 4 * params + (0 if rollout_dtype == "fp32" else largest * compute)
        assert (single["steady_state"], single["start_up"]) == (steady, start_up)
        assert single["total"] == max(steady, start_up) == steady and single["peak_at"] == "steady state"
        # Each role would fit the device alone; both on it do not.
        tight = make_plan(cfg, Derived.of(cfg, 1), model_config, steady - 1, with_reference=kl != "0")
        assert max(learner_total, rollout_total) <= steady - 1 and tight["fits"] is False
        assert biggest_overflow(tight).startswith("one process (both roles) needs")
        assert make_plan(cfg, Derived.of(cfg, 1), model_config, steady, with_reference=kl != "0")["fits"] is True


def plan_30b(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    config = ROOT / "configs" / "models" / "qwen3-30b-a3b"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/qwen3_30b_a3b_dapo.yaml",
                           "--model_path", str(config), "--output_dir", str(out), *extra, "--plan"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, time.monotonic() - start


def test_the_30b_plan_prints_fast_fits_with_its_settings_and_matches_a_hand_count(tmp_path):
    counted = hand_count(json.loads((ROOT / "configs" / "models" / "qwen3-30b-a3b" / "config.json").read_text()))
    proc, seconds = plan_30b(tmp_path / "shipped")
    assert seconds < 30  # 4-7 s here; the issue asks for 10 s on this CPU, the margin is for slower machines
    plan = json.loads((tmp_path / "shipped" / "memory_plan.json").read_text())
    params = plan["model"]["params"]
    assert params == counted["params"] and abs(params - 30.53e9) < 0.01e9
    assert plan["rollout_rank"]["weights"] == pytest.approx(counted["fp8_bytes"], rel=1e-4)
    # 32 prompts x 8 over 6 rollout ranks: 6 prompts, 48 sequences of 2048 + 2048 tokens, 48 layers x 4 KV heads x 128.
    assert plan["rollout_rank"]["kv_cache"] == 48 * 4096 * 2 * 48 * 4 * 128 * 2
    device, host = plan["learner_rank"]["device"], plan["learner_rank"]["host"]
    assert device["params"] + device["grads"] + device["optimizer"] == 0  # learner_offload: true
    # 30.5B x (4 + 4 + 8) bytes over 2 learners, plus the bf16 KL reference (kl_coef_init 0.05), in host memory.
    assert host["params"] + host["grads"] + host["optimizer"] == pytest.approx(params * 18 / 2, rel=1e-6)
    assert plan["fits"] is True and "device memory:     64.00 GiB: fits" in proc.stdout
    assert "rollout_dtype fp8 is needed: with bf16 weights" in proc.stdout  # 81 GiB a rank with bf16 weights
    assert "learner_offload is needed: without it a learner rank would need 312.8 GiB" in proc.stdout


def test_without_offload_the_30b_plan_says_the_learners_need_it(tmp_path):
    proc, _ = plan_30b(tmp_path, "--learner_offload", "false", "--device_memory_gb", "64")
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    device = plan["learner_rank"]["device"]
    assert device["params"] + device["grads"] + device["optimizer"] == pytest.approx(
        plan["model"]["params"] * 18 / 2, rel=1e-6)  # 275 GB on a 64 GB device
    assert plan["fits"] is False and "DOES NOT FIT" in proc.stdout
    assert "the learners need learner_offload: true" in proc.stdout


def test_a_run_that_cannot_fit_is_refused_naming_the_biggest_item(demo_argv, tmp_path, capsys):
    assert train_dapo.main(demo_argv + ["--device_memory_gb", "0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One process: both roles on one device, so the message is about the process, not one role.
    assert len(err) == 1 and err[0].startswith("error: the memory plan does not fit: one process (both roles) needs")
    assert "the biggest item is" in err[0]
    assert not (tmp_path / "run").exists()
