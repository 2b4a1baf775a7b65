"""Routing replay (routing.py, ``routing_replay``): the built-in engine records the experts its
router chose, the ids travel and persist with the samples, and the learner's forwards route to
them with gate weights from its own router; vLLM's ``routed_experts`` in the same layout; the
``routing_mismatch`` metric. All in this process on tiny tensors and a random 2-layer Qwen3-MoE."""
import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

import ckpt
import engine_builtin
import engine_vllm
import routing
from config import Config
from engine import Sampling, Seeds
from engine_vllm import VllmEngine
from ranks import Layout, pack_routing, routing_of, unpack_routing
from samples import SampleBatch
from tests.host_reads import HostReads
from tests.test_decode import moe_model, prompts
from tests.test_engine_vllm_platform import recorder  # noqa: F401 (a fixture)
from tests.test_rollout import fake_batch

EXPERTS, TOP_K = 8, 2  # moe_model's


@pytest.fixture(scope="module")
def model():
    return moe_model()


def decode(model, ids, mask, *, record: bool, **kw):
    decoder = engine_builtin._Decoder(model, None, record_routing=record)
    return engine_builtin.generate(model, ids, mask, max_new_tokens=10, pad_id=0, sampling=Sampling(temperature=1.0),
                                   generator=torch.Generator().manual_seed(0), decoder=decoder, **kw)


def own_top_k(model, ids, mask):
    """Each MoE layer's top-k ids in one plain full forward, from the router logits transformers
    returns: [rows, sequence, layers, top_k]."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, output_router_logits=True)
    chosen = [logits.softmax(-1).topk(TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(chosen, dim=1).view(*ids.shape, len(chosen), TOP_K)


def test_the_engine_records_the_experts_its_router_chose_for_every_token_it_ran(model):
    """Rows stop at different steps (a quarter of the vocabulary stops) and compaction drops
    finished rows; the recorded ids of every prompt token and every response token the engine
    fed back are, as sets, the top-k of a plain forward over prompt + response."""
    ids, mask = prompts(6, 12, seed=1)
    gen = decode(model, ids, mask, record=True, stop_ids=list(range(64)), stop_check_every=2)
    assert gen.routed_experts.dtype == torch.uint8
    assert gen.routed_experts.shape == (6, 12 + gen.response_ids.shape[1], 2, TOP_K)
    lengths = gen.response_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows did stop at different steps
    full_ids, full_mask = torch.cat([ids, gen.response_ids], 1), torch.cat([mask, gen.response_mask], 1)
    expected = own_top_k(model, full_ids, full_mask)
    # the engine ran: the real prompt tokens and every response token but the last
    ran = full_mask.clone()
    ran[torch.arange(6), 11 + lengths] = False
    differs = routing.top_k_differs(expected, gen.routed_experts)[ran]
    assert differs.shape[0] == int(mask.sum() + lengths.sum() - 6) and not differs.any()


def test_recording_changes_no_token_and_adds_no_host_read(model):
    ids, mask = prompts(4, 8)
    reads = {}
    for record in (False, True):
        with HostReads() as host:
            gen = decode(model, ids, mask, record=record, stop_ids=[])
        reads[record] = [read for read in host.reads]
        if record:
            torch.testing.assert_close(gen.logp, plain.logp, rtol=0, atol=0)
            assert torch.equal(gen.response_ids, plain.response_ids)
        plain = gen
    assert plain.routed_experts is not None and len(reads[True]) == len(reads[False]) > 0


def learner_forward(model, ids, mask, replay_ids=None, measure=False):
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with routing.replaying(model, replay_ids, measure=measure) as replay:
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
    return logits, replay


def test_replaying_the_models_own_routing_changes_no_log_prob(model):
    ids, mask = prompts(3, 10)
    own = own_top_k(model, ids, mask).to(torch.uint8)
    plain, _ = learner_forward(model, ids, mask)
    replayed, replay = learner_forward(model, ids, mask, own, measure=True)
    assert torch.equal(plain, replayed)
    assert replay.differs.shape == (3, 10, 2) and not replay.differs.any()


def test_replaying_other_experts_changes_the_outputs_and_the_router_gets_its_gradient():
    net = moe_model()
    ids, mask = prompts(3, 10)
    own = own_top_k(net, ids, mask)
    other = (own + 3) % EXPERTS  # every token's experts replaced by others, the pair still distinct
    plain, _ = learner_forward(net, ids, mask)
    replayed, replay = learner_forward(net, ids, mask, other.to(torch.uint8), measure=True)
    assert (replayed - plain).abs().max() > 1e-3
    # the first layer sees the plain hidden states; later ones the replayed layers' outputs
    assert replay.differs[..., 0].all()
    replayed.logsumexp(-1).sum().backward()
    for router in routing.moe_routers(net):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replayed_gate_weights_are_the_routers_softmax_at_the_chosen_ids():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]], requires_grad=True)
    chosen = torch.tensor([[3, 1]])
    probs = torch.tensor([2.0, 0.0, 1.0, -1.0]).exp() / torch.tensor([2.0, 0.0, 1.0, -1.0]).exp().sum()
    unnormalised = routing.replayed_weights(logits, chosen, norm_topk_prob=False)
    torch.testing.assert_close(unnormalised, probs[[3, 1]][None])
    normalised = routing.replayed_weights(logits, chosen, norm_topk_prob=True)
    torch.testing.assert_close(normalised, (probs[[3, 1]] / probs[[3, 1]].sum())[None])
    normalised[0, 0].backward()
    assert logits.grad[0, [1, 3]].abs().min() > 0  # through the chosen experts' logits


def test_routing_mismatch_counts_the_decisions_that_predict_response_tokens():
    # top-k sets, order aside: [0, 1] vs [1, 0] agree; [0, 1] vs [0, 2] differ
    assert routing.top_k_differs(torch.tensor([[0, 1], [0, 1]]), torch.tensor([[1, 0], [0, 2]])).tolist() == \
        [False, True]
    # one row, prompt of 2 + response of 3 (the last padding), 2 layers: positions 1, 2, 3 predict
    # response tokens 0, 1, 2; token 2 is padding, so positions 1 and 2 count: 4 decisions
    differs = torch.tensor([[[True, True], [False, True], [True, True], [True, False], [True, True]]])
    response_mask = torch.tensor([[True, True, False]])
    assert routing.response_disagreement(differs, response_mask).tolist() == [3.0, 4.0]


def routed_batch(batch: SampleBatch, dtype=torch.uint8, seed=0) -> SampleBatch:
    rows, width = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    high = 256 if dtype == torch.uint8 else 1000
    ids = torch.randint(0, high, (rows, width, 3, TOP_K), generator=torch.Generator().manual_seed(seed))
    return SampleBatch(**batch.tensors(), group_size=batch.group_size, routed_experts=ids.to(dtype))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_routing_ids_stay_with_their_tokens_through_padding_trimming_and_transfer(dtype):
    batch = routed_batch(fake_batch([1, 0, 0, 1], group_size=2, prompt_width=3, response_width=2), dtype)
    wide = batch.widen(5, 4)
    assert torch.equal(wide.routed_experts[:, 2:5 + 2], batch.routed_experts)  # prompt left-, response right-padded
    assert torch.equal(wide.trimmed().routed_experts, batch.trimmed().routed_experts)
    layout = routing_of(batch)
    data = pack_routing(batch, 5, 4, 6, layout)
    assert data.dtype == torch.uint8 and data.shape == (6, 9 * 3 * TOP_K * batch.routed_experts.element_size())
    back = unpack_routing(data, 4, 5, 4, layout)
    assert back.dtype == dtype and torch.equal(back, wide.routed_experts)
    # a rank with no samples sends padding of the same shape
    assert torch.equal(pack_routing(SampleBatch.empty(2), 5, 4, 6, layout), torch.zeros_like(data))
    joined = SampleBatch.concat([batch.select_rows(torch.tensor([0, 1])), wide.select_rows(torch.tensor([2, 3]))])
    assert torch.equal(joined.routed_experts, wide.routed_experts)


def test_routing_ids_persist_bitwise_in_the_checkpoints_sample_buffer(tmp_path):
    batch = routed_batch(fake_batch([1, 0, 0, 1], group_size=2, prompt_width=3, response_width=2))
    ckpt.write_tensors(tmp_path / "sample_buffer.safetensors", batch.named_tensors("pool"))
    back = SampleBatch.from_named_tensors(ckpt.read_tensors(tmp_path / "sample_buffer.safetensors"), "pool", 2)
    assert back.routed_experts.dtype == torch.uint8 and torch.equal(back.routed_experts, batch.routed_experts)
    plain = fake_batch([1, 0], group_size=2, prompt_width=3, response_width=2)
    assert SampleBatch.from_named_tensors(plain.named_tensors("pool"), "pool", 2).routed_experts is None


def test_the_routing_shape_of_the_30b_config_is_384_bytes_a_token():
    from transformers import AutoConfig

    shape = routing.RoutingShape.of(AutoConfig.from_pretrained("configs/models/qwen3-30b-a3b"))
    assert (shape.layers, shape.top_k, shape.num_experts, shape.id_dtype) == (48, 8, 128, torch.uint8)
    assert shape.bytes_per_token == 384


class Completion:
    """A vllm CompletionOutput's fields the engine reads."""

    def __init__(self, tokens, routed, finish_reason="stop"):
        self.token_ids, self.routed_experts, self.finish_reason = tokens, routed, finish_reason
        self.logprobs = [{t: types.SimpleNamespace(logprob=-0.5)} for t in tokens]


def vllm_routing(prompt: int, outputs: int, decoder_layers: int = 3) -> np.ndarray:
    """What vLLM returns: a row per token it ran (prompt + output - 1), a slot per decoder layer;
    each id says its row and slot."""
    rows = np.arange(prompt + outputs - 1)[:, None, None] * 10 + np.arange(decoder_layers)[None, :, None]
    return np.broadcast_to(rows, (prompt + outputs - 1, decoder_layers, TOP_K)).astype(np.uint8)


def test_vllm_routed_experts_are_placed_after_the_prompts_padding_and_keep_the_moe_layers(recorder, monkeypatch):
    from tests.test_engine_vllm_platform import PretendDevice, PretendWeights, RecordingLLM

    class ReplyingLLM(RecordingLLM):
        def generate(self, prompts, params, use_tqdm):
            assert [len(p["prompt_token_ids"]) for p in prompts] == [3, 4]
            return [types.SimpleNamespace(outputs=[Completion([5, 6, 2], vllm_routing(3, 3))]),
                    types.SimpleNamespace(outputs=[Completion([7, 2], vllm_routing(4, 2))])]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=ReplyingLLM, SamplingParams=dict))
    shape = routing.RoutingShape(layer_indices=(0, 2), top_k=TOP_K, num_experts=EXPERTS)  # layer 1 dense
    cfg = replace(Config(), model=replace(Config().model, rollout_engine="vllm"))
    planned = {"weights": 2**30, "kv_cache": 2**30, "activations": 2**30, "total": 3 * 2**30}

    def engine(routing_shape):
        return VllmEngine(cfg, PretendDevice("cuda", "nccl", local_rank=0), Layout(world_size=2, rank=0, num_learners=1),
                          PretendWeights(), stop_ids=[2], pad_id=0, max_new_tokens=4, planned=planned, sequences=2,
                          device_memory=64 * 2**30, routing=routing_shape)

    plain = engine(None)
    assert "enable_return_routed_experts" not in recorder[-1]["settings"]
    replayed = engine(shape)
    assert recorder[-1]["settings"]["enable_return_routed_experts"] is True
    prompt_ids = torch.tensor([[0, 11, 12, 13], [21, 22, 23, 24]])
    seeds = Seeds(batch=0, per_sample=(1, 2))
    assert plain.generate(prompt_ids, prompt_ids > 0, sampling=Sampling(), seeds=seeds).routed_experts is None
    gen = replayed.generate(prompt_ids, prompt_ids > 0, sampling=Sampling(), seeds=seeds)
    assert gen.routed_experts.shape == (2, 4 + 3, 2, TOP_K) and gen.routed_experts.dtype == torch.uint8
    first = gen.routed_experts[0, :, :, 0]
    # row 0: one padding column, then 3 prompt + 2 output tokens ran; the stop token did not
    assert first[:, 0].tolist() == [0, 0, 10, 20, 30, 40, 0]
    assert first[:, 1].tolist() == [0, 2, 12, 22, 32, 42, 0]  # decoder layer 2's slot
    assert gen.routed_experts[1, :, 0, 0].tolist() == [0, 10, 20, 30, 40, 0, 0]
    # a completion whose routing does not match its tokens is vLLM's contract broken: one clear error
    with pytest.raises(RuntimeError, match="routed experts of shape"):
        engine_vllm.routed_experts_of([Completion([5, 2], vllm_routing(3, 3))], torch.ones(1, 3, dtype=torch.bool),
                                      2, shape)


def test_the_memory_plan_counts_the_30b_routing_ids_on_rollout_ranks_in_transit_and_in_the_buffer(tmp_path):
    """Qwen3-30B-A3B: 48 MoE layers x 8 experts x 1 byte = 384 B a token; a rollout rank's share of
    the shipped config (32 prompts x 8 over 6 ranks: 48 sequences of 2048 + 2048 tokens) is 75.5 MB;
    the gather puts 7 such shares (6 rollout ranks + the lead) on every member; the lead's buffer
    holds the step's 256 sequences and as many ahead (max_staleness 1). Nothing without replay."""
    from transformers import AutoConfig

    import memory_plan
    from config import Derived, load_config
    from tests.test_memory_plan import MODEL_30B, argv_30b

    arch = memory_plan.Architecture.of(AutoConfig.from_pretrained(MODEL_30B))
    assert arch.routing_bytes_per_token == 384

    def plan(replay: str):
        cfg = load_config(argv_30b(tmp_path, "--routing_replay", replay))
        derived = Derived.of(cfg, 8)
        return (memory_plan.routing_ids(cfg, derived, arch), memory_plan.rollout_rank(cfg, derived, arch),
                memory_plan.learner_rank(cfg, derived, arch, with_reference=True)["host"])

    (routed, rollout, host), (nothing, rollout_off, host_off) = plan("true"), plan("false")
    share = 48 * 4096 * 384
    assert share == 75_497_472
    assert routed == {"per_token": 384, "rollout_share": share, "in_transit": 7 * share,
                      "sample_buffer": 2 * 256 * 4096 * 384}
    assert rollout["routing_ids"] == 7 * share and rollout["total"] - rollout_off["total"] == 7 * share
    assert host["routing_ids"] == 2 * 256 * 4096 * 384 and host["total"] - host_off["total"] == host["routing_ids"]
    assert nothing is None and "routing_ids" not in rollout_off and "routing_ids" not in host_off


def test_replay_is_refused_in_one_line_where_it_cannot_run(tmp_path):
    """A model without MoE layers has no routing to replay; vLLM's CPU build cannot return it."""
    from transformers import Qwen3Config

    from config import UserError
    from rollout import check_rollout_inputs

    Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, model_path=str(tmp_path), reward_fn="demo_arithmetic"),
                  algo=replace(cfg.algo, routing_replay=True))
    with pytest.raises(UserError, match="has no mixture-of-experts layers"):
        check_rollout_inputs(cfg)
    check_rollout_inputs(replace(cfg, algo=replace(cfg.algo, routing_replay=False)))
    with pytest.raises(UserError, match="routing_replay with rollout_engine vllm: vLLM's CPU build"):
        engine_vllm.check_available(cfg, "cpu")


def test_checkpointed_layers_recompute_with_the_replayed_routing():
    """gradient_checkpointing: the backward recomputes each layer's forward, inside the replay
    block as the learner holds it, so the router's gradient is the one without checkpointing."""
    ids, mask = prompts(3, 10)
    grads = {}
    for checkpointing in (False, True):
        net = moe_model().train()
        if checkpointing:
            net.gradient_checkpointing_enable()
        other = (own_top_k(net, ids, mask) + 3) % EXPERTS
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with routing.replaying(net, other.to(torch.uint8)):
            net(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.logsumexp(-1).sum().backward()
        grads[checkpointing] = [router.weight.grad.clone() for router in routing.moe_routers(net)]
    for plain, recomputed in zip(grads[False], grads[True]):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-7)
