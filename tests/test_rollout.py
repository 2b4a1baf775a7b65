"""Generation with the KV cache, stop tokens, top_p, sample batches and the dynamic-sampling pool."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import engine_builtin
from data_prep import load_prompts
from engine import Sampling, Seeds
from engine_builtin import generate
from rollout import GroupPool, keep_informative, left_pad
from samples import SampleBatch


@pytest.fixture(scope="module")
def demo(demo_assets):
    model = AutoModelForCausalLM.from_pretrained(demo_assets / "model", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "model")
    prompts = load_prompts(demo_assets / "val.jsonl", tokenizer)
    ids, mask = left_pad(prompts.prompt_ids[:12], max(map(len, prompts.prompt_ids[:12])) + 3, tokenizer.pad_token_id)
    return model, tokenizer, ids, mask


def test_greedy_generation_matches_hugging_face_generate(demo):
    model, tokenizer, ids, mask = demo
    ours = generate(model, ids, mask, max_new_tokens=6, stop_ids=[tokenizer.eos_token_id],
                    pad_id=tokenizer.pad_token_id, sampling=Sampling(greedy=True))
    theirs = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=6, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    theirs = theirs[:, ids.shape[1]:]
    width = ours.response_ids.shape[1]
    assert torch.equal(ours.response_ids[ours.response_mask], theirs[:, :width][ours.response_mask])


def test_sampling_stops_at_first_stop_id_and_flags_truncation(demo):
    model, tokenizer, ids, mask = demo
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("3")]
    gen = generate(model, ids, mask, max_new_tokens=5, stop_ids=stop, pad_id=tokenizer.pad_token_id,
                   sampling=Sampling(temperature=1.5), generator=torch.Generator().manual_seed(0))
    for row, row_mask, truncated in zip(gen.response_ids.tolist(), gen.response_mask.tolist(), gen.truncated.tolist()):
        length = sum(row_mask)
        assert row_mask == [True] * length + [False] * (len(row) - length)
        hits = [i for i, t in enumerate(row[:length]) if t in stop]
        assert hits == ([] if truncated else [length - 1])
        assert truncated == (length == 5 and row[4] not in stop)
        assert all(t == tokenizer.pad_token_id for t in row[length:])


def test_same_generator_seed_same_samples(demo):
    model, tokenizer, ids, mask = demo
    draw = lambda seed: generate(model, ids, mask, max_new_tokens=5, stop_ids=[tokenizer.eos_token_id],  # noqa: E731
                                 pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(1).response_ids, draw(1).response_ids)
    assert not torch.equal(draw(1).response_ids, draw(2).response_ids)


def test_rollout_logprobs_match_a_full_forward_pass(demo):
    model, tokenizer, ids, mask = demo
    gen = generate(model, ids, mask, max_new_tokens=5, stop_ids=[tokenizer.eos_token_id],
                   pad_id=tokenizer.pad_token_id, sampling=Sampling(temperature=0.8),
                   generator=torch.Generator().manual_seed(3))
    full = torch.cat([ids, gen.response_ids], 1)
    attention = torch.cat([mask, gen.response_mask], 1).long()
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attention,
                       position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
    width = gen.response_ids.shape[1]
    expected = (logits[:, -width - 1:-1].float() / 0.8).log_softmax(-1).gather(-1, gen.response_ids[..., None])[..., 0]
    torch.testing.assert_close(gen.logp[gen.response_mask], expected[gen.response_mask], atol=1e-4, rtol=1e-4)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(engine_builtin._top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 crosses it
    assert torch.isfinite(engine_builtin._top_p_filter(logits, 1.0)).all()


def fake_batch(rewards, group_size, prompt_width=3, response_width=2, first_prompt=0):
    n = len(rewards)
    return SampleBatch(
        prompt_ids=torch.arange(n * prompt_width).view(n, prompt_width), prompt_mask=torch.ones(n, prompt_width, dtype=torch.bool),
        response_ids=torch.ones(n, response_width, dtype=torch.long), response_mask=torch.ones(n, response_width, dtype=torch.bool),
        rollout_logp=torch.zeros(n, response_width), reward=torch.tensor(rewards, dtype=torch.float32),
        score=torch.tensor(rewards, dtype=torch.float32), correct=torch.tensor(rewards) > 0,
        truncated=torch.zeros(n, dtype=torch.bool),
        prompt_index=torch.arange(n) // group_size + first_prompt, version=torch.zeros(n, dtype=torch.long),
        group_size=group_size)


def test_concat_pads_prompts_left_and_responses_right():
    a, b = fake_batch([1, 0], 2, prompt_width=2, response_width=3), fake_batch([0, 1], 2, prompt_width=4, response_width=1)
    both = SampleBatch.concat([a, b])
    assert both.prompt_ids.shape == (4, 4) and both.response_ids.shape == (4, 3)
    assert both.prompt_mask[0].tolist() == [False, False, True, True]
    assert both.response_mask[2].tolist() == [True, False, False]
    assert torch.equal(both.prompt_ids[0, 2:], a.prompt_ids[0])


def test_pool_keeps_informative_groups_and_carries_the_surplus():
    batch = fake_batch([1, 0, 1, 1, 0, 1, 0, 0, 1, 0], group_size=2)
    informative = keep_informative(batch, "reward")
    assert informative == [0, 2, 4]  # groups (1,0) (0,1) (1,0); (1,1) and (0,0) carry no signal
    pool = GroupPool()
    pool.add(batch.select_groups(informative))
    step = pool.take(2)
    assert step.prompt_index.tolist() == [0, 0, 2, 2] and pool.num_groups == 1
    pool.add(fake_batch([1, 0], 2, first_prompt=7))
    nxt = pool.take(2)
    assert nxt.prompt_index.tolist() == [4, 4, 7, 7] and pool.num_groups == 0


def test_a_runs_builtin_engine_reserves_its_cache_for_the_largest_call_at_start(demo_assets):
    """build_engine sizes the cache for a step's share of sequences at the widest prompt bucket, so
    no call of the run allocates another (a compiled step's static addresses stay put)."""
    from config import load_config
    from device import select_platform
    from ranks import Layout
    from rollout import build_engine

    cfg = load_config(["--config", str(Path(__file__).parents[1] / "configs" / "demo_cpu.yaml"),
                       "--model_path", str(demo_assets / "model"), "--dataset", str(demo_assets / "train.jsonl")])
    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "model")
    model = AutoModelForCausalLM.from_pretrained(demo_assets / "model", dtype=torch.float32)
    layout = Layout(world_size=8, rank=1, num_learners=2)  # 6 engines: one prompt of the step's 6 each
    engine = build_engine(cfg, select_platform("cpu"), layout, tokenizer, lambda: model)
    cache = engine.decoder.cache
    assert cache.capacity == (8, 64 + 8)  # 1 prompt x 8 samples; max_prompt_length 64, new tokens 8
    storage = cache.keys.data_ptr()
    rows = load_prompts(demo_assets / "val.jsonl", tokenizer).prompt_ids[:1]
    ids, mask = left_pad([rows[0]] * 8, 64, tokenizer.pad_token_id)
    engine.generate(ids, mask, sampling=Sampling(), seeds=Seeds.of(0, 1, 1, 0, [0], 8))
    assert cache.capacity == (8, 64 + 8) and cache.keys.data_ptr() == storage
