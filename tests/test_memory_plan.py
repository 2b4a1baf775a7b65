"""The memory plan against bytes counted by hand, on the demo model and on Qwen3-30B-A3B."""
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_dapo
from config import Derived, RunConfig, load_config
from memory_plan import GIB, Architecture, Capacity, checkpoint_disk, checkpoint_room, make_plan
from plan_advice import Planning, Suggestion, advice, advise, biggest_overflow, planned_kind, table

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
    assert counted["params"] == 253_696  # as README says of the demo model
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
        # 6 rollout ranks: one prompt x 8 responses each, 64 + 8 tokens, K and V of 2 layers x 2 heads x 32.
        assert plan["rollout_rank"]["kv_cache"] == 8 * 72 * 2 * 2 * 2 * 32 * (4 if dtype == "fp32" else 2)
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
        written_in_place = make_plan(load_config(argv + ["--async_save", "false"]), Derived.of(cfg, 8), model_config,
                                     2**30, with_reference=kl != "0")["learner_rank"]["host"]
        assert written_in_place["checkpoint_copy"] == 0 and written_in_place["total"] == host["total"] - 12 * shard


DEMO_SHAPE = ["--prompts_per_step", "6", "--sample_num", "8", "--max_prompt_length", "64",
              "--max_response_length", "8", "--per_device_batch_size", "8", "--gradient_accumulation_steps", "1"]


def reward_model_hand_count(c) -> int:
    """Parameters of a Qwen3 sequence-classification config written out: no lm_head, a score head."""
    assert not c["attention_bias"] and not c["tie_word_embeddings"]
    hidden, head_dim, heads, kv_heads = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim  # q, o; k, v; q/k norms
    layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden  # gate, up, down; two layer norms
    return c["num_hidden_layers"] * layer + c["vocab_size"] * hidden + hidden + hidden * len(c["id2label"])


def test_the_learners_activations_count_a_wider_no_grad_log_prob_forward(demo_assets):
    """log_prob_batch_size: the learner's activations are the larger of a training micro-batch's
    and a no-grad log-prob forward's (one layer's working set, the logits and their trimmed copy)
    over at most the learner's share of the step's sequences."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(demo_assets / "model")
    arch = Architecture.of(model_config)
    argv = ["--model_path", str(demo_assets / "model"), "--prompts_per_step", "6", "--sample_num", "8",
            "--max_prompt_length", "64", "--max_response_length", "8", "--per_device_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--learner_dtype", "fp32"]

    def activations(*extra: str) -> int:
        cfg = load_config(argv + list(extra))
        return make_plan(cfg, Derived.of(cfg, 8), model_config, 2**30, with_reference=False)["learner_rank"][
            "device"]["activations"]

    training = activations()
    assert activations("--log_prob_batch_size", "8") == training  # as wide as a micro-batch: training's peak
    rows = 48 // 2  # a learner's share: its log-prob forwards never hold more
    forward = (rows * 72 * arch.saved_per_token_layer(4) + 2 * rows * 8 * arch.vocab * 4
               + 2 * 4 * arch.largest_layer_params)
    assert activations("--log_prob_batch_size", "48") == forward > training
    assert activations("--log_prob_batch_size", "400") == forward


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
        assert (f"  reward_model     {params * bytes_per_param / GIB:9.2f} GiB  "
                f"({params * bytes_per_param / rollout['total']:.0%} of the rollout device)") in table(plan, [])
        assert "  reward_model     none (reward_fn math_answer scores)" in table(without, [])
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
        kv_cache = 48 * 72 * 2 * 2 * 2 * 32 * compute
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


# The node the shipped 30B config is written for, rather than this machine's own host memory and
# disk (what --plan checks against by default): room for its 982.5 GiB a node and 1.4 TiB of checkpoints.
TARGET_NODE = ("--host_memory_gb", "1024", "--disk_gb", "2048")


def plan_30b(out: Path, *extra: str, status: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    config = ROOT / "configs" / "models" / "qwen3-30b-a3b"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "train_dapo.py", "--config", "configs/qwen3_30b_a3b_dapo.yaml",
                           "--model_path", str(config), "--output_dir", str(out), *TARGET_NODE, *extra, "--plan"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
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
    # README "Which rollout fits which device", the config's row at 64 GiB
    assert "(the busiest device needs 53.25 GiB: 10.75 GiB to spare)" in proc.stdout
    assert plan["learner_rank"]["device"]["total"] == pytest.approx(13.25 * 2**30, abs=0.005 * 2**30)
    assert "rollout_dtype fp8 is needed: with bf16 weights" in proc.stdout  # 81 GiB a rank with bf16 weights
    assert "learner_offload is needed: without it a learner rank would need 312.8 GiB" in proc.stdout


def test_without_offload_the_30b_plan_says_the_learners_need_it(tmp_path):
    proc, _ = plan_30b(tmp_path, "--learner_offload", "false", "--device_memory_gb", "64", status=1)
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    device = plan["learner_rank"]["device"]
    assert device["params"] + device["grads"] + device["optimizer"] == pytest.approx(
        plan["model"]["params"] * 18 / 2, rel=1e-6)  # 275 GB on a 64 GB device
    assert plan["fits"] is False and "DOES NOT FIT" in proc.stdout
    assert "  - learner_offload true (parameters, gradients and AdamW state, 255.9 GiB a rank, in host memory): " \
           "re-planned: a learner device needs 13.2 GiB of 64.0 GiB, fits" in proc.stdout


def test_a_tensor_parallel_vllm_rollout_is_planned_per_device_and_advised_where_one_device_is_short(tmp_path,
                                                                                                     capsys):
    """The 30B config with vLLM in bf16 on 64 GiB devices: 61 GB of weights do not fit one device,
    and the plan names the rollout_tensor_parallel that does; at 2, each device of an engine holds
    half the weights and, on half the KV heads, the KV cache of its engine's share of the prompts."""
    argv = ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml"), "--model_path",
            str(ROOT / "configs" / "models" / "qwen3-30b-a3b"), "--rollout_engine", "vllm", "--rollout_dtype", "bf16",
            "--device_memory_gb", "64", *TARGET_NODE]
    assert train_dapo.main([*argv, "--output_dir", str(tmp_path / "one"), "--plan"]) == 1
    out = capsys.readouterr().out
    assert "64.00 GiB: DOES NOT FIT (the busiest device needs 81.01 GiB: 17.01 GiB short)" in out
    assert ("rollout_tensor_parallel 2 (one vLLM engine over 2 devices, 3 engines): re-planned: a rollout device "
            "needs 51.4 GiB of 64.0 GiB, fits") in out
    assert train_dapo.main([*argv, "--output_dir", str(tmp_path / "two"), "--rollout_tensor_parallel", "2",
                            "--plan"]) == 0
    out = capsys.readouterr().out
    assert "6 rollout (3 vLLM engines over 2 devices each) + 2 learner" in out
    assert "64.00 GiB: fits (the busiest device needs 51.35 GiB: 12.65 GiB to spare)" in out
    one, two = (json.loads((tmp_path / name / "memory_plan.json").read_text()) for name in ("one", "two"))
    assert one["rollout_rank"]["weights"] == 2 * one["model"]["params"]
    assert two["rollout_rank"]["weights"] == one["model"]["params"]  # bf16 weights over 2 devices
    # 32 prompts over 3 engines: 11, 88 sequences of 2048 + 2048 tokens; 48 layers x 2 of the 4 KV heads x 128.
    assert two["rollout_rank"]["kv_cache"] == 88 * 4096 * 2 * 48 * 2 * 128 * 2
    assert two["vllm"]["kv_cache_memory_bytes"] == two["rollout_rank"]["kv_cache"]  # vLLM's setting is per device
    totals = two["rollout_device_by_tensor_parallel"]  # 3 and 6 divide the rollout ranks, not the 32 heads
    assert list(totals) == ["1", "2"] and totals["1"] == one["rollout_rank"]["total"]
    assert totals["2"] == two["rollout_rank"]["total"]


def test_a_run_that_cannot_fit_is_refused_naming_the_biggest_item(demo_argv, tmp_path, capsys):
    assert train_dapo.main(demo_argv + ["--device_memory_gb", "0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One process: both roles on one device, so the message is about the process, not one role.
    assert len(err) == 1 and err[0].startswith("error: the memory plan does not fit: one process (both roles) needs")
    assert "the biggest item is" in err[0]
    assert not (tmp_path / "run").exists()


# ----- nodes, host memory, disk ------------------------------------------------------------------

MODEL_30B = ROOT / "configs" / "models" / "qwen3-30b-a3b"


def argv_30b(out: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml"), "--model_path", str(MODEL_30B),
            "--output_dir", str(out), *extra]


def host_of_30b_ranks() -> tuple[int, int]:
    """(a learner rank's, a rollout rank's) host memory in the shipped 30B config, counted by hand."""
    c = json.loads((MODEL_30B / "config.json").read_text())
    shard = math.ceil(hand_count(c)["params"] / 2)  # 2 learner ranks
    # Offloaded, per parameter of the shard: fp32 weights 4, the bf16 KL reference 2, gradients 4,
    # AdamW 8, AdamW's step temporary 4, and the checkpoint copy of weights and AdamW 12.
    learner = shard * (4 + 2 + 4 + 8 + 4 + 12)
    # A rollout rank reads the largest parameter (a layer's fused gate_up experts): bf16, fp32, encoded.
    rollout = c["num_experts"] * 2 * c["moe_intermediate_size"] * c["hidden_size"] * (2 + 4 + 1)
    return learner, rollout


def test_plan_16_on_two_nodes_of_8_gives_each_node_its_own_ranks_host_memory(tmp_path, capsys):
    learner, rollout = host_of_30b_ranks()
    # 16 ranks on one node of 1000 GiB: 14 rollout + 2 learner ranks do not fit.
    assert train_dapo.main(argv_30b(tmp_path / "one", "--plan", "16", *TARGET_NODE, "--host_memory_gb", "1000")) == 1
    out = capsys.readouterr().out
    one = json.loads((tmp_path / "one" / "memory_plan.json").read_text())
    assert one["nodes"] == [{"node": 0, "ranks": [0, 15], "rollout_ranks": 14, "learner_ranks": 2, "lead": True,
                             "host": 2 * learner + 14 * rollout}]
    assert "host memory per node: need 1003.55 of 1000.00 GiB (host_memory_gb): DOES NOT FIT (node 0)" in out
    assert ("  - --plan 16 --nnodes 2 (torchrun --nproc_per_node 8 --nnodes 2): re-planned: node 1 needs 982.5 GiB "
            "of 1000.0 GiB, fits") in out
    # Two nodes of 8: ranks 0-7 roll out; on node 1, ranks 8-13 roll out and 14-15 learn (14 leads).
    assert train_dapo.main(argv_30b(tmp_path / "two", "--plan", "16", "--nnodes", "2", *TARGET_NODE,
                                    "--host_memory_gb", "1000")) == 0
    out = capsys.readouterr().out
    two = json.loads((tmp_path / "two" / "memory_plan.json").read_text())
    lead_node, other_node = 2 * learner + 6 * rollout, 8 * rollout
    assert [(n["ranks"], n["rollout_ranks"], n["learner_ranks"], n["lead"], n["host"]) for n in two["nodes"]] == [
        ([0, 7], 8, 0, False, other_node), ([8, 15], 6, 2, True, lead_node)]
    assert (two["node_host_total"], two["most_loaded_node"], two["ranks_per_node"]) == (lead_node, 1, 8)
    assert one["node_host_total"] - two["node_host_total"] == 8 * rollout  # node 0 took 8 rollout ranks
    assert "  node 0 (ranks 0-7: 8 rollout)" in out and "  node 1 (ranks 8-15: 6 rollout + 2 learner, the lead)" in out
    assert "host memory per node: need 982.55 of 1000.00 GiB (host_memory_gb): fits" in out
    assert two["fits"] is True and two["checks"] == {"device": True, "host": True, "disk": True}


def test_host_memory_that_does_not_fit_ends_the_plan_with_status_1_and_advice(tmp_path, capsys):
    learner, _ = host_of_30b_ranks()
    assert train_dapo.main(argv_30b(tmp_path, "--plan", *TARGET_NODE, "--host_memory_gb", "100")) == 1
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["fits"] is False and plan["checks"] == {"device": True, "host": False, "disk": True}
    assert "host memory per node: need 982.55 of 100.00 GiB (host_memory_gb): DOES NOT FIT (node 0)" in out
    # A node holds at most 8 learner ranks, and a step's 256 sequences split over 8 of 32 at most: learner_ranks 8
    # on the second of two nodes of 8 still hold all the learners' host memory there (rollout ranks moved off).
    c = json.loads((MODEL_30B / "config.json").read_text())
    eighth = math.ceil(hand_count(c)["params"] / 8)
    assert ("learner_ranks 8 with --plan 16 --nnodes 2 (torchrun --nproc_per_node 8 --nnodes 2) splits the learners' "
            f"host memory over more of them: still does not fit: node 1 needs {8 * 34 * eighth / GIB:.1f} GiB of "
            f"100.0 GiB") in out
    copies = 2 * 12 * math.ceil(hand_count(c)["params"] / 2)  # both learners' weight and AdamW shards
    assert (f"  - async_save false frees the {copies / GIB:.1f} GiB of checkpoint copies node 0 holds while a "
            f"checkpoint is written; the step then waits about {copies / GIB:.0f} s a save (at disk_write_gb_per_s 1): "
            f"still does not fit: node 0 needs {(plan['node_host_total'] - copies) / GIB:.1f} GiB of 100.0 GiB") in out
    assert "learner_offload false" not in out  # on, and the devices have no room for the learner state
    assert learner * 2 - copies == plan["node_host_total"] - copies - 6 * plan["rollout_rank_host_at_start"]


def test_checkpoints_that_do_not_fit_the_disk_end_the_plan_with_status_1_and_a_keep_last_that_would(tmp_path, capsys):
    params = hand_count(json.loads((MODEL_30B / "config.json").read_text()))["params"]
    per_step, export = 12 * params, 2 * params  # fp32 weights and AdamW's moments; a bf16 Hugging Face export
    for disk, says in (("1100", f"keep_last 2 (3 checkpoints on disk at once): re-planned: the checkpoints need "
                                f"{(3 * per_step + export) / GIB:.1f} GiB of 1100.0 GiB, fits"),
                       ("10", f"not even keep_last 1 fits ({(2 * per_step + export) / GIB:.1f} GiB")):
        assert train_dapo.main(argv_30b(tmp_path / disk, "--plan", *TARGET_NODE, "--disk_gb", disk)) == 1
        out = capsys.readouterr().out
        plan = json.loads((tmp_path / disk / "memory_plan.json").read_text())
        # keep_last 3 complete and the one being written; of any 4 in a row, one exports (every 100th, the last).
        assert plan["checkpoint"]["disk_need"] == 4 * per_step + export
        assert plan["checks"] == {"device": True, "host": True, "disk": False}
        assert (f"checkpoint disk: need {(4 * per_step + export) / GIB:.2f} GiB (341.2 GiB per step x (keep_last 3 + 1) "
                f"+ 56.9 GiB Hugging Face weights x 1) of {float(disk):.2f} GiB free (disk_gb): DOES NOT FIT") in out
        assert f"  - {says}" in out


@pytest.fixture(scope="module")
def planning_30b():
    """Planning of the 30B config with extra settings, on a given device, host, disk and layout;
    the architecture counted once (seconds)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(MODEL_30B)
    arch = Architecture.of(model_config)

    def planning(*extra: str, device_gb: float = 64, host_gb: float = 1024, disk_gb: float = 2048, world: int = 8,
                 nodes: int = 1) -> Planning:
        cfg = load_config(argv_30b(Path("unused"), *extra))
        capacity = Capacity(int(host_gb * GIB), "host_memory_gb", int(disk_gb * GIB), "free (disk_gb)")
        return Planning(cfg, Derived.of(cfg, world, nodes), model_config, arch, int(device_gb * GIB), True, capacity,
                        planned_kind(cfg.run.device, "cpu"))
    return planning


def test_advice_never_names_a_setting_that_is_already_on(planning_30b):
    cases = ((("--learner_offload", "true", "--gradient_checkpointing", "true", "--rollout_dtype", "fp8"), ()),
             (("--learner_offload", "true", "--gradient_checkpointing", "false", "--rollout_dtype", "bf16"),
              ("gradient_checkpointing true", "rollout_dtype fp8")),
             (("--learner_offload", "false", "--rollout_dtype", "fp8"), ("learner_offload true",)))
    for extra, expected in cases:
        planning = planning_30b(*extra, device_gb=1, host_gb=1, disk_gb=1)
        plan = planning.plan()
        assert plan["checks"] == {"device": False, "host": False, "disk": False}
        notes = "\n".join(advice(planning, plan))
        for suggestion in ("learner_offload true", "gradient_checkpointing true", "rollout_dtype fp8 brings"):
            assert (suggestion in notes) is any(suggestion.startswith(e) for e in expected), (suggestion, notes)
        # Every check that does not fit has its advice: the KV cache, the activations, host, disk.
        assert "the KV cache (" in notes and "async_save false frees" in notes and "not even keep_last 1 fits" in notes
        # Smaller micro-batches help where the activations are the learner device's peak: with offload.
        assert ("per_device_batch_size 2, gradient_accumulation_steps 16 (the same mini-batch)" in notes) is \
            (extra[1] == "true")


LEARNER_DEVICE = lambda plan: plan["learner_rank"]["device"]["total"]  # noqa: E731
NEEDS = {"device": lambda plan: plan["device_need"], "rollout": lambda plan: plan["rollout_rank"]["total"],
         "learner": LEARNER_DEVICE, "host": lambda plan: plan["node_host_total"],
         "disk": lambda plan: plan["checkpoint"]["disk_need"]}


def user_applied(planning: Planning, extra: tuple[str, ...], suggestion: Suggestion) -> tuple[dict, Derived]:
    """The plan of the run of ``extra`` given the suggestion's settings after them on its command
    line, laid out as it says (load_config and Derived.of raise what the run would refuse)."""
    flags = [text for key, value in suggestion.changes
             for text in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))]
    cfg = load_config(argv_30b(Path("unused"), *extra, *flags))
    derived = Derived.of(cfg, suggestion.world_size or planning.derived.world_size,
                         suggestion.nodes or planning.derived.nodes)
    return make_plan(cfg, derived, planning.model_config, planning.device_memory, with_reference=True,
                     capacity=planning.capacity, arch=planning.arch), derived


FAILING_30B = {  # the plans of issue 35, each not fitting one way
    "141 GiB without offload": dict(extra=("--learner_offload", "false"), device_gb=141, host_gb=1536, disk_gb=2000),
    "64 GiB, vLLM in bf16": dict(extra=("--rollout_engine", "vllm", "--rollout_dtype", "bf16")),
    "a small host": dict(extra=(), host_gb=100),
    "a small disk": dict(extra=(), disk_gb=1100),
}


@pytest.mark.parametrize("case", FAILING_30B)
def test_every_printed_suggestion_is_accepted_by_the_run_and_its_replan_fits_or_helps(planning_30b, case):
    settings = dict(FAILING_30B[case])
    extra = settings.pop("extra")
    planning = planning_30b(*extra, **settings)
    plan = planning.plan()
    assert plan["fits"] is False
    lines = advise(planning, plan)
    suggested = [(text, suggestion) for text, suggestion in lines if suggestion is not None]
    assert suggested, lines
    for text, suggestion in suggested:
        after, derived = user_applied(planning, extra, suggestion)  # raises if the run refuses it
        need = NEEDS[suggestion.check]
        fits = need(after) <= (plan["host_memory"] if suggestion.check == "host" else
                               plan["disk_free"] if suggestion.check == "disk" else plan["device_memory"])
        assert fits or need(after) < need(plan), text
        said = ": re-planned: " in text and text.endswith(", fits") if fits else ": still does not fit: " in text
        assert said, text
        if (derived.world_size, derived.nodes) != (8, 1):  # the layout it needs is named, for --plan and torchrun
            spread = f" --nnodes {derived.nodes}" if derived.nodes > 1 else ""
            assert (f"--plan {derived.world_size}{spread} (torchrun --nproc_per_node "
                    f"{derived.world_size // derived.nodes}{spread})") in text
        learners = dict(suggestion.changes).get("learner_ranks")
        assert learners is None or derived.world_size > learners  # never "learner_ranks 8" on 8 ranks
    texts = "\n".join(text for text, _ in lines)
    if case == "141 GiB without offload":
        eighth = math.ceil(plan["model"]["params"] / 8)
        # fp32 weights 4, the bf16 KL reference 2, gradients 4, AdamW 8; then AdamW's step temporary or the activations
        on_device = 18 * eighth + max(plan["learner_rank"]["device"]["activations"], 4 * eighth)
        assert (f"learner_ranks 8 with --plan 16 --nnodes 2 (torchrun --nproc_per_node 8 --nnodes 2) shards that "
                f"state over them: re-planned: a learner device needs {on_device / GIB:.1f} GiB of 141.0 GiB, "
                f"fits") in texts
        assert "learner_offload true (parameters, gradients and AdamW state" in texts
    if case == "64 GiB, vLLM in bf16":
        assert "rollout_tensor_parallel 2 (one vLLM engine over 2 devices, 3 engines): re-planned" in texts


def test_a_suggestion_the_named_device_cannot_run_is_never_printed(planning_30b):
    vllm_fp8 = Suggestion((("rollout_dtype", "fp8"),), "rollout")
    for device, accepted in (("npu", False), ("cuda", True), ("auto", True)):
        planning = planning_30b("--rollout_engine", "vllm", "--rollout_dtype", "bf16", "--device", device)
        assert (planning.changed(vllm_fp8) is not None) is accepted
        texts = "\n".join(advice(planning, planning.plan()))
        assert ("rollout_dtype fp8 brings the rollout weights" in texts) is accepted
        assert "rollout_engine builtin, rollout_dtype fp8 (our FP8: on npu too): re-planned" in texts
    # --device auto plans for the accelerator found, and for every kind on a CPU.
    assert [planned_kind("auto", "npu"), planned_kind("auto", "cpu"), planned_kind("cuda", "cpu")] == ["npu", None, "cuda"]
    # learner_ranks 6 does not split 256 sequences into mini-batches of 32; 8 ranks cannot hold 8 learners.
    planning = planning_30b("--learner_offload", "false")
    assert planning.changed(Suggestion((("learner_ranks", 6),), "learner", world_size=16, nodes=2)) is None
    assert planning.changed(Suggestion((("learner_ranks", 8),), "learner")) is None
    assert planning.changed(Suggestion((("learner_ranks", 8),), "learner", world_size=16, nodes=2)) is not None


def test_the_two_checkpoint_modes_are_the_hand_computed_ones(planning_30b):
    learner, rollout = host_of_30b_ranks()
    params = hand_count(json.loads((MODEL_30B / "config.json").read_text()))["params"]
    shard = math.ceil(params / 2)
    plan = planning_30b().plan()
    ck = plan["checkpoint"]
    true, false = ck["modes"]["true"], ck["modes"]["false"]
    per_learner = 12 * shard  # fp32 weights and AdamW's two moments of a learner's shard
    for mode in (true, false):
        assert (mode["written_per_learner_rank"], mode["written_per_node"]) == (per_learner, 2 * per_learner)
        assert mode["seconds_per_save"] == pytest.approx(2 * per_learner / GIB)  # 1 GiB/s a node by default
        assert mode["disk_need"] == ck["disk_need"] == 4 * 12 * params + 2 * params
    assert true["busiest_node_host"] == plan["node_host_total"] == 2 * learner + 6 * rollout
    assert false["busiest_node_host"] == 2 * (learner - per_learner) + 6 * rollout  # no host copy
    assert (true["step_waits_for_the_write_s"], false["step_waits_for_the_write_s"]) == (0, false["seconds_per_save"])
    lines = table(plan, [])
    assert (f"  host, busiest node   {true['busiest_node_host'] / GIB:>14.1f} GiB "
            f"{false['busiest_node_host'] / GIB:>14.1f} GiB") in lines
    assert f"  the step waits        for the host copy {f'{2 * per_learner / GIB:.0f} s a save':>18}" in lines
    # Written in place, the plan holds no copy; the modes are the same numbers.
    in_place = planning_30b("--async_save", "false", "--disk_write_gb_per_s", "2.5").plan()
    assert in_place["learner_rank"]["host"]["checkpoint_copy"] == 0
    assert in_place["node_host_total"] == in_place["checkpoint"]["modes"]["false"]["busiest_node_host"] == \
        false["busiest_node_host"]
    assert in_place["checkpoint"]["modes"]["false"]["seconds_per_save"] == pytest.approx(2 * per_learner / GIB / 2.5)
    # 8 learners on the second of two nodes: each writes an eighth, the node all of it.
    spread = planning_30b("--learner_ranks", "8", world=16, nodes=2).plan()["checkpoint"]["modes"]["true"]
    assert spread["written_per_learner_rank"] == 12 * math.ceil(params / 8)
    assert spread["written_per_node"] == 8 * 12 * math.ceil(params / 8)
    assert planning_30b("--save_every", "0").plan()["checkpoint"]["modes"]["false"]["written_per_node"] == 0


def readme_plan_command() -> list[str]:
    """The command of README "Will it fit? The memory plan", as a shell reads it."""
    section = (ROOT / "README.md").read_text().split("## Will it fit? The memory plan\n")[1].split("\n## ")[0]
    block = re.search(r"\n    (python train_dapo\.py .*?)\n\n", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def test_the_readmes_plan_command_runs_as_written_and_fits(tmp_path, monkeypatch, capsys):
    argv = readme_plan_command()
    assert argv[:2] == ["python", "train_dapo.py"] and "--plan" in argv
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # its relative paths, and its runs/plan under tmp_path
    monkeypatch.chdir(tmp_path)
    assert train_dapo.main(argv[2:]) == 0
    out = capsys.readouterr().out
    checks = [line for line in out.splitlines() if line.startswith(("device memory:", "host memory per node:",
                                                                     "checkpoint disk:"))]
    assert len(checks) == 3 and all(": fits" in line for line in checks) and "DOES NOT FIT" not in out
    # What the README says of it.
    section = (ROOT / "README.md").read_text().split("## Will it fit? The memory plan\n")[1].split("\n## ")[0]
    for number in ("312.8 GiB", "53.25 GiB", "13.25 GiB", "982.55 GiB"):
        assert number in section and number in out, number
    assert "  reward_model     none (reward_fn math_answer scores)" in out
    assert ("  npu (Atlas A2/A3): builtin (FP8 as e4m3 codes in uint8) fp8, bf16, fp32; vllm (vllm-ascend: no FP8) "
            "bf16, fp32; vllm there: rollout_engine vllm, rollout_dtype bf16, rollout_tensor_parallel 2: re-planned: "
            "a rollout device needs 51.4 GiB of 64.0 GiB, fits") in out
    assert "  cuda: builtin and vllm fp8, bf16, fp32" in out
    plan = json.loads((tmp_path / "runs" / "plan" / "memory_plan.json").read_text())
    assert plan["advice"] == [{"text": line.removeprefix("  - ")} for line in out.splitlines()
                              if line.startswith("  - ")]
    assert set(plan["checkpoint"]["modes"]) == {"true", "false"}


def test_nodes_that_do_not_split_the_ranks_evenly_are_refused_in_one_line(tmp_path, capsys):
    for inspection in ("--plan", "--dry_run"):
        assert train_dapo.main(argv_30b(tmp_path / "out", inspection, "16", "--nnodes", "3")) == 2
        assert capsys.readouterr().err.splitlines() == [
            "error: --nnodes 3 does not split 16 ranks evenly: every node runs WORLD_SIZE / nnodes ranks "
            "(nodes that fit: 1, 2, 4, 8, 16)"]
    assert not (tmp_path / "out").exists()


def test_a_run_is_refused_when_its_nodes_host_memory_or_the_disk_it_is_given_cannot_hold_it(demo_argv, tmp_path,
                                                                                             capsys):
    for extra, says in ((["--host_memory_gb", "0.001"], "node 0 (rank 0: both roles, the lead) needs 3.5 MiB of "
                                                         "host memory, 1.0 MiB a node (host_memory_gb)"),
                        (["--disk_gb", "0.001"], "checkpoints need")):
        assert train_dapo.main(demo_argv + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: the memory plan does not fit: {says}"), err
    assert not (tmp_path / "run").exists()


def test_checkpoints_on_disk_at_once_are_keep_last_and_the_one_being_written():
    def on_disk(**run) -> tuple[int, int, int]:
        settings = {"max_steps": 1000, "save_every": 1, "keep_last": 3, "hf_export_every": 0, **run}
        counted = checkpoint_disk(RunConfig(**settings), 10, 1)
        return counted["copies"], counted["exports"], counted["disk_need"]

    assert on_disk() == (4, 1, 41)  # the last step's export
    assert on_disk(hf_export_every=2) == (4, 2, 42)  # of 4 steps in a row, 2 are even
    assert on_disk(max_steps=5, save_every=2) == (3, 1, 31)  # the run writes steps 2, 4 and 5 only
    assert on_disk(save_every=0) == (0, 0, 0)


def test_the_room_for_checkpoints_is_what_is_free_and_this_runs_own(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=5 * 2**20))
    out = tmp_path / "run"
    assert checkpoint_room(out) == (5 * 2**20, f"free under {tmp_path}")  # before the run creates output_dir
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)
    (out / "checkpoints" / "step_00000001" / "weights").write_bytes(b"x" * 3 * 2**20)
    assert checkpoint_room(out) == (8 * 2**20, f"free under {out} + 3.0 MiB of this run's checkpoints")


@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_float32_router_weights_are_planned_where_the_installed_router_keeps_them(demo_assets, checkpointing):
    """transformers 5.5.4's Qwen3-MoE router hands the experts float32 top-k weights (later releases
    the compute dtype's), which make the experts' weighted outputs float32: the plan asks the
    installed router (on meta, as a real bf16 router computes here) and, where float32, counts for
    a bf16 learner one layer's backward's three float32 routed outputs and each saved layer's
    weights, per token (the dry run measures them: tests/test_dry_run.py); for fp32, nothing."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from routing import moe_routers

    model_config = AutoConfig.from_pretrained(demo_assets / "model")
    arch = Architecture.of(model_config)
    router = moe_routers(AutoModelForCausalLM.from_config(model_config).to(torch.bfloat16))[0]
    weights = router(torch.randn(5, arch.hidden, dtype=torch.bfloat16))[1]
    assert arch.router_weights_fp32 == (weights.dtype == torch.float32)

    def activations(router_weights_fp32: bool, dtype: str) -> int:
        cfg = load_config(["--model_path", str(demo_assets / "model"), *DEMO_SHAPE, "--learner_dtype", dtype,
                           "--gradient_checkpointing", checkpointing])
        return make_plan(cfg, Derived.of(cfg, 8), model_config, 2**30, with_reference=False,
                         arch=dataclasses.replace(arch, router_weights_fp32=router_weights_fp32))[
            "learner_rank"]["device"]["activations"]

    tokens, layers = 8 * 72, 1 if checkpointing == "true" else arch.layers
    promoted = 4 - 2  # bytes a value gains from bf16 to float32
    routed = tokens * arch.experts_per_token * (3 * arch.hidden + layers) * promoted
    assert activations(True, "bf16") - activations(False, "bf16") == routed > 0
    assert activations(True, "fp32") == activations(False, "fp32")


def test_a_token_budget_sizes_the_learners_activations_and_the_plan_says_which_fits(tmp_path):
    """use_dynamic_bsz: the activations of ppo_max_token_len_per_gpu tokens (their logits counted
    for every one: a packed micro-batch may be almost all response), log-prob forwards of
    log_prob_max_token_len_per_gpu; the plan names the largest budget that fits, and advises it
    where the set one does not."""
    by_rows, _ = plan_30b(tmp_path / "rows")
    budget, _ = plan_30b(tmp_path / "budget", "--use_dynamic_bsz", "true", "--ppo_max_token_len_per_gpu", "16384",
                         "--log_prob_max_token_len_per_gpu", "32768")
    rows_plan, plan = (json.loads((tmp_path / name / "memory_plan.json").read_text()) for name in ("rows", "budget"))
    tokens = plan["learner_tokens"]
    assert tokens["by"] == "budget" and tokens["tokens"] == 16384 and tokens["log_prob_tokens"] == 32768
    assert rows_plan["learner_tokens"]["tokens"] == 4 * 4096  # per_device_batch_size 4 full-length rows
    # The same tokens, but logits for all of them rather than the 4 x 2048 response tokens of full rows.
    assert plan["learner_rank"]["device"]["activations"] > rows_plan["learner_rank"]["device"]["activations"]
    fitting = tokens["largest_fitting_budget"]
    assert fitting % 1024 == 0 and fitting > 16384 and plan["fits"] is True
    assert f"ppo_max_token_len_per_gpu up to {fitting} fits" in budget.stdout
    too_wide, _ = plan_30b(tmp_path / "wide", "--use_dynamic_bsz", "true", "--ppo_max_token_len_per_gpu", "200000",
                           status=1)
    assert f"  - ppo_max_token_len_per_gpu {fitting} (the largest token budget whose activations fit): re-planned: " \
           f"a learner device needs" in too_wide.stdout
    # A budget under one full-length sequence still plans for one: a longer row runs alone.
    plan_30b(tmp_path / "narrow", "--use_dynamic_bsz", "true", "--ppo_max_token_len_per_gpu", "1000")
    narrow = json.loads((tmp_path / "narrow" / "memory_plan.json").read_text())["learner_tokens"]
    assert narrow["tokens"] == narrow["log_prob_tokens"] == 4096
