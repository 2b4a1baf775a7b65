"""Padding-free forwards (packing.py, use_remove_padding): the same numbers as padded rows.

The padded path is the reference: every test computes both and compares them, log-probs,
entropies and gradients within float32 rounding, on one learner and on two FSDP2 learners."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import packing
from metrics import LEARNER_THROUGHPUT
from samples import SampleBatch
from tests.test_rollout import fake_batch

ROOT = Path(__file__).resolve().parents[1]

# (left padding of the prompt, real response tokens) of each row: every mix of short and long.
RAGGED = [(0, 9), (3, 2), (5, 9), (1, 4), (6, 1), (2, 7), (0, 3), (4, 5)]


def ragged_batch(layers: int = 0, top_k: int = 2, experts: int = 8, seed: int = 0) -> SampleBatch:
    """Eight rows of prompts (width 7) and responses (width 9) of RAGGED lengths, random tokens and,
    with ``layers``, random recorded experts (routing replay)."""
    batch = fake_batch([1.0, 0.0] * 4, group_size=2, prompt_width=7, response_width=9)
    generator = torch.Generator().manual_seed(seed)
    batch.prompt_ids.random_(3, 100, generator=generator)
    batch.response_ids.random_(3, 100, generator=generator)
    batch.rollout_logp.uniform_(-3, 0, generator=generator)
    for row, (padding, length) in enumerate(RAGGED):
        batch.prompt_mask[row, :padding] = False
        batch.prompt_ids[row, :padding] = 0
        batch.response_mask[row, length:] = False
        batch.response_ids[row, length:] = 0
    if layers:
        scores = torch.rand(8, 16, layers, experts, generator=generator)
        batch.routed_experts = scores.topk(top_k, dim=-1).indices.to(torch.uint8)
    return batch


def test_a_packed_row_holds_each_sequences_real_tokens_with_positions_from_zero():
    batch = ragged_batch()
    packed = packing.pack(batch, torch.device("cpu"))
    lengths = [7 - padding + length for padding, length in RAGGED]
    assert packed.lengths == lengths and packed.ids.shape == (1, sum(lengths))
    first = packed.ids[0, :lengths[0]]
    assert torch.equal(first, torch.cat([batch.prompt_ids[0], batch.response_ids[0]]))
    assert packed.positions[0, lengths[0]:lengths[0] + lengths[1]].tolist() == list(range(lengths[1]))
    # Row 1: prompt tokens at 3..6, two response tokens; the first is predicted by the prompt's last token.
    start = lengths[0]
    row_1 = packed.targets[0, 9:11]
    assert torch.equal(row_1, batch.response_ids[1, :2])
    assert packed.predicting[9:11].tolist() == [start + 3, start + 4]
    assert packed.real_tokens == int(batch.prompt_mask.sum() + batch.response_mask.sum())


def test_unpacked_values_land_on_the_response_tokens_and_zero_elsewhere():
    batch = ragged_batch()
    packed = packing.pack(batch, torch.device("cpu"))
    values = torch.arange(1, packed.targets.shape[1] + 1, dtype=torch.float32)[None]
    unpacked = packed.unpack_responses(values)
    assert torch.equal(unpacked[batch.response_mask], values[0]) and not unpacked[~batch.response_mask].any()
    ids = torch.arange(8 * 16).view(8, 16, 1)
    assert torch.equal(packed.unpack_tokens(packed.pack_tokens(ids)),
                       torch.where(torch.cat([batch.prompt_mask, batch.response_mask], 1)[..., None], ids, 0))


def test_a_response_after_padding_is_refused():
    batch = ragged_batch()
    batch.response_mask[0, 0] = False  # a hole before a real response token
    with pytest.raises(AssertionError, match="follows padding"):
        packing.pack(batch, torch.device("cpu"))


def npu_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """A stand-in for transformers' NPU varlen wrapper (torch_npu's fused attention, TND layout):
    [T, heads, head_dim] in and out, the bounds in host memory, each span causal on its own."""
    assert cu_seqlens_q.device.type == "cpu" and causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
    spans = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=softmax_scale,
        enable_gqa=True).transpose(0, 1) for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())]
    return torch.cat(spans)


@pytest.fixture
def demo_model(demo_assets):
    from hf_weights import empty_model
    from learner import fill_from_files

    model = empty_model(demo_assets / "model", "cpu", torch.float32, None)
    fill_from_files(model, demo_assets / "model")
    return model


def logprobs_and_gradient(model, batch, packed):
    """(log-probs, entropies, gradient) of the response tokens, from one forward of the padded
    rows (``packed`` None) or of ``packed``."""
    from types import SimpleNamespace

    from learner import Learner

    model.zero_grad()
    learner = SimpleNamespace(plat=SimpleNamespace(device=torch.device("cpu")),
                              cfg=SimpleNamespace(rollout=SimpleNamespace(temperature=0.7)))
    logp, entropy = Learner.sequence_logprobs(learner, model, batch, with_entropy=True, packed=packed)
    (logp[batch.response_mask].sum() + entropy[batch.response_mask].sum()).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach()[batch.response_mask], entropy.detach()[batch.response_mask], grad


@pytest.mark.parametrize("attention", ["ours", "ours on NPU", "sdpa", "eager"])
def test_packed_forwards_give_the_padded_numbers_in_every_attention_kernel(demo_model, attention, monkeypatch):
    """Ours (sdpa a sequence at a time; on NPU the varlen fused attention, here a reference of its
    TND interface), sdpa and eager with positions alone (transformers finds the sequences):
    log-probs, entropies and the gradient equal the padded forward's within float32 rounding
    (measured: 1e-6, 1.5e-6 and 2e-5 of a gradient whose largest entry is ~40)."""
    import device

    if attention == "ours on NPU":
        monkeypatch.setattr(device, "npu_varlen_attention", lambda device_type: npu_reference)
    packing.register_varlen_attention()
    batch = ragged_batch()
    demo_model.set_attn_implementation("sdpa")  # the padded reference: the learner's kernel
    padded = logprobs_and_gradient(demo_model, batch, None)
    demo_model.set_attn_implementation(packing.VARLEN_ATTENTION if attention.startswith("ours") else attention)
    packed = logprobs_and_gradient(demo_model, batch, packing.pack(batch, torch.device("cpu")))
    for ours, reference, tolerance in zip(packed, padded, (2e-5, 2e-5, 2e-4)):
        assert (ours - reference).abs().max() < tolerance, (attention, (ours - reference).abs().max())
    assert padded[2].abs().max() > 1  # a gradient worth comparing


def test_ours_computes_padded_rows_as_sdpa_does(demo_model):
    """A padded forward (the learner's attention_mask_for) through ours is transformers' sdpa, bit for bit."""
    from learner import attention_mask_for

    packing.register_varlen_attention()
    batch = ragged_batch()
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    valid = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    logits = {}
    for attention in ("sdpa", packing.VARLEN_ATTENTION):
        demo_model.set_attn_implementation(attention)
        with torch.no_grad():
            logits[attention] = demo_model(input_ids=ids, attention_mask=attention_mask_for(demo_model, valid),
                                           position_ids=(valid.long().cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.equal(logits["sdpa"][valid], logits[packing.VARLEN_ATTENTION][valid])


def test_our_kernel_gets_each_sequences_bounds_as_host_numbers():
    """Python ints: FSDP2's root moves every input tensor to the device, where reading them back
    would wait for it in every layer."""
    packed = packing.pack(ragged_batch(), torch.device("cpu"))
    config = type("Config", (), {"_attn_implementation": packing.VARLEN_ATTENTION})()
    bounds = packing.attention_inputs(config, packed)["packed_bounds"]
    assert bounds == (0, *torch.tensor(packed.lengths).cumsum(0).tolist()) and isinstance(bounds[1], int)
    config._attn_implementation = "eager"
    assert packing.attention_inputs(config, packed) == {}  # transformers finds them from the positions


LEARNERS = r'''
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[1])
import dapo_loss
from config import Derived, load_config
from device import select_platform
from learner import Learner
from ranks import Groups, Layout
from samples import SampleBatch
from tests.test_packing import ragged_batch

argv, out = json.loads(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo")
rank, learners = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(learners)))
results = {}
SETTINGS = {"padded": ["--use_remove_padding", "false"], "packed": ["--use_remove_padding", "true"],
            "budget": ["--use_dynamic_bsz", "true", "--ppo_max_token_len_per_gpu", "40",
                       "--log_prob_max_token_len_per_gpu", "70"]}
for name, settings in SETTINGS.items():
    cfg = load_config(argv + settings + ["--learner_ranks", str(learners)])
    learner = Learner(cfg, select_platform("cpu"), Derived.of(cfg, learners + 1),
                      Layout(world_size=learners + 1, rank=rank + 1, num_learners=learners),
                      Groups(learners=group, sync=None, checkpoint=group), resume=None)
    batch = SampleBatch.concat([ragged_batch(layers=2), ragged_batch(layers=2, seed=1)])
    advantages = dapo_loss.group_advantages(torch.randn(16, generator=torch.Generator().manual_seed(0)), 2)
    grads, step = [], learner.optimizer_step
    def keep_gradient(step_number):
        whole = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in learner.policy.parameters()]
        grads.append(torch.cat([g.flatten() for g in whole]))
        return step(step_number)
    learner.optimizer_step = keep_gradient
    forwards = []
    learner.policy.register_forward_pre_hook(lambda _, args, kwargs: forwards.append(
        (torch.is_grad_enabled(), kwargs["input_ids"].numel())), with_kwargs=True)
    old_logp = learner.shared_logprobs(learner.policy, batch, learner.shares(torch.arange(16)))
    metrics = learner.update(batch, advantages, step=1)
    results[name] = {"forwards": forwards, "old_logp": old_logp[batch.response_mask].tolist(), "grads": [g.tolist() for g in grads],
                       "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)}}
if rank == 0:
    out.write_text(json.dumps(results))
dist.destroy_process_group()
'''


@pytest.mark.parametrize("learners", [1, 2])
def test_learners_train_the_same_packed_and_by_token_budget_as_padded(demo_argv, tmp_path, learners):
    """Real torchrun learners (FSDP2 over two), every loss term and routing replay on: the old
    log-probs, each optimizer step's gradient and the step's metrics of a packed run, and of one
    in micro-batches of at most 40 real tokens (forwards of 70), equal the padded run's within
    float32 rounding; the token budget changes the number of forwards, not of optimizer steps."""
    script, out = tmp_path / "learners.py", tmp_path / "result.json"
    script.write_text(LEARNERS)
    argv = demo_argv + ["--max_steps", "1", "--kl_coef", "0.1", "--length_penalty_coef", "0.1",
                        "--entropy_coeff", "0.01", "--routing_replay", "true", "--learner_dtype", "fp32",
                        "--per_device_batch_size", "2", "--gradient_accumulation_steps", "4" if learners == 1 else "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={learners}", str(script),
           str(ROOT), json.dumps(argv), str(out)]
    job = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    result = json.loads(out.read_text())
    padded = result["padded"]
    for name in ("packed", "budget"):
        ours = result[name]
        assert (torch.tensor(ours["old_logp"]) - torch.tensor(padded["old_logp"])).abs().max() < 2e-5, name
        assert len(ours["grads"]) == len(padded["grads"]) == 2  # the second after an update: KL and clip act
        for gradient, reference in zip(ours["grads"], padded["grads"]):
            gradient, reference = torch.tensor(gradient), torch.tensor(reference)
            assert (gradient - reference).abs().max() < 1e-5 * max(reference.abs().max(), 1.0), name
        for key, value in padded["metrics"].items():
            if key not in LEARNER_THROUGHPUT:
                assert ours["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
        assert ours["metrics"]["update_padding_frac"] == ours["metrics"]["old_logp_padding_frac"] == 0.0
    assert padded["metrics"]["kl"] > 0 and padded["metrics"]["length_penalty"] != 0
    assert padded["metrics"]["update_padding_frac"] > 0.1 and padded["metrics"]["old_logp_padding_frac"] > 0.1
    # Per learner and step 16 / learners rows (150 real tokens in all). Padded: micro-batches of 2
    # rows, one no-grad forward of the demo's log_prob_batch_size 48 rows (twice: here and in the
    # update); by budget: micro-batches of at most 40 real tokens, forwards of at most 70.
    rows = 16 // learners
    padded_training = [n for grad, n in padded["forwards"] if grad]
    assert len(padded_training) == rows // 2 and len(padded["forwards"]) - len(padded_training) == 2
    training, no_grad = ([n for grad, n in result["budget"]["forwards"] if grad is want] for want in (True, False))
    assert max(training) <= 40 and len(training) < rows // 2 and max(no_grad) <= 70 and len(no_grad) > 2
    if learners == 1:
        assert sum(training) == 150 and sum(no_grad) == 2 * 150


def test_micro_batches_fill_the_budget_and_every_learner_runs_as_many():
    tokens = torch.tensor([30, 35, 12, 90, 7, 7, 20, 3, 15, 15, 1, 40])
    shares = [torch.arange(0, 12, 2), torch.arange(1, 12, 2)]  # [30, 12, 7, 20, 15, 1] and [35, 90, 7, 3, 15, 40]
    chunks = [packing.fill_by_tokens(tokens, share, shares, budget=40) for share in shares]
    assert len(chunks[0]) == len(chunks[1])  # FSDP2: the same number of forwards on every learner
    for share, own in zip(shares, chunks):
        assert sorted(torch.cat(own).tolist()) == share.tolist()  # every row once
        assert all(int(tokens[chunk].sum()) <= 40 or len(chunk) == 1 for chunk in own)
    assert [3] in [chunk.tolist() for chunk in chunks[1]]  # the 90-token row alone, not an error
    # Alone, the first learner's rows fit in 3; beside the second's (4) it splits one in two.
    assert len(packing.fill_by_tokens(tokens, shares[0], [shares[0]], budget=40)) == 3 and len(chunks[0]) == 4
