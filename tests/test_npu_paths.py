"""What the project runs on an NPU (Atlas A2/A3), on the CPU: FP8 weights as uint8 e4m3 codes (no
float8 tensor: torch_npu's cast and copy kernels take none there), bool attention masks (all
torch_npu's attention takes), and MoE experts that never wait for the device (torch_npu's
grouped matmul, else a dense batched path; transformers' eager loop waits twice per expert).

The CPU follows the NPU's rules where device.IMITATED_PLATFORM says so; the stand-in accelerator
(tests/accel_standin.py) does with ACCEL_KIND=npu, and then records what an NPU rejects.
"""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from transformers import Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import device
import fp8_kernels
import moe_kernels
from engine_builtin import generate
from fp8 import FP8, quantize
from tests.test_accel_standin import STANDIN, describe
from tests.test_decode import moe_model, prompts

ROOT = Path(__file__).resolve().parents[1]
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ATTENTION = F.scaled_dot_product_attention


@pytest.fixture
def npu_rules(monkeypatch):
    """The CPU follows the NPU's rules (FP8 codes, bool masks, the NPU's expert kernels)."""
    monkeypatch.setitem(device.IMITATED_PLATFORM, "cpu", "npu")
    fp8_kernels.free_fp8_workspace()
    yield
    fp8_kernels.free_fp8_workspace()


class Float8AndMasks(TorchDispatchMode):
    """Ops with a float8 operand or result, and the dtypes of attention masks."""

    def __init__(self):
        super().__init__()
        self.float8_ops: list[str] = []
        self.mask_dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype in FLOAT8 for t in tree_leaves((args, kwargs, out))):
            self.float8_ops.append(str(func))
        return out

    def attention(self, *args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            self.mask_dtypes.add(kwargs["attn_mask"].dtype)
        return ATTENTION(*args, **kwargs)


# ----- FP8 as codes ------------------------------------------------------------------------------

def test_fp8_codes_are_torchs_float8_bit_for_bit():
    """Every e4m3 value, every midpoint between neighbours (ties go to even) and its float32
    neighbours, zeros, and 1M random values over 30 binades: the integer encoding gives torch's
    float8_e4m3fn bits, and the table decodes them to torch's values."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    values = values[values.isfinite()].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    edges = torch.cat([values, midpoints, torch.nextafter(midpoints, torch.tensor(1e9)),
                       torch.nextafter(midpoints, torch.tensor(-1e9)), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    g = torch.Generator().manual_seed(0)
    binades = torch.exp2(-torch.randint(0, 30, (1 << 20,), generator=g))
    random = (torch.rand(1 << 20, generator=g) * 2 - 1) * 448 * binades
    scaled = torch.cat([edges, -edges, random]).clamp(-448, 448)
    codes = fp8_kernels.fp8_values(scaled, "npu")
    assert codes.dtype == torch.uint8
    assert torch.equal(codes, scaled.to(FP8).view(torch.uint8))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(fp8_kernels.fp8_values_as(codes, dtype), scaled.to(FP8).to(dtype))


def test_fp8_rollout_under_the_npus_rules_makes_no_float8_tensor_and_the_cpus_tokens(demo_assets, npu_rules,
                                                                                     monkeypatch):
    """The rollout copy read from the files as a rollout rank reads it (through weight sync's
    encode and decode), then a sampled generation: under the NPU's rules no op sees a float8 tensor and every decode mask is bool;
    the bytes stored and the tokens and log-probs are the CPU's with exact decoding (table decode: exact values)."""
    from fp8 import fp8_slot
    from rollout import load_rollout_model
    from weight_sync import RolloutWeights

    def rollout(rules_of_the_npu: bool):
        if not rules_of_the_npu:
            monkeypatch.delitem(device.IMITATED_PLATFORM, "cpu")
            # torch's exact float8 cast, not the CPU's faster bit decode (V * 2^-120), which loses
            # digits where a matmul's float32 output falls below the normal range (the demo
            # model's k_proj: 2e-6 apart, one sampled token in 60 flipped)
            monkeypatch.setitem(fp8_kernels.FP8_TO_COMPUTE, "cpu", "cast")
        fp8_kernels._e4m3_table(torch.device("cpu"), torch.bfloat16)  # the table is made on the host, once
        ops = Float8AndMasks()
        monkeypatch.setattr(F, "scaled_dot_product_attention", ops.attention)
        with ops:
            model = load_rollout_model(demo_assets / "model", "fp8", torch.device("cpu"))
            names = RolloutWeights(model.config, "fp8").fp8
            stored = [fp8_slot(model, name).values.clone() for name in sorted(names)]
            ids, mask = prompts(6, 12)
            out = generate(model, ids % (model.config.vocab_size - 3) + 3, mask, max_new_tokens=10, stop_ids=[],
                           pad_id=0, generator=torch.Generator().manual_seed(5))
        return ops, stored, out

    npu_ops, npu_values, npu_out = rollout(True)
    assert not npu_ops.float8_ops, npu_ops.float8_ops[:5]
    assert npu_ops.mask_dtypes == {torch.bool}
    assert {values.dtype for values in npu_values} == {torch.uint8}
    cpu_ops, cpu_values, cpu_out = rollout(False)
    assert cpu_ops.float8_ops  # the CPU keeps float8 values: what the check looks for is there
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(npu_values, cpu_values, strict=True))
    assert torch.equal(npu_out.response_ids, cpu_out.response_ids)
    torch.testing.assert_close(npu_out.logp, cpu_out.logp, atol=1e-5, rtol=0)


def test_weight_sync_under_the_npus_rules_sends_the_cpus_bytes(demo_assets, npu_rules, monkeypatch):
    """RolloutWeights.encode, on the lead's device, quantizes into uint8 codes by integer ops: the
    wire carries the bytes float8 values have elsewhere (the rollout side's decode into uint8
    buffers: the test above, whose loading goes through encode and decode)."""
    from transformers import AutoModelForCausalLM

    from weight_sync import RolloutWeights

    policy = AutoModelForCausalLM.from_pretrained(demo_assets / "model", dtype=torch.float32)
    moved = [p.detach() * 1.5 for p in policy.parameters()]

    def wire() -> list[torch.Tensor]:
        weights = RolloutWeights(policy.config, "fp8")
        return [weights.encode(index, tensor) for index, tensor in enumerate(moved)]

    ops = Float8AndMasks()
    with ops:
        npu_wire = wire()
    assert not ops.float8_ops
    monkeypatch.delitem(device.IMITATED_PLATFORM, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(npu_wire, wire()))
    values, _ = quantize(moved[1])
    assert values.dtype == FP8  # the CPU's own rules: float8 values, as before


# ----- bool masks --------------------------------------------------------------------------------

def test_decode_masks_are_bool_under_the_npus_rules_with_the_same_tokens(monkeypatch):
    """The KV cache's decode mask: bool where the platform takes no other (NPU), additive on the
    CPU (measured faster there, device.BOOL_ATTENTION_MASKS); the same tokens and log-probs."""
    model = moe_model(torch.float32)
    ids, mask = prompts(5, 10)

    def run():
        ops = Float8AndMasks()
        monkeypatch.setattr(F, "scaled_dot_product_attention", ops.attention)
        out = generate(model, ids, mask, max_new_tokens=12, stop_ids=[7], pad_id=0, stop_check_every=2,
                       generator=torch.Generator().manual_seed(3))
        return ops.mask_dtypes, out

    cpu_masks, cpu_out = run()
    monkeypatch.setitem(device.IMITATED_PLATFORM, "cpu", "npu")
    npu_masks, npu_out = run()
    assert cpu_masks == {torch.bool, torch.float32}  # the prompt's mask is bool everywhere
    assert npu_masks == {torch.bool}
    assert torch.equal(npu_out.response_ids, cpu_out.response_ids)
    assert torch.equal(npu_out.logp, cpu_out.logp)


# ----- experts that never wait for the device ------------------------------------------------------

def emulated_npu_grouped_matmul(x, weight, *, group_list, group_type, split_item, group_list_type, bias=None):
    """torch_npu.npu_grouped_matmul as its documentation gives it, for the forms the experts call:
    one x and one [E, K, N] weight, group_list the rows (m-grouped, group_type 0, one output) or
    the columns of x (k-grouped, group_type 2: x [K, M], weight [M, N], packed [E, K, N] out)."""
    (x,), (weight,) = x, weight
    assert bias is None and group_list_type == 1 and group_list.dtype == torch.int64
    starts = torch.cumsum(group_list, 0) - group_list
    spans = [slice(int(s), int(s + c)) for s, c in zip(starts, group_list)]
    if group_type == 0:
        assert split_item == 2 and weight.dim() == 3 and len(spans) == weight.shape[0]
        return [torch.cat([x[rows] @ weight[e] for e, rows in enumerate(spans)])]
    assert group_type == 2 and split_item == 3
    return [torch.stack([x[:, rows] @ weight[rows] for rows in spans])]


def experts_and_inputs(dtype):
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(dtype)
    for weight in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(weight, std=0.1)
    hidden = torch.randn(20, 32, dtype=dtype, requires_grad=True)
    logits = torch.randn(20, 6)
    logits[:, 5] = -1e9  # an expert that no token chooses
    top_weights, top_index = torch.topk(logits.softmax(-1), 2, dim=-1)
    return experts, hidden, top_index, top_weights.to(dtype).requires_grad_()


def outputs_and_gradients(forward, dtype):
    experts, hidden, top_index, top_weights = experts_and_inputs(dtype)
    out = forward(experts, hidden, top_index, top_weights)
    out.float().pow(2).sum().backward()
    return [out.detach(), hidden.grad, top_weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


# Of each tensor's largest magnitude. Measured: <= 1e-7 in fp32; <= 6.8e-3 in bf16, where
# transformers' grouped_mm experts are themselves up to 7.7e-3 from their fp32 results.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("torch_npu_has_it", [True, False])
def test_npu_experts_give_transformers_grouped_outputs_and_gradients(monkeypatch, dtype, tolerance,
                                                                     torch_npu_has_it):
    """The kernel experts_implementation gives an NPU (torch_npu's grouped matmul, here as its
    documentation says it computes; without it the dense path) against transformers' grouped_mm
    experts on the CPU: outputs and the gradients of the tokens, routing weights and both
    projections, within float noise (fp32) or bf16's rounding (the order of the sums differs)."""
    torch_npu = types.SimpleNamespace(npu_grouped_matmul=emulated_npu_grouped_matmul) if torch_npu_has_it else None
    monkeypatch.setattr(device, "_import_torch_npu", lambda: torch_npu)
    kernel = moe_kernels.experts_implementation("npu")
    assert kernel == (moe_kernels.NPU_GROUPED_EXPERTS if torch_npu_has_it else moe_kernels.DENSE_EXPERTS)
    ours = outputs_and_gradients(ALL_EXPERTS_FUNCTIONS[kernel], dtype)
    reference = outputs_and_gradients(grouped_mm_experts_forward, dtype)
    assert ours[3][5].abs().max() == 0 and reference[3][5].abs().max() == 0  # the unchosen expert
    for got, expected in zip(ours, reference):
        scale = expected.float().abs().max()
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * scale, rtol=0)


def test_npu_experts_never_read_the_device(monkeypatch):
    """Forward and backward of both NPU kernels: no op whose result the host must read (the eager
    loop's nonzero and item per expert), counted by op on the CPU."""
    reads = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default}

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in reads:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    def uncounted_kernel(*args, **kwargs):
        with _disable_current_modes():  # the emulation reads its group list; torch_npu's kernel takes it on the device
            return emulated_npu_grouped_matmul(*args, **kwargs)

    for torch_npu in (types.SimpleNamespace(npu_grouped_matmul=uncounted_kernel), None):
        monkeypatch.setattr(device, "_import_torch_npu", lambda: torch_npu)
        forward = ALL_EXPERTS_FUNCTIONS[moe_kernels.experts_implementation("npu")]
        experts, hidden, top_index, top_weights = experts_and_inputs(torch.float32)
        with Reads() as counted:
            forward(experts, hidden, top_index, top_weights).sum().backward()
        assert not counted.seen, counted.seen
    experts, hidden, top_index, top_weights = experts_and_inputs(torch.float32)
    with Reads() as counted:
        Qwen3MoeExperts.forward.__wrapped__(experts, hidden, top_index, top_weights)  # transformers' eager loop
    assert counted.seen  # what the check looks for is there


@pytest.mark.parametrize("torch_npu_has_it", [True, False])
def test_a_model_built_for_an_npu_runs_its_experts_on_our_kernel(tmp_path, monkeypatch, torch_npu_has_it):
    """hf_weights.empty_model for a model that computes on an NPU, on every transformers the
    project takes (before 5.7 transformers builds a model with none but its own experts kernels):
    each experts layer's forward goes through ours (torch_npu's grouped matmul, here as its
    documentation says it computes; without it the dense path), the logits and every parameter's
    gradient are those of transformers' grouped_mm experts, and a rollout's weight form builds
    from the model's config without taking its kernel away."""
    from transformers.integrations.moe import ExpertsInterface

    from hf_weights import empty_model
    from weight_sync import RolloutWeights

    torch_npu = types.SimpleNamespace(npu_grouped_matmul=emulated_npu_grouped_matmul) if torch_npu_has_it else None
    monkeypatch.setattr(device, "_import_torch_npu", lambda: torch_npu)
    kernel = moe_kernels.experts_implementation("npu")
    ran = []

    def through_ours(experts, *args, **kwargs):
        ran.append(experts)
        return ours(experts, *args, **kwargs)

    ours = ALL_EXPERTS_FUNCTIONS[kernel]
    monkeypatch.setitem(ExpertsInterface._global_mapping, kernel, through_ours)
    reference = moe_model(torch.float32)
    reference.config.save_pretrained(tmp_path)
    model = empty_model(tmp_path, "cpu", torch.float32, computes_on="npu")
    model.load_state_dict(reference.state_dict())
    assert model.config._experts_implementation == kernel
    ids = torch.randint(1, reference.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for built in (model, reference):
        built.train()
        logits = built(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        results.append([logits.detach()] + [p.grad for _, p in sorted(built.named_parameters())])
    assert ran == [layer.mlp.experts for layer in model.model.layers]  # the reference's are transformers'
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max(), rtol=0)
    assert RolloutWeights(model.config, "bf16").names == [name for name, _ in model.named_parameters()]
    assert model.config._experts_implementation == kernel


# ----- the stand-in, following the NPU's rules ---------------------------------------------------

def test_each_planted_npu_mistake_is_caught(tmp_path):
    """tests/accel_regressions.py's NPU plants, under the stand-in with ACCEL_KIND=npu."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUDIT_OUT": str(tmp_path), "ACCEL_KIND": "npu"}
    done = subprocess.run([sys.executable, str(STANDIN), str(ROOT / "tests" / "accel_regressions.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    findings = [f for f in json.loads((tmp_path / "audit_rank0.json").read_text())["findings"] if f["kind"] == "npu"]
    caught = {plant for f in findings for plant in f["functions"] if plant.startswith("plant_")}
    assert caught == {"plant_float8_weights_on_the_device", "plant_additive_attention_mask"}, describe(findings)
    assert any("float8" in f["what"] for f in findings) and any("attn_mask" in f["what"] for f in findings)
