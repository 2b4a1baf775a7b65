"""Hugging Face files read a piece at a time and written from pieces: the rows a learner reads
are the rows from_pretrained holds, a model built on the meta device and filled from the files
computes what from_pretrained's does, and an export written by two writers opens as the model."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_weights
from config import UserError
from learner import build_model, fill_from_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(demo_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_assets / "model", dtype=torch.float32).eval()


def test_any_rows_of_any_parameter_are_what_from_pretrained_holds(demo_assets, reference):
    files = hf_weights.WeightFiles(demo_assets / "model")
    named = dict(reference.named_parameters())
    assert any(name.endswith("experts.gate_up_proj") for name in named)  # fused in memory, per expert on disk
    for name, param in named.items():
        rows = param.shape[0]
        for start, stop in ((0, rows), (1, rows // 2 + 1), (rows - 1, rows), (rows, rows)):
            assert torch.equal(files.rows(name, param.shape, start, stop), param.detach()[start:stop]), (name, start)


def test_a_model_built_on_meta_and_filled_from_the_files_computes_as_from_pretrained(demo_assets, reference):
    model = build_model(demo_assets / "model", torch.device("cpu"))
    fill_from_files(model, demo_assets / "model")
    model.eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after to_empty
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # the rotary buffers are recomputed, not stored
    ids = torch.randint(0, reference.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_an_export_written_by_two_writers_is_the_model_in_the_files_layout(demo_assets, reference, tmp_path):
    from transformers import AutoModelForCausalLM

    weights = {name: p.detach() for name, p in reference.named_parameters()}
    shapes = {name: t.shape for name, t in weights.items()}
    out = tmp_path / "export"
    read = lambda names: {name: weights[name].clone() for name in names}  # noqa: E731
    for part in (1, 0):  # either order: the plan is fixed before anything is written
        hf_weights.write_weight_files(out, shapes, torch.float32, read, part=part, parts=2, max_file_bytes=100_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / hf_weights.INDEX_FILE).read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(str(demo_assets / "model" / "model.safetensors"), framework="pt") as f:
        assert set(index) == set(f.keys())  # per-expert keys, as save_pretrained writes them
    assert set(index.values()) == set(files)
    shutil.copy(demo_assets / "model" / "config.json", out)
    exported, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, param in exported.named_parameters():
        assert torch.equal(param, weights[name]), name
    files = hf_weights.WeightFiles(out)  # a sharded folder with its index, as large models come
    for name, tensor in weights.items():
        assert torch.equal(files.rows(name, tensor.shape, 1, 3), tensor[1:3]), name


def test_files_without_a_weight_are_refused_naming_it(demo_assets, tmp_path):
    with pytest.raises(UserError, match="holds no model.safetensors"):
        hf_weights.WeightFiles(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(demo_assets / "model" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = hf_weights.WeightFiles(tmp_path)
    with pytest.raises(UserError, match="model.norm.weight has shape"):
        files.rows("model.norm.weight", torch.Size([64]), 0, 64)
    with pytest.raises(UserError, match="no weights for model.layers.1.mlp.experts.5.gate_proj.weight"):
        files.rows("model.layers.1.mlp.experts.gate_up_proj", torch.Size([8, 128, 64]), 0, 8)


def test_the_export_command_refuses_bad_folders_with_one_line(tmp_path):
    def export(*args):
        return subprocess.run([sys.executable, "ckpt.py", "export", *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    missing = export(tmp_path / "step_00000001", tmp_path / "out")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: checkpoint {tmp_path / 'step_00000001'} does not exist"]
    (tmp_path / "step_00000002").mkdir()
    incomplete = export(tmp_path / "step_00000002", tmp_path / "out")
    assert incomplete.returncode == 2 and "is incomplete" in incomplete.stderr
    assert not (tmp_path / "out").exists()
