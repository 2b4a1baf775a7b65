"""The files a run writes are as readable as the umask says (0644 and 0755 under the usual 022):
metrics, checkpoints, the Hugging Face export, ``python ckpt.py export``. safetensors' own
save_file makes its files 0600, which kept a group's other users from the exported model."""
import os
import stat
from contextlib import contextmanager
from pathlib import Path

import torch

import ckpt
import hf_weights


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))}


def test_a_runs_files_and_its_export_follow_the_umask(demo_argv, tmp_path):
    import train_dapo

    out, exported = tmp_path / "run", tmp_path / "exported"
    with umask(0o022):
        assert train_dapo.main(demo_argv + ["--max_steps", "1", "--save_every", "1", "--val_every", "0"]) == 0
        assert ckpt.export_command(["export", str(out / "checkpoints" / "step_00000001"), str(exported)]) == 0
    model = out / "checkpoints" / "step_00000001" / "model" / "model.safetensors"
    assert stat.S_IMODE(model.stat().st_mode) == 0o644
    assert stat.S_IMODE((exported / "model.safetensors").stat().st_mode) == 0o644
    written = modes(tmp_path)
    assert "run/metrics.csv" in written and "run/checkpoints/step_00000001/sample_buffer.safetensors" in written
    odd = {name: oct(mode) for name, mode in written.items()
           if mode != (0o755 if (tmp_path / name).is_dir() else 0o644)}
    assert odd == {}


def test_weight_files_take_the_umask_in_force(tmp_path):
    shapes = {"a.weight": torch.Size([4, 3]), "b.weight": torch.Size([2])}
    full = {name: torch.ones(shape) for name, shape in shapes.items()}
    with umask(0o027):
        assert hf_weights.process_umask() == 0o027
        assert os.umask(0o027) == 0o027  # read, not changed
        hf_weights.write_weight_files(tmp_path / "model", shapes, torch.float32,
                                      lambda names: {n: full[n] for n in names}, max_file_bytes=48)
        ckpt.write_tensors(tmp_path / "buffer.safetensors", {"x": torch.zeros(3)})
    assert modes(tmp_path) == {"buffer.safetensors": 0o640, "model": 0o750,
                               "model/model-00001-of-00002.safetensors": 0o640,
                               "model/model-00002-of-00002.safetensors": 0o640,
                               "model/model.safetensors.index.json": 0o640}
