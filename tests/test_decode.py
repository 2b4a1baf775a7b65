"""The built-in engine's decode loop (engine_builtin.generate over kv_cache.KVCache), counted with
a dispatch mode on the CPU, where the counts do not depend on the machine: host reads per decode
step, bytes allocated per step as the context grows, compaction, the sampler's distribution, the
compiled step."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import device
import engine_builtin
import moe_kernels
from engine import Sampling
from engine_builtin import generate
from fp8 import convert_to_fp8
from tests.host_reads import SIZED_BY_DATA, VALUE_OPS, HostReads

VOCAB = 256


def moe_model(dtype=torch.float32, context: int = 640, layers: int = 2):
    """A random Qwen3-MoE with grouped-query attention (8 query heads on 2 key-value heads)."""
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=context, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                            experts_implementation=moe_kernels.experts_implementation("cpu")).eval()


def prompts(rows: int, width: int, seed: int = 0):
    """Left-padded random prompts of different lengths (the last row fills the width)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(max(1, width // 2), width + 1, (rows,), generator=g)
    lengths[-1] = width
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


class StepLog(TorchDispatchMode):
    """Per decode step (between calls of the decoder's step): bytes of fresh tensors (and the host
    reads logged_generate counts in it)."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = [{"reads": [], "bytes": 0}]

    def next_step(self):
        self.steps.append({"reads": [], "bytes": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = self.steps[-1]
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        now["bytes"] += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
        return out


def logged_generate(model, ids, mask, *, max_new_tokens, stop_check_every=8, **kw):
    log, host = StepLog(), HostReads()
    decoder = engine_builtin._Decoder(model, None)
    step = decoder.step

    def logged_step(*a):
        log.steps[-1]["reads"], host.reads = host.reads, []
        log.next_step()
        return step(*a)

    decoder.step = logged_step
    with log, host:
        gen = generate(model, ids, mask, max_new_tokens=max_new_tokens, stop_ids=[], pad_id=0,
                       sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(0),
                       stop_check_every=stop_check_every, decoder=decoder, **kw)
    log.steps[-1]["reads"] = host.reads
    return gen, log.steps


@pytest.fixture(scope="module")
def model():
    return moe_model()


@pytest.mark.parametrize("rollout_dtype", ["fp32", "fp8"])
def test_host_reads_once_per_stop_check_and_nothing_grows_with_the_context(model, rollout_dtype):
    """Steps 1..N of a 40-step decode: one host read per 8 steps, at the stop check, and none
    elsewhere (inside the FP8 layers neither); a step at context ~520 allocates no more than 1.1x
    one at context ~40."""
    net = convert_to_fp8(moe_model(torch.bfloat16), torch.bfloat16) if rollout_dtype == "fp8" else model
    per_context = {}
    for width in (24, 504):
        ids, mask = prompts(6, width)
        gen, steps = logged_generate(net, ids, mask, max_new_tokens=40)
        assert gen.response_ids.shape == (6, 40) and gen.truncated.all()  # no stop id: every step ran
        # steps[0]: the prefill and the first token; the last also holds the call's end (the
        # responses cut to the longest, one read per call)
        decode = steps[1:-1]
        assert len(decode) == 38
        reads = [s["reads"] for s in decode]  # steps[k] ends with the stop check after token k + 1
        assert [len(r) for r in reads] == [int((k + 1) % 8 == 0) for k in range(1, 39)], reads
        per_context[width] = sorted(s["bytes"] for s in decode)[len(decode) // 2]
    assert per_context[504] <= 1.1 * per_context[24], per_context


def test_the_old_loop_grew_with_the_context(model):
    """What the test above guards against: transformers' DynamicCache, grown by concatenation,
    allocates the whole cache again every step (the loop before kv_cache.py)."""
    from transformers import DynamicCache

    per_context = {}
    for width in (24, 504):
        ids, mask = prompts(6, width)
        cache, log = DynamicCache(config=model.config), StepLog()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask.long(), use_cache=True, past_key_values=cache)
            attention = mask.long()
            with log:
                for _ in range(4):
                    attention = torch.cat([attention, torch.ones(6, 1, dtype=torch.long)], -1)
                    model(input_ids=ids[:, -1:], attention_mask=attention, use_cache=True, past_key_values=cache)
                    log.next_step()
        per_context[width] = log.steps[1]["bytes"]
    assert per_context[504] > 5 * per_context[24], per_context


def test_compacting_finished_rows_changes_no_token(model):
    """Rows stop at different steps (a stop id drawn); with compaction the survivors decode in a
    smaller batch, and every row's tokens and log-probs are what they are without it."""
    ids, mask = prompts(16, 12)
    stop = list(range(1, 24))  # ~9% of the vocabulary: rows end after ~10 tokens, some much later
    run = lambda compact: generate(model, ids, mask, max_new_tokens=48, stop_ids=stop, pad_id=0,  # noqa: E731
                                   sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(5),
                                   stop_check_every=4, compact=compact)
    calls = []
    keep = engine_builtin._compacted_rows
    engine_builtin._compacted_rows = lambda *a: calls.append(keep(*a)) or calls[-1]
    try:
        compacted = run(True)
    finally:
        engine_builtin._compacted_rows = keep
    assert any(rows is not None for rows in calls), "no compaction happened: the test proves nothing"
    whole = run(False)
    lengths = whole.response_mask.sum(-1)
    assert lengths.min() < lengths.max() and not whole.truncated.all()
    assert torch.equal(compacted.response_ids, whole.response_ids)
    assert torch.equal(compacted.response_mask, whole.response_mask)
    assert torch.equal(compacted.truncated, whole.truncated)
    torch.testing.assert_close(compacted.logp, whole.logp, atol=1e-5, rtol=0)


def test_stop_check_interval_changes_no_token(model):
    ids, mask = prompts(8, 10)
    run = lambda every: generate(model, ids, mask, max_new_tokens=30, stop_ids=list(range(1, 24)), pad_id=0,  # noqa: E731
                                 sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(2),
                                 stop_check_every=every, compact=False)
    a, b = run(1), run(8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.truncated, b.truncated)
    assert torch.equal(a.logp, b.logp)


def test_sampler_draws_each_token_with_its_probability():
    """4,000 rows of one distribution, top_p cutting the tail: frequencies within 4 standard
    errors of the (renormalised) probabilities, cut tokens never drawn."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(4000, -1).contiguous()
    token = engine_builtin._choose_token(logits, greedy=False, top_p=0.9, generator=torch.Generator().manual_seed(0))
    kept = torch.tensor([0.4, 0.3, 0.15, 0.1]) / 0.95  # 0.4 + 0.3 + 0.15 < 0.9: the 0.1 crosses it
    freq = torch.bincount(token, minlength=5).float() / 4000
    assert freq[4] == 0
    stderr = (kept * (1 - kept) / 4000).sqrt()
    assert ((freq[:4] - kept).abs() <= 4 * stderr).all(), (freq, kept)


def test_compiled_decode_step_gives_the_eager_tokens():
    """rollout_compile on the CPU: the decode step through torch.compile (inductor), greedy, gives
    the eager loop's tokens and log-probs within float noise (one layer: compiling is the cost),
    and, recording the routing (routing_replay: hooks on the router inside the compiled step),
    the eager loop's expert ids."""
    model = moe_model(layers=1)
    ids, mask = prompts(4, 8)
    run = lambda mode: generate(model, ids, mask, max_new_tokens=12, stop_ids=[], pad_id=0,  # noqa: E731
                                sampling=Sampling(greedy=True),
                                decoder=engine_builtin._Decoder(model, mode, record_routing=True))
    eager, compiled = run(None), run(device.decode_compile_mode("cpu", True, torch.float32))
    assert torch.equal(eager.response_ids, compiled.response_ids)
    assert compiled.routed_experts.shape == (4, 8 + 12, 1, 2) and torch.equal(eager.routed_experts,
                                                                              compiled.routed_experts)
    torch.testing.assert_close(eager.logp, compiled.logp, atol=1e-5, rtol=0)


def test_the_engine_keeps_one_static_cache_for_every_call(model, monkeypatch):
    """The engine reserves its cache once, at full size (the memory it reports); calls of fewer
    rows and narrower prompts, with finished rows compacted out, decode in that same storage,
    marked as static addresses, and draw the tokens a call with a cache of its own draws."""
    from engine import Seeds
    from weight_sync import RolloutWeights

    engine = engine_builtin.BuiltinEngine(model, RolloutWeights(model.config, "fp32"), device=torch.device("cpu"),
                                          stop_ids=list(range(1, 24)), pad_id=0, max_new_tokens=32,
                                          stop_check_every=4, max_rows=16, max_prompt_width=24)
    cache = engine.decoder.cache
    storage = lambda: [cache.keys, cache.values, cache.mask, cache.column]  # noqa: E731
    reserved = [t.data_ptr() for t in storage()]
    text = model.config
    per_row = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4 + 4  # fp32 keys, values, mask
    assert engine.memory()["kv_cache"] == 16 * (24 + 32) * per_row
    calls = []
    keep = engine_builtin._compacted_rows
    monkeypatch.setattr(engine_builtin, "_compacted_rows", lambda *a: calls.append(keep(*a)) or calls[-1])
    for rows, width in ((16, 24), (10, 8), (16, 12)):
        ids, mask = prompts(rows, width, seed=rows + width)
        gen = engine.generate(ids, mask, sampling=Sampling(temperature=1.0), seeds=Seeds(batch=width, per_sample=[]))
        own = generate(model, ids, mask, max_new_tokens=32, stop_ids=engine.stop_ids, pad_id=0,
                       sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(width),
                       stop_check_every=4)
        assert torch.equal(gen.response_ids, own.response_ids) and torch.equal(gen.truncated, own.truncated)
        torch.testing.assert_close(gen.logp, own.logp, atol=1e-5, rtol=0)
        assert [t.data_ptr() for t in storage()] == reserved
    assert any(rows is not None for rows in calls), "no compaction happened: the test proves nothing"
    assert all(t._dynamo_static_input_type for t in storage())  # what torch._dynamo.mark_static_address sets


@pytest.mark.parametrize("rollout_dtype", ["fp32", "fp8"])
def test_compiled_steps_one_graph_per_rows_and_attended_length_mutating_static_inputs(rollout_dtype, monkeypatch):
    """Two calls of different prompt widths into one reserved cache, compiled: one graph per
    attended length met (filled positions rounded up to 16, 32, then the storage's 40), not per
    step, within the decoder's stated bound; and every input a graph mutates (the cache's keys,
    values and mask) is among the static inputs, so CUDA graphs take the step (inductor skips
    graphs that mutate any other input: FP8's conversion workspace did)."""

    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def inspect(gm, example_inputs):
        # What inductor reads to decide on CUDA graphs (compile_fx.get_static_input_idxs)
        meta = torch._guards.TracingContext.try_get().fw_metadata
        graphs.append(({i for i, info in enumerate(meta.input_info) if info.mutates_data},
                       set(meta.static_input_indices)))
        return gm.forward

    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda step, mode, dynamic: compile(
        step, backend=aot_autograd(fw_compiler=inspect), dynamic=dynamic))
    model = convert_to_fp8(moe_model(torch.bfloat16, layers=1), torch.bfloat16) if rollout_dtype == "fp8" \
        else moe_model(layers=1)
    decoder = engine_builtin._Decoder(model, device.decode_compile_mode("cpu", True, torch.float32))
    decoder.reserve(4, 20 + 20)
    steps = 0
    for width in (8, 20):
        ids, mask = prompts(4, width)
        gen = generate(model, ids, mask, max_new_tokens=20, stop_ids=[], pad_id=0, sampling=Sampling(greedy=True),
                       decoder=decoder)
        steps += gen.response_ids.shape[1] - 1
    # call 1 attends over 16 (9..16 filled), 32 (17..27); call 2 over 32 (21..32), 40 (33..39)
    assert steps == 38 and len(graphs) == 3 <= decoder.step_shapes()
    for mutated, static in graphs:
        assert len(mutated) == 3 and mutated <= static, (mutated, static)


# Ops in a compiled step that read a device value on the host: aten's (tests/host_reads.py), and
# transformers' fallback for grouped GEMMs, which reads the experts' row offsets inside (offs.tolist()).
HOST_READING_OPS = {*VALUE_OPS, *SIZED_BY_DATA, "transformers::grouped_mm_fallback"}


def _reads_the_host(node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target in HOST_READING_OPS or target.overloadpacket in HOST_READING_OPS or target.name() in HOST_READING_OPS)


@pytest.mark.parametrize("rollout_dtype", ["fp32", "bf16", "fp8"])
def test_cuda_graphs_only_where_the_whole_decode_step_is_capturable(rollout_dtype, monkeypatch):
    """A CUDA graph replays one capture: an op inside a compiled graph that reads the device on
    the host cannot be captured (the copy raises during capture) or is replayed with the values
    of its capture. The mode CUDA gets by default for each rollout dtype (reduce-overhead: CUDA
    graphs) agrees with the compiled step traced here: no graph holds an op that reads the host.
    (A graph break is no such hazard: the Python between two graphs runs eagerly; transformers
    5.5.4 breaks at its version checks, 5.19 does not.) FP8 experts run grouped, as on CUDA (the
    CPU runs them dense at this size)."""
    from torch._dynamo.backends.common import aot_autograd

    from fp8 import Fp8Experts

    compute_dtype = device.RolloutDtype.of(rollout_dtype).compute
    graphs = []
    monkeypatch.setattr(torch, "compile", lambda step, mode, dynamic: torch._dynamo.optimize(
        aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm.graph) or gm.forward), dynamic=dynamic)(step))
    monkeypatch.setattr(Fp8Experts, "implementation", "grouped")
    model = moe_model(compute_dtype, layers=1)
    model = convert_to_fp8(model, compute_dtype) if rollout_dtype == "fp8" else model
    torch._dynamo.reset()
    ids, mask = prompts(4, 8)
    decoder = engine_builtin._Decoder(model, device.decode_compile_mode("cpu", True, compute_dtype))
    generate(model, ids, mask, max_new_tokens=6, stop_ids=[], pad_id=0, sampling=Sampling(greedy=True),
             decoder=decoder)  # 9 to 14 positions filled: one attended length, one step shape
    reads = sorted({str(node.target) for graph in graphs for node in graph.nodes if _reads_the_host(node)})
    capturable = bool(graphs) and not reads
    assert (device.decode_compile_mode("cuda", None, compute_dtype) == "reduce-overhead") == capturable, reads
    assert capturable == (compute_dtype == torch.bfloat16), "the case this test is for has moved: read it again"


def test_cached_attention_takes_attention_output_in_the_layout_cuda_kernels_return(monkeypatch):
    """CUDA's fused attention kernels return [batch, length, heads, dim] memory under their
    [batch, heads, length, dim] result, where the CPU's is contiguous; one decode step's
    attention, whose query rows are a key-value head's query heads, must take either (the H200
    check: a view of it raised at the demo's first decode step). Greedy tokens are the same."""
    model = moe_model(layers=1)
    ids, mask = prompts(4, 8)
    run = lambda: generate(model, ids, mask, max_new_tokens=6, stop_ids=[], pad_id=0,  # noqa: E731
                           sampling=Sampling(greedy=True)).response_ids
    expected, attention = run(), torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: attention(*a, **k).transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(run(), expected)
