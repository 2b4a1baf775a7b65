"""Device selection: CPU without torch_npu, the NPU branch with a fake torch_npu, and who names devices."""
import json
import os
import random
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import device
import moe_kernels
from config import UserError
from device import select_platform

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_and_gloo_without_accelerators(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plat = select_platform()
    assert (plat.kind, plat.backend, plat.device) == ("cpu", "gloo", torch.device("cpu"))
    with pytest.raises(UserError, match="torch_npu"):
        select_platform("npu")
    with pytest.raises(UserError, match="no CUDA device"):
        select_platform("cuda")


def test_fake_torch_npu_selects_npu_and_hccl(monkeypatch):
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.13.0.fake"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    plat = select_platform(local_rank=3)
    # torch.device("npu") itself needs the real torch_npu, so check the choice, not the device object.
    assert (plat.kind, plat.backend, plat.local_rank) == ("npu", "hccl", 3)


def test_npu_beats_cuda_and_cuda_beats_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_platform().backend == "nccl"
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert select_platform().backend == "hccl"
    assert select_platform("cuda").backend == "nccl"  # an explicit request wins


def test_offloading_learners_send_host_tensors_through_gloo():
    from torch.distributed import Backend

    for kind, backend in (("npu", "hccl"), ("cuda", "nccl")):
        plat = device.Platform(kind, backend)
        assert plat.learner_backend(offload=False) == backend
        mixed = plat.learner_backend(offload=True)
        assert mixed == f"{kind}:{backend},cpu:gloo"
        # The form torch.distributed parses into a backend per device type.
        assert Backend(mixed) == mixed.lower()
    assert device.Platform("cpu", "gloo").learner_backend(offload=True) == "gloo"


def test_rng_state_survives_json_and_restores_every_generator():
    plat = select_platform("cpu")
    device.seed_everything(5)
    state = json.loads(json.dumps(plat.rng_state()))  # what a checkpoint stores

    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), np.random.randn()

    first = draws()
    draws()
    plat.set_rng_state(state)
    assert draws() == first


def test_env_report_lists_what_article_5_1_asks_for(tmp_path):
    plat = select_platform("cpu")
    device.write_env_report(tmp_path / "env.json", plat, world_size=1)
    report = __import__("json").loads((tmp_path / "env.json").read_text())
    for key in ("python", "torch", "torch_npu", "cann", "collective_backend", "transformers", "device_count",
                "device_names", "hostname", "world_size"):
        assert key in report
    assert report["torch"] == torch.__version__ and report["collective_backend"] == "gloo"


# Besides device.py, the kernel modules split out of it: their code and comments name the
# torch_npu operators they call or were weighed against (its grouped matmul, its FP8 GEMMs). They
# import no accelerator module themselves; torch_npu reaches them through device.torch_npu_op.
NAMES_ACCELERATORS = {"device.py", "fp8_kernels.py", "moe_kernels.py"}


def test_only_the_device_module_names_accelerators():
    pattern = re.compile(r"torch\.cuda|torch\.npu|torch_npu")
    offenders = [p.name for p in ROOT.glob("*.py")
                 if p.name not in NAMES_ACCELERATORS and pattern.search(p.read_text())]
    assert offenders == []
    importing = re.compile(r"import torch_npu|import_module\(\"torch_npu\"\)")
    assert [name for name in sorted(NAMES_ACCELERATORS) if importing.search((ROOT / name).read_text())] == ["device.py"]


def test_importing_library_modules_writes_nothing_and_starts_no_group(tmp_path):
    modules = sorted(p.stem for p in ROOT.glob("*.py"))
    assert {"train_dapo", "rollout", "learner", "ckpt", "ranks"} <= set(modules)
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); before = set(os.listdir('.'));"
            f"import {', '.join(modules)};"
            "import torch.distributed as dist;"
            "assert not dist.is_initialized(); assert set(os.listdir('.')) == before, 'import wrote files'")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind, backend, kernel", [("npu", "hccl", moe_kernels.DENSE_EXPERTS),
                                                   ("cuda", "nccl", "grouped_mm"), ("cpu", "gloo", "grouped_mm")])
def test_moe_experts_run_the_kernel_their_platform_has(demo_assets, kind, backend, kernel):
    """torch_npu lists no _grouped_mm: a model built to compute on an NPU runs its experts on
    torch_npu's grouped matmul, or without it (here on the CPU) densely, never transformers'
    eager loop; elsewhere grouped_mm."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_weights import empty_model
    from learner import fill_from_files

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.add(func)
            return func(*args, **(kwargs or {}))

    plat = device.Platform(kind, backend)
    model = empty_model(demo_assets / "model", "cpu", torch.float32, computes_on=plat.kind)
    fill_from_files(model, demo_assets / "model")
    assert model.config._experts_implementation == kernel
    with Ops() as ops:
        logits = model(input_ids=torch.randint(3, 90, (2, 8))).logits
    assert torch.isfinite(logits).all()
    assert (torch.ops.aten._grouped_mm.default in ops.ran) == (kernel == "grouped_mm")


@pytest.mark.parametrize("driver,cann,problem", [
    ("25.3.RC1", "8.3.RC1", None), ("25.5.0", "8.5.0", None), ("25.3.rc1", "8.3.rc1", None),
    ("25.2.0", "8.5.0", "the Ascend driver is 25.2.0, below 25.3.RC1"),  # a release below the gate's candidate
    ("25.3.T5", "8.3.RC1", "the Ascend driver is 25.3.T5, below 25.3.RC1"),  # a test build before its candidate
    ("25.5.0", "8.2.RC2", "the Ascend cann is 8.2.RC2, below 8.3.RC1"),
    ("25.5.0", "8.3.alpha001", "the Ascend cann is 8.3.alpha001, below 8.3.RC1"),
    (None, "8.5.0", "the Ascend driver version was not found"), ("25.5.0", "", "the Ascend cann version was not found")])
def test_npu_ipc_needs_the_driver_and_cann_verl_gates_it_on(driver, cann, problem):
    assert device.ascend_versions_problem(driver, cann) == problem


def test_the_driver_version_is_read_from_npu_smis_board_info(monkeypatch):
    board = "NPU ID                         : 0\nProduct Name                   : IT21PDDA01\n" \
            "Software Version               : 25.3.rc1\nFirmware Version               : 7.7.0.6.236\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=board))
    assert device.npu_driver_version() == "25.3.rc1"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("npu-smi")))
    assert device.npu_driver_version() is None


def test_a_shareable_cpu_buffer_is_opened_in_place_by_another_process():
    """What an engine's worker does with a rollout rank's handle on a CPU: it maps the same memory
    (a write there is seen here), and a tensor outside a shareable buffer is refused rather than
    silently copied into a new one."""
    buffer = device.shareable_buffer(64, torch.device("cpu"))
    buffer.copy_(torch.arange(64, dtype=torch.uint8))
    handle = device.ipc_handle(buffer[8:16])  # the whole buffer, whatever view names it
    child = ("import sys, torch, device\n"
             f"opened = device.open_ipc_handle({handle!r}, torch.device('cpu'))\n"
             "assert opened.numel() == 64 and opened[:4].tolist() == [0, 1, 2, 3], opened[:4]\n"
             "opened[63] = 200\n")
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True, timeout=120)
    assert buffer[63].item() == 200
    with pytest.raises(ValueError, match="shareable_buffer"):
        device.ipc_handle(torch.zeros(8, dtype=torch.uint8))


def test_the_device_ipc_calls_this_cpu_cannot_make_exist_with_the_arguments_we_pass():
    """open_ipc_handle rebuilds a CUDA (or NPU) tensor from reduce_tensor's arguments with the
    receiver's own device index as argument 6: a torch that renamed or reordered them fails here,
    not in a user's first weight sync. (torch_npu's rebuild_npu_tensor takes the same 15, read in
    its source; docs/platform.md.)"""
    import inspect

    from torch.multiprocessing import reductions

    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert len(parameters) == 15 and parameters[6] == "storage_device"
    assert callable(reductions.reduce_tensor) and hasattr(torch.cuda, "get_device_properties")


def test_deterministic_algorithms_are_set_for_the_run_and_put_back(monkeypatch):
    """run.deterministic: torch's deterministic kernels, cuDNN without autotuning and the
    platform's variables (a variable the user set is kept); afterwards the process as it was.
    Off: nothing changes."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("HCCL_DETERMINISTIC", "false")  # the user's
    assert device.use_deterministic_algorithms("cuda", False)() is None
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    for kind, ours, theirs in (("cuda", "CUBLAS_WORKSPACE_CONFIG", None), ("npu", "CLOSE_MATMUL_K_SHIFT",
                                                                          "HCCL_DETERMINISTIC")):
        benchmark = torch.backends.cudnn.benchmark
        restore = device.use_deterministic_algorithms(kind, True)
        try:
            assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
            assert not torch.backends.cudnn.benchmark
            assert os.environ[ours] == device.DETERMINISM_VARIABLES[kind][ours]
            assert theirs is None or os.environ[theirs] == "false"
        finally:
            restore()
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
        assert torch.backends.cudnn.benchmark == benchmark and ours not in os.environ
        assert os.environ["HCCL_DETERMINISTIC"] == "false"
