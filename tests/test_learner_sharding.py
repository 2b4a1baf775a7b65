"""Learners that hold only their shards, under torchrun (1 rollout + 2 learner ranks) on a model
wide enough (~13M parameters, 52 MB in fp32) for a whole fp32 copy to stand out: offload on and
off give the same run, the lead learner holds no whole copy of the weights, and the Hugging Face
export is the same whether the run or ``python ckpt.py export`` writes it. And, in this process
on a one-rank mesh, when FSDP2 gathers the root's parameters."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.test_ranks import metrics_rows, torchrun

ROOT = Path(__file__).resolve().parents[1]
LAYERS, EXPERTS, HIDDEN, EXPERT_WIDTH = 4, 8, 512, 256


def wide_model(demo_assets: Path, out: Path) -> int:
    """The demo model's family and tokenizer, widened; returns its fp32 size in bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(demo_assets / "model")
    config.update({"num_hidden_layers": LAYERS, "num_experts": EXPERTS, "hidden_size": HIDDEN,
                   "moe_intermediate_size": EXPERT_WIDTH, "intermediate_size": EXPERT_WIDTH})
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(demo_assets / "model").save_pretrained(out)
    return 4 * sum(p.numel() for p in model.parameters())


# A user's Trainer (README) that counts, after each weight hand-off, the bytes of every host tensor
# the process holds (each storage once): the same figure on every run and machine, unlike RSS,
# which follows malloc's reuse of freed memory (it varied by +-200 MB between runs here).
CENSUS = """
import gc, json, os, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
import train_dapo


def host_tensor_bytes():
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (NotImplementedError, RuntimeError):  # a DTensor wrapper (its local shard counts), freed storage
                continue
    return sum(storages.values())


class Census(train_dapo.Trainer):
    most = 0

    def hand_off(self, version, collected):
        waited = super().hand_off(version, collected)
        self.count()
        return waited

    def follow_hand_off(self, version):
        super().follow_hand_off(version)
        self.count()

    def count(self):
        # Not beside the checkpoint writer thread: gc.get_objects() can take a reference to a tuple
        # that thread is still building, and CPython's tuple resize then raises SystemError there.
        self.learner.writer.wait()
        Census.most = max(Census.most, host_tensor_bytes())
        Path(self.cfg.run.output_dir, f"census_{self.layout.rank}.json").write_text(json.dumps(Census.most))


sys.exit(train_dapo.main(sys.argv[1:], trainer_class=Census))
"""


def args(script: Path, demo_assets: Path, model: Path, out: Path, offload: str) -> list[str]:
    return [str(script), "--config", "configs/demo_cpu.yaml", "--model_path", str(model),
            "--dataset", str(demo_assets / "train.jsonl"), "--val_dataset", str(demo_assets / "val.jsonl"),
            "--output_dir", str(out), "--max_steps", "2",
            "--val_every", "0", "--save_every", "1", "--hf_export_every", "0", "--hf_export_file_mb", "8",
            "--weight_sync_bucket_mb", "8", "--gradient_accumulation_steps", "3", "--learner_ranks", "2",
            "--dist_timeout_s", "120", "--dynamic_sampling", "false", "--learner_offload", offload,
            "--routing_replay", "true"]


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    model_bytes = wide_model(demo_assets, root / "model")
    script = root / "census.py"
    script.write_text(CENSUS)
    outputs = {}
    for offload in ("false", "true"):
        out = root / f"offload_{offload}"
        proc = torchrun(3, args(script, demo_assets, root / "model", out, offload), timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outputs[offload] = (out, proc.stdout)
    return model_bytes, outputs


def step_folder(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def test_offload_moves_the_learner_state_to_the_host_and_changes_no_result(runs):
    _, outputs = runs
    (plain, plain_log), (offloaded, offloaded_log) = outputs["false"], outputs["true"]
    assert "learner: FSDP2 over 2 learner rank(s); fp32 weights, gradients and AdamW state on the device" in plain_log
    assert "AdamW state in host memory (learner_offload)" in offloaded_log
    # The same arithmetic on a CPU: equal to the last bit (on an accelerator AdamW runs on the host
    # instead of the device, and kernels may round differently).
    assert metrics_rows(plain) == metrics_rows(offloaded)
    # Routing replay under FSDP2 on both learners (each would stop at samples without their ids).
    assert all(0 <= float(row["routing_mismatch"]) <= 1 for row in metrics_rows(plain)[1:])
    files = sorted((step_folder(plain, 2) / "model").glob("*.safetensors"))
    assert files
    for file in files:
        assert file.read_bytes() == (step_folder(offloaded, 2) / "model" / file.name).read_bytes(), file.name


def test_the_lead_learner_holds_no_whole_copy_of_the_weights(runs):
    model_bytes, outputs = runs
    for offload, (out, log) in outputs.items():
        lead, other = (json.loads((out / f"census_{rank}.json").read_text()) for rank in (1, 2))
        # The lead's extra is the sync buffer (one 8 MB parameter, 0.16 of the model) and the
        # samples; the old lead kept a whole fp32 copy of the weights for weight sync and
        # checkpoints: 1.08 of the model more, measured.
        assert lead - other < 0.5 * model_bytes, (offload, lead - other, model_bytes)
        roles = [entry["role"] for entry in json.loads((out / "memory_used.json").read_text())["ranks"]]
        assert roles == ["rollout", "learner (lead)", "learner"] and "peak memory per rank" in log


def test_the_export_is_written_from_the_shards_and_the_command_writes_the_same(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = runs[1]["false"]
    assert not (step_folder(out, 1) / "model").exists()  # hf_export_every 0: the last step only
    exported = step_folder(out, 2) / "model"
    files = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(files) > 4 and (exported / "model.safetensors.index.json").is_file()  # 8 MB files from 52 MB
    _, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "ckpt.py", "export", str(step_folder(out, 2)), str(again),
                           "--max_file_mb", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in exported.iterdir())
    assert (exported / "generation_config.json").is_file()  # the base model's sampling defaults travel along
    for name in files + ["model.safetensors.index.json", "config.json"]:
        assert (again / name).read_bytes() == (exported / name).read_bytes(), name
    first = tmp_path / "first"
    proc = subprocess.run([sys.executable, "ckpt.py", "export", str(step_folder(out, 1)), str(first)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _, info = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)  # one 52 MB file
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_root_stays_gathered_from_forward_to_backward_unless_frozen(demo_assets):
    """The root's own parameters (embeddings, final norm, lm_head) are gathered once per micro-batch:
    after the forward they are still whole (FSDP2 registers the unsharded tensors) for the backward,
    which needs them first, while each layer is sharded again. The frozen KL reference has no
    backward, so its root shards again at once instead of staying gathered all run."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from learner import build_model, fill_from_files

    def gathered(module: torch.nn.Module) -> bool:
        return not any(isinstance(p, DTensor) for p in module.parameters(recurse=False))

    path = demo_assets / "model"
    if dist.is_initialized():  # a one-process bf16 Trainer of an earlier test keeps its world
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        policy, reference = (build_model(path, torch.device("cpu"), mesh, learner_dtype="bf16", frozen=frozen)
                             for frozen in (False, True))
        for model in (policy, reference):
            fill_from_files(model, path)
        ids = torch.randint(3, 90, (2, 8))
        loss = policy(input_ids=ids).logits.float().logsumexp(-1).sum()
        assert gathered(policy.model.embed_tokens) and gathered(policy.model.norm)
        assert not gathered(policy.model.layers[0].self_attn.q_proj)
        loss.backward()
        assert not gathered(policy.model.embed_tokens)  # sharded again once its gradient is reduced
        with torch.no_grad():
            reference(input_ids=ids)
        assert not gathered(reference.model.embed_tokens) and not gathered(reference.model.norm)
    finally:
        dist.destroy_process_group()
