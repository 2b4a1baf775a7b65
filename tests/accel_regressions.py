"""Mistakes a device would reject, made on purpose under the stand-in accelerator
(tests/accel_standin.py), through the project's own code where it has the path: one ``plant_*``
function per kind of finding the stand-in claims. Each must leave its finding in the report,
carrying the plant's name among its functions (or as its thread's name):
tests/test_accel_standin.py says which finding each plant must leave.

    AUDIT_OUT=DIR python tests/accel_standin.py tests/accel_regressions.py
"""
import sys
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckpt  # noqa: E402
import dapo_loss  # noqa: E402
import engine_builtin  # noqa: E402
from device import select_platform, step_generator  # noqa: E402
from ranks import all_reduce_tensor, broadcast_flag  # noqa: E402

plat = select_platform("auto", 0)
plat.bind()
device = plat.device
dist.init_process_group(plat.backend, store=dist.HashStore(), rank=0, world_size=1)
gloo_group = dist.new_group([0], backend="gloo")
nccl_group = dist.new_group([0], backend="nccl")


def draw_token(generator: torch.Generator) -> None:
    engine_builtin._choose_token(torch.randn(4, 16).to(device), greedy=False, top_p=1.0, generator=generator)


# ----- gen ---------------------------------------------------------------------------------------

def plant_host_generator_for_device_draws() -> None:
    draw_token(step_generator(0, 1))


def plant_host_generator_with_a_device_generators_seed() -> None:
    """Same seed, other device: the stand-in must tell generators apart by identity."""
    host = step_generator(0, 2)
    on_device = step_generator(0, 2, device=device)
    draw_token(host)
    del on_device


def plant_device_generator_for_host_draws() -> None:
    torch.rand(3, generator=step_generator(0, 3, device=device))


# ----- mix ---------------------------------------------------------------------------------------

def plant_host_advantages_in_the_loss() -> None:
    logp = torch.randn(4, 6).to(device)
    dapo_loss.policy_loss(logp, logp.detach(), torch.randn(4), torch.ones(4, 6, dtype=torch.bool).to(device))


def plant_tensors_on_two_device_indices() -> None:
    logp = torch.randn(4, 6).to(device)
    other_device = torch.device(device.type, device.index + 1)
    dapo_loss.policy_loss(logp, logp.detach().to(other_device), torch.randn(4).to(device),
                          torch.ones(4, 6, dtype=torch.bool).to(device))


def plant_param_data_from_the_host() -> None:
    param = torch.nn.Parameter(torch.zeros(2).to(device))
    param.data = torch.ones(2)


# ----- sync and dtype ----------------------------------------------------------------------------

def plant_host_read_of_a_device_value() -> None:
    broadcast_flag(1, 0, dist.group.WORLD, device)


def plant_fp32_matmul_in_a_bf16_region() -> None:
    """Autocast casts mm and bmm, not grouped expert matmuls: fp32 inputs stay fp32."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        torch._grouped_mm(torch.randn(4, 8).to(device), torch.randn(2, 8, 8).to(device),
                          offs=torch.tensor([2, 4], dtype=torch.int32).to(device))


def plant_fp32_bmm_beside_a_rotary_outer_product() -> None:
    """Outside autocast, as a bf16 model's own code: the rotary embedding's one-deep fp32 product
    of inv_freq and the positions (transformers 5.5.4's) is no finding; an fp32 bmm two deep is."""
    inv_freq, positions = torch.rand(1, 4, 1).to(device), torch.arange(6.0).view(1, 1, 6).to(device)
    torch.bmm(inv_freq, positions)
    torch.bmm(torch.randn(1, 4, 2).to(device), torch.randn(1, 2, 6).to(device))


# ----- thread ------------------------------------------------------------------------------------

def plant_writer_thread_left_unbound() -> None:
    writer = ckpt.BackgroundWriter(bind_device=lambda: None)
    writer.start("plant_writer_thread_left_unbound", lambda: plat.module.current_stream())
    writer.wait()


def plant_writer_thread_on_another_device() -> None:
    writer = ckpt.BackgroundWriter(bind_device=lambda: plat.module.set_device(device.index + 1))
    writer.start("plant_writer_thread_on_another_device", lambda: plat.module.current_stream())
    writer.wait()


# ----- coll --------------------------------------------------------------------------------------

def plant_host_tensor_into_hccl() -> None:
    all_reduce_tensor(torch.ones(3), dist.group.WORLD, torch.device("cpu"))


def plant_device_tensor_into_gloo() -> None:
    all_reduce_tensor(torch.ones(3), gloo_group, device)


def plant_float64_reduction_on_hccl() -> None:
    dist.all_reduce(torch.zeros(2, dtype=torch.float64).to(device))


def plant_float64_broadcast_on_hccl() -> None:
    """Moved, not reduced: HCCL takes float64 in no collective."""
    dist.broadcast(torch.zeros(2, dtype=torch.float64).to(device), src=0)


def plant_dtype_nccl_lacks() -> None:
    try:
        dist.broadcast(torch.zeros(2, dtype=torch.int16).to(device), src=0, group=nccl_group)
    except RuntimeError:  # gloo, which runs it here, lacks int16 too; the finding is made before
        pass


def plant_gather_into_hccl() -> None:
    values = torch.ones(2).to(device)
    dist.gather(values, [torch.empty_like(values)], dst=0)


def plant_gather_object_into_hccl() -> None:
    dist.gather_object({"step": 1}, [None], dst=0)


def _fsdp_collective(single: str, tensor: str) -> Any:
    """The collective FSDP2 calls in the installed torch: the *_single form where torch has it
    (2.13's _fsdp_collectives.py), else the *_tensor form (2.10's), with the same (output, input)."""
    return getattr(dist, single, None) or getattr(dist, tensor)


def plant_fsdp_all_gather_of_a_host_shard() -> None:
    """FSDP2 gathers parameters with all_gather_single and reduces gradients with
    reduce_scatter_single (all_gather_into_tensor and reduce_scatter_tensor before torch 2.13)."""
    _fsdp_collective("all_gather_single", "all_gather_into_tensor")(torch.empty(2), torch.ones(2))


def plant_fsdp_reduce_scatter_of_float64_gradients() -> None:
    _fsdp_collective("reduce_scatter_single", "reduce_scatter_tensor")(
        torch.empty(2, dtype=torch.float64).to(device), torch.ones(2, dtype=torch.float64).to(device))


def plant_functional_collective_of_a_host_tensor() -> None:
    """DTensor's redistribute and full_tensor run c10d's functional collectives."""
    funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD))


def plant_functional_collective_of_float64() -> None:
    funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(2, dtype=torch.float64).to(device), 0, dist.group.WORLD))


# ----- NPU kinds (a float8 operand under hccl, a non-bool attn_mask) ------------------------------
# Recorded when the stand-in follows the NPU's rules (ACCEL_KIND=npu); tests/test_npu_paths.py
# runs this file so and says which finding each plant must leave.

def plant_float8_weights_on_the_device() -> None:
    """FP8 values quantized on the device as a platform with float8 kernels stores them."""
    import fp8

    fp8.quantize(torch.randn(4, 8).to(device), stored_on="cpu")


def plant_additive_attention_mask() -> None:
    """The decode step's mask as the CPU keeps it (0 or -inf, added) into the NPU's attention."""
    query, keys = torch.randn(2, 1, 2, 8).to(device), torch.randn(2, 1, 4, 8).to(device)
    torch.nn.functional.scaled_dot_product_attention(query, keys, keys, attn_mask=torch.zeros(2, 1, 1, 4).to(device))



if __name__ == "__main__":
    for name, plant in list(globals().items()):
        if name.startswith("plant_"):
            plant()
    dist.destroy_process_group()
