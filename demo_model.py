"""The demo's tiny model (``python data_prep.py demo``): a character-level tokenizer with
Qwen-style chat specials, a two-layer Qwen3-MoE, and the supervised warm start that stops once
greedy answers depend on the operands. data_prep.build_demo_assets writes the task's files, reads
them back with the project's own loader and hands the prompts to :func:`warm_start`; this module
imports nothing of data_prep, whose command line dispatches here (no import circle)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

# ``prompts`` below is a data_prep.PromptSet (its prompt_ids and answers), typed Any: data_prep
# imports this module, so this one cannot import it back.

DEMO_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")  # pad, turn start, EOS, unknown
DEMO_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEMO_MAX_POSITIONS = 128
DEMO_MAX_NEW_TOKENS = 8
WARM_START_LR = 1e-3
WARM_START_BATCH = 32
WARM_START_MAX_STEPS = 300
WARM_START_TARGET_ACCURACY = 0.15
WARM_START_MIN_DISTINCT = 8
WARM_START_EVAL_BATCH = 64  # prompts per generation batch when greedy_accuracy measures the warm start


def build_demo_tokenizer():
    """Character-level tokenizer (printable ASCII, newline, tab) with Qwen-style chat specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = ["\n", "\t"] + [chr(code) for code in range(0x20, 0x7F)]
    vocab = {token: index for index, token in enumerate([*DEMO_SPECIAL_TOKENS, *characters])}
    # BPE without merges is a character-level model: each character is its own token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(DEMO_SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        padding_side="left", chat_template=DEMO_CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_max_length=DEMO_MAX_POSITIONS,
    )


DEMO_HEAD_DIM = 32  # the smallest vLLM's CPU attention runs (32, 64, 80, ...): the demo works with both engines


def build_demo_model(tokenizer):
    """Tiny Qwen3-MoE (2 layers, hidden 64, 4 heads of DEMO_HEAD_DIM, 8 experts top-2) from the
    current torch RNG state."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=DEMO_HEAD_DIM,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=DEMO_MAX_POSITIONS,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.max_new_tokens = DEMO_MAX_NEW_TOKENS
    return model


def greedy_accuracy(model, tokenizer, prompts: Any) -> tuple[float, int]:
    """(fraction of prompts whose greedy response is exactly the answer then EOS,
    number of distinct greedy responses)."""
    from rollout import generate_responses

    answer_ids = [tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in prompts.answers]
    generated = generate_responses(model, tokenizer, prompts.prompt_ids,
                                   max_new_tokens=max(len(ids) for ids in answer_ids) + 1, do_sample=False,
                                   batch_size=WARM_START_EVAL_BATCH)
    correct = sum(stopped and ids == answer for (ids, stopped), answer in zip(generated, answer_ids))
    return correct / len(generated), len({tuple(ids) for ids, _ in generated})


def _supervised_batch(prompts: Any, tokenizer, indices: list[int]) -> dict[str, Any]:
    """Right-padded prompt + answer + EOS; the loss sees only answer and EOS tokens."""
    import torch

    sequences, label_rows = [], []
    for i in indices:
        target = tokenizer(prompts.answers[i], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompts.prompt_ids[i] + target)
        label_rows.append([-100] * len(prompts.prompt_ids[i]) + target)
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(indices), width), tokenizer.pad_token_id)
    labels = torch.full((len(indices), width), -100)
    attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
    for row, (sequence, label_row) in enumerate(zip(sequences, label_rows)):
        input_ids[row, :len(sequence)] = torch.tensor(sequence)
        labels[row, :len(sequence)] = torch.tensor(label_row)
        attention_mask[row, :len(sequence)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warm_start(model, tokenizer, prompts: Any, *, seed: int) -> dict[str, Any]:
    """Supervised training on the answers, stopped at the first step where greedy decoding gets
    at least WARM_START_TARGET_ACCURACY right with at least WARM_START_MIN_DISTINCT distinct
    answers (the answers depend on the operands), or after WARM_START_MAX_STEPS.

    Stopping on the measured state rather than after a fixed step count matters because the
    curve is jumpy: at a fixed 100 steps, seeds 0-3 ranged from 0.13 with 4 distinct answers
    to 0.24 with 10. A constant answer scores ~0.1 on this task and RL cannot escape it
    (docs/platform.md), hence the distinct-answer condition.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR)
    model.train()
    accuracy, distinct = greedy_accuracy(model, tokenizer, prompts)
    step = 0
    while step < WARM_START_MAX_STEPS and not (
            accuracy >= WARM_START_TARGET_ACCURACY and distinct >= WARM_START_MIN_DISTINCT):
        indices = torch.randperm(len(prompts), generator=generator)[:WARM_START_BATCH].tolist()
        loss = model(**_supervised_batch(prompts, tokenizer, indices)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        accuracy, distinct = greedy_accuracy(model, tokenizer, prompts)
    target_met = accuracy >= WARM_START_TARGET_ACCURACY and distinct >= WARM_START_MIN_DISTINCT
    return {"warm_start_steps": step, "greedy_accuracy": accuracy, "distinct_answers": distinct,
            "warm_start_target_met": target_met}
@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the block with torch on one intra-op thread, then give back the caller's count.

    Kernels split their reductions across threads, which changes the order of float additions:
    the warm start then stopped at step 85 with one thread and at 96 with two.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
