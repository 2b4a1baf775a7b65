"""Tests for rewards.py: rule rewards, rule resolution and the reward-model scorer."""

import logging
import string
import sys
import textwrap

import pytest
import torch

from config import UserError
from rewards import (
    BUILTIN_RULES,
    MalformedResponse,
    RewardModelScorer,
    demo_arithmetic,
    math_answer,
    math_verify_answer,
    resolve_rule,
    score_with_rule,
)

# ---------------------------------------------------------------------------------------
# math_answer


def test_math_answer_correct_and_wrong():
    response = "Let me think. 6 * 7 = 42.\nAnswer: 42"
    assert math_answer(response, "42") == (1.0, True)
    assert math_answer(response, "41") == (-1.0, False)


@pytest.mark.parametrize("response", ["", "The answer is 42", "Answer:", "Answer:   \n"])
def test_math_answer_without_answer_is_malformed(response):
    with pytest.raises(MalformedResponse):
        math_answer(response, "42")


def test_math_answer_reads_only_the_last_300_characters():
    assert math_answer("x" * 100_000 + "\nAnswer: 5", "5") == (1.0, True)
    with pytest.raises(MalformedResponse):
        math_answer("Answer: 5\n" + "y" * 100_000, "5")
    # The window is exactly 300 characters and the marker must lie wholly inside it.
    assert math_answer("Answer: 5\n" + "z" * 290, "5") == (1.0, True)
    with pytest.raises(MalformedResponse):
        math_answer("Answer: 5\n" + "z" * 291, "5")


def test_math_answer_last_answer_wins():
    response = "Answer: 3\nWait, I made a mistake.\nAnswer: 5"
    assert math_answer(response, "5") == (1.0, True)
    assert math_answer(response, "3") == (-1.0, False)


def test_math_answer_marker_is_case_insensitive():
    assert math_answer("so the final answer: 7", "7") == (1.0, True)


@pytest.mark.parametrize(
    "written, reference, correct",
    [
        (" 42. ", "42", True),
        ("$42$", "42", True),
        ("\\boxed{42}", "42", True),
        ("$\\boxed{42}$.", "42", True),
        ("1,000", "1000", True),
        ("1000", "1,000", True),
        ("1,234,567.5", "1234567.5", True),
        ("2.0", "2", True),
        ("1/2", "0.5", True),
        ("-0", "0", True),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
        ("ABC", "abc", True),
        ("43", "42", False),
        ("2.01", "2", False),
        ("1,2", "12", False),  # a list, not a comma-grouped number
        ("\\boxed{1}+\\boxed{2}", "1}+\\boxed{2", False),  # the first box does not span the text
        ("nan", "nan", True),  # compared as strings, never as floats (nan != nan)
        ("inf", "1e400", False),
    ],
)
def test_math_answer_normalisation(written, reference, correct):
    expected = (1.0, True) if correct else (-1.0, False)
    assert math_answer(f"work...\nAnswer: {written}", reference) == expected


# ---------------------------------------------------------------------------------------
# demo_arithmetic


def test_demo_arithmetic_exact_answer():
    assert demo_arithmetic("7", "7") == (1.0, True)
    assert demo_arithmetic(" \n7\t ", "7") == (1.0, True)
    assert demo_arithmetic("8", "7") == (0.0, False)
    assert demo_arithmetic("07", "7") == (0.0, False)
    assert demo_arithmetic("12", "12") == (1.0, True)


@pytest.mark.parametrize("response", ["5hhhh", "", "   ", "7 7", "7hhh", "7.0", "seven"])
def test_demo_arithmetic_rejects_non_integers(response):
    with pytest.raises(MalformedResponse):
        demo_arithmetic(response, "7")


# ---------------------------------------------------------------------------------------
# score_with_rule and resolve_rule


def test_score_with_rule_mixed_math_batch():
    rule = resolve_rule("math_answer")
    responses = ["Answer: 4", "Answer: 5", "I give up", "Answer: \\boxed{10}", ""]
    answers = ["4", "4", "4", "10", "1"]
    scored = score_with_rule(rule, responses, answers)
    assert scored.scores == [1.0, -1.0, -1.0, 1.0, -1.0]
    assert scored.correct == [True, False, False, True, False]
    assert scored.num_malformed == 2


def test_score_with_rule_mixed_demo_batch():
    scored = score_with_rule(BUILTIN_RULES["demo_arithmetic"], ["7", "8", "5hhhhhhh", " 7\n", ""], ["7"] * 5)
    assert scored.scores == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert scored.correct == [True, False, False, True, False]
    assert scored.num_malformed == 2


def test_score_with_rule_rejects_programming_errors():
    with pytest.raises(ValueError, match="2 responses but 1"):
        score_with_rule(BUILTIN_RULES["math_answer"], ["Answer: 1", "Answer: 2"], ["1"])
    with pytest.raises(ValueError, match="needs a reference answer"):
        score_with_rule(BUILTIN_RULES["math_answer"], ["Answer: 1"], [None])


USER_RULES = '''
def exact(response, answer):
    if response == "boom":
        raise RuntimeError("bug in my reward")
    return (2.0 if response == answer else -0.5), response == answer
exact.wrong_score = -3.0

def length(response, answer):
    if response == "boom":
        raise RuntimeError("bug in my reward")
    return float(len(response)), answer is None

def nan_score(response, answer):
    return float("nan"), True

def bad_wrong_score(response, answer):
    return 1.0, True
bad_wrong_score.wrong_score = "low"

not_callable = 5
'''


@pytest.fixture
def user_rules_module(tmp_path, monkeypatch):
    name = "user_reward_rules_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_RULES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_rule_that_raises_is_scored_wrong_and_counted(user_rules_module, caplog):
    rule = resolve_rule(f"{user_rules_module}:exact")
    assert rule.wrong_score == -3.0
    with caplog.at_level(logging.WARNING, logger="rewards"):
        scored = score_with_rule(rule, ["a", "boom", "b", "boom"], ["a", "a", None, "b"])
    assert scored.scores == [2.0, -3.0, -0.5, -3.0]
    assert scored.correct == [True, False, False, False]
    assert scored.num_malformed == 2
    # The bug is shown to the user once, not once per response.
    assert sum("bug in my reward" in record.getMessage() for record in caplog.records) == 1


def test_user_rule_defaults(user_rules_module):
    rule = resolve_rule(f"{user_rules_module}:length")
    assert rule.wrong_score == 0.0
    scored = score_with_rule(rule, ["abc", "boom"], [None, None])
    assert scored.scores == [3.0, 0.0]
    assert scored.correct == [True, False]
    assert scored.num_malformed == 1


def test_non_finite_user_score_counts_as_malformed(user_rules_module):
    scored = score_with_rule(resolve_rule(f"{user_rules_module}:nan_score"), ["x"], ["x"])
    assert scored.scores == [0.0]
    assert scored.correct == [False]
    assert scored.num_malformed == 1


def test_resolve_builtin_rules():
    assert resolve_rule("math_answer").wrong_score == -1.0
    assert resolve_rule("math_answer").fn is math_answer
    assert resolve_rule("demo_arithmetic").wrong_score == 0.0
    assert resolve_rule("demo_arithmetic").fn is demo_arithmetic


def test_resolve_rule_errors(user_rules_module):
    expected = ("unknown reward_fn 'exact_match' (built-ins: demo_arithmetic, math_answer, math_verify; "
                "or module:function)")
    with pytest.raises(UserError) as error:  # one line and exit status 2 in train_dapo.main
        resolve_rule("exact_match")
    assert str(error.value) == expected
    with pytest.raises(UserError, match="cannot import module 'no_such_reward_module'"):
        resolve_rule("no_such_reward_module:score")
    with pytest.raises(UserError, match="has no attribute 'missing'"):
        resolve_rule(f"{user_rules_module}:missing")
    with pytest.raises(UserError, match="'not_callable' is not callable"):
        resolve_rule(f"{user_rules_module}:not_callable")
    with pytest.raises(UserError, match="wrong_score must be a number"):
        resolve_rule(f"{user_rules_module}:bad_wrong_score")
    with pytest.raises(UserError, match="expected module:function"):
        resolve_rule(f"{user_rules_module}:")


# ---------------------------------------------------------------------------------------
# math_verify (the math-verify package)


@pytest.mark.parametrize("written, reference, equivalent", [
    (r"The answer is $\boxed{0.5}$.", r"\frac{1}{2}", True),  # decimal vs LaTeX fraction
    (r"so \boxed{\frac12}", "0.5", True),
    ("Answer: 1/2", r"\frac{1}{2}", True),  # plain fraction vs LaTeX
    (r"\boxed{\dfrac{3}{4}}", "0.75", True),
    (r"\boxed{\sqrt{12}}", r"2\sqrt{3}", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{1+x}", "x+1", True),
    (r"First 3, then the final answer \boxed{5}", "5", True),  # a box wins over a bare number
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", False),
    (r"\boxed{2}", "-2", False),
    (r"\boxed{5}", "3", False),
    (r"\boxed{2}", r"\sqrt{2}", False),
])
def test_math_verify_judges_equivalence(written, reference, equivalent):
    assert math_verify_answer(written, reference) == ((1.0, True) if equivalent else (-1.0, False))


@pytest.mark.parametrize("written", ["", "I do not know.", "}}{{\\boxed{", "\\boxed{"])
def test_math_verify_without_an_answer_is_malformed_and_scored_wrong(written):
    with pytest.raises(MalformedResponse):
        math_verify_answer(written, "3")
    scored = score_with_rule(resolve_rule("math_verify"), [written, r"\boxed{3}"], ["3", "3"])
    assert (scored.scores, scored.num_malformed) == ([-1.0, 1.0], 1)


def test_math_verify_without_its_package_is_refused_with_the_install_command(monkeypatch):
    assert resolve_rule("math_verify").fn is math_verify_answer
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(UserError, match=r"reward_fn math_verify .* pip install -e '\.\[math\]'"):
        resolve_rule("math_verify")


# ---------------------------------------------------------------------------------------
# RewardModelScorer on a tiny offline model

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


def _char_tokenizer(with_pad: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    pad = {"pad_token": "<pad>"} if with_pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", **pad)


def _save_tiny_reward_model(path, *, num_labels=1, with_pad=True):
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    tokenizer = _char_tokenizer(with_pad)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_labels=num_labels,
        initializer_range=0.2,  # logits well away from 0, so reading the wrong token shows
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    return _save_tiny_reward_model(tmp_path_factory.mktemp("reward_model"))


PROMPTS = ["3+4=", "Q: what is 12*12?\nA:", "hi", "x" * 30, "1+1=", "a"]
RESPONSES = ["7", " 144, because 12*12 is 144.", "", "y", "2 and some more words here", "bb"]


def test_reward_model_scores_each_response(tiny_reward_model):
    scored = RewardModelScorer(tiny_reward_model, batch_size=4)(PROMPTS, RESPONSES)
    assert len(scored.scores) == len(PROMPTS)
    assert scored.correct is None
    assert scored.num_malformed == 0
    assert all(isinstance(score, float) for score in scored.scores)
    assert len(set(scored.scores)) == len(PROMPTS)


def test_reward_model_scores_do_not_depend_on_batching(tiny_reward_model):
    one_by_one = RewardModelScorer(tiny_reward_model, batch_size=1)(PROMPTS, RESPONSES).scores
    batched = RewardModelScorer(tiny_reward_model, batch_size=16)(PROMPTS, RESPONSES).scores
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(one_by_one), rtol=0, atol=1e-5)


def test_reward_model_score_is_the_logit_at_the_last_token(tiny_reward_model):
    scorer = RewardModelScorer(tiny_reward_model)
    prompt, response = "Q: what is 12*12?\nA:", " 144"
    input_ids = torch.tensor([[len(SPECIAL_TOKENS) + string.printable.index(c) for c in prompt + response]])
    hidden = scorer.model.model(input_ids=input_ids).last_hidden_state
    expected = scorer.model.score(hidden[0, -1]).item()
    # Batched with longer texts, so this one is padded, and the read position matters.
    scores = scorer([prompt, *PROMPTS], [response, *RESPONSES]).scores
    assert scores[0] == pytest.approx(expected, abs=1e-5)
    assert abs(expected) > 1e-2


def test_reward_model_falls_back_to_eos_for_padding(tiny_reward_model, tmp_path):
    path = _save_tiny_reward_model(tmp_path, with_pad=False)
    scorer = RewardModelScorer(path, batch_size=16)
    assert scorer.tokenizer.pad_token == "<eos>"
    assert scorer.model.config.pad_token_id == SPECIAL_TOKENS.index("<eos>")
    reference = RewardModelScorer(tiny_reward_model, batch_size=1)(PROMPTS, RESPONSES).scores
    torch.testing.assert_close(torch.tensor(scorer(PROMPTS, RESPONSES).scores), torch.tensor(reference), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rollout_dtype, expected", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                    ("fp32", torch.float32)])
def test_a_rollout_ranks_reward_model_is_frozen_in_the_rollouts_compute_dtype(tiny_reward_model, rollout_dtype,
                                                                             expected):
    # FP8 rollout computes in bf16, so its reward model is bf16 too; fp32 only beside an fp32 rollout.
    scorer = RewardModelScorer.for_rollout(tiny_reward_model, rollout_dtype, device="cpu")
    parameters = list(scorer.model.parameters())
    assert {p.dtype for p in parameters} == {expected}
    assert {p.device for p in parameters} == {torch.device("cpu")}
    assert not scorer.model.training and not any(p.requires_grad for p in parameters)
    # Still the same scores, to the precision of the dtype (bf16 keeps 8 bits of mantissa).
    reference = RewardModelScorer(tiny_reward_model)(PROMPTS, RESPONSES).scores
    scores = scorer(PROMPTS, RESPONSES).scores
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(reference), rtol=0,
                               atol=0.05 if expected == torch.bfloat16 else 1e-6)


def test_reward_model_with_two_labels_is_refused(tmp_path):
    path = _save_tiny_reward_model(tmp_path, num_labels=2)
    with pytest.raises(ValueError, match=f"{path} has num_labels=2"):
        RewardModelScorer(path)
