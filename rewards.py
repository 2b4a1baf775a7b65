"""Reward scoring for the DAPO trainer: rule-based rewards and a reward model.

A rule scores one decoded response (text without special tokens) against the prompt's
reference answer. Rules may raise on output they cannot parse; `score_with_rule` turns every
such failure into the rule's "wrong" score and counts it, so a reward never raises on what a
model wrote (docs/algorithm.md §1). A reward model (`RewardModelScorer`) scores prompt + response
by its single logit; on a rollout rank (`RewardModelScorer.for_rollout`) it is loaded straight
onto the rank's device in the rollout's compute dtype, frozen, and counted by the memory plan
at that dtype. Overlong reward shaping is not applied here: the trainer adds it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from config import UserError
from device import RolloutDtype

logger = logging.getLogger(__name__)

RuleFn = Callable[[str, str | None], tuple[float, bool]]  # (response, reference answer) -> (score, correct)


@dataclass(frozen=True)
class Scored:
    """Rewards for a batch of responses, before overlong shaping."""

    scores: list[float]
    correct: list[bool] | None  # None where the reward has no notion of correct (reward model)
    num_malformed: int  # responses the rule could not parse, or on which it raised


class MalformedResponse(ValueError):
    """Raised by a rule when a response cannot be parsed; the response is scored as wrong."""


@dataclass(frozen=True)
class RewardRule:
    """A rule function plus the score given to a response it cannot score.

    needs_answer: the rule compares against a reference answer, so a prompt without one is a
    data error (raised by `score_with_rule`), not a model failure to be scored as wrong.
    requires: (module, project extra) of an optional package the rule imports, so that
    `resolve_rule` refuses the rule at start-up where it is not installed.
    """

    name: str
    fn: RuleFn
    wrong_score: float
    needs_answer: bool = False
    requires: tuple[str, str] | None = None
    verl_style: bool = False  # fn(data_source, solution_str, ground_truth, extra_info) as verl calls it


SIGNATURES = ("expected fn(response, answer) -> (score, correct), or verl's "
              "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> score or {'score': ...}")


# ---------------------------------------------------------------------------------------
# math_answer: DAPO's "Answer: X" convention

_ANSWER_WINDOW_CHARS = 300  # DAPO only looks at the tail, so an answer mid-reasoning is ignored
_ANSWER_PATTERN = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_COMMA_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")


def _unwrap_boxed(text: str) -> str:
    r"""`\boxed{X}` -> `X` when the box spans the whole text; otherwise the text unchanged."""
    prefix = "\\boxed{"
    if not (text.startswith(prefix) and text.endswith("}")):
        return text
    depth = 0
    for index in range(len(prefix) - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            # The brace opened by \boxed closes here: unwrap only if it is the final one,
            # so "\boxed{1}+\boxed{2}" stays as it is.
            return text[len(prefix) : -1] if index == len(text) - 1 else text
    return text


def _strip_decorations(text: str) -> str:
    """Peel whitespace, a trailing period, surrounding $...$ and \\boxed{...} until stable."""
    while True:
        stripped = text.strip().removesuffix(".").strip()
        if len(stripped) >= 2 and stripped.startswith("$") and stripped.endswith("$"):
            stripped = stripped[1:-1]
        stripped = _unwrap_boxed(stripped)
        if stripped == text:
            return text
        text = stripped


def normalise_answer(text: str) -> str:
    """Canonical form of a final answer for string comparison."""
    text = _strip_decorations(text)
    if _COMMA_GROUPED_NUMBER.fullmatch(text):
        text = text.replace(",", "")
    return text.lower()


def _as_number(text: str) -> Fraction | None:
    # Fraction is exact ("2.0" == "2", "1/2" == "0.5") and, unlike float, rejects "nan"/"inf".
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(extracted: str, reference: str) -> bool:
    """Normalised equality, numeric where both sides are numbers."""
    extracted, reference = normalise_answer(extracted), normalise_answer(reference)
    extracted_number, reference_number = _as_number(extracted), _as_number(reference)
    if extracted_number is not None and reference_number is not None:
        return extracted_number == reference_number
    return extracted == reference


def math_answer(response: str, answer: str | None) -> tuple[float, bool]:
    """+1.0 if the last "Answer: X" in the final 300 characters matches the reference, else -1.0.

    Raises MalformedResponse when that window holds no "Answer:" with a non-empty value.
    """
    if answer is None:
        raise ValueError("math_answer needs a reference answer")
    found = _ANSWER_PATTERN.findall(response[-_ANSWER_WINDOW_CHARS:])
    if not found or not normalise_answer(found[-1]):
        raise MalformedResponse("no 'Answer: X' in the last 300 characters")
    correct = answers_match(found[-1], answer)
    return (1.0 if correct else -1.0), correct


# ---------------------------------------------------------------------------------------
# demo_arithmetic: the offline "a+b=" task

_INTEGER = re.compile(r"[+-]?\d+")


def demo_arithmetic(response: str, answer: str | None) -> tuple[float, bool]:
    """1.0 if the whole response (outer whitespace stripped) is exactly the answer, else 0.0.

    Strict on purpose: a lenient "first integer" reward let a run degrade to "5hhhhhhh"
    (docs/platform.md). Anything that is not a bare integer raises MalformedResponse.
    """
    if answer is None:
        raise ValueError("demo_arithmetic needs a reference answer")
    text = response.strip()
    if not _INTEGER.fullmatch(text):
        raise MalformedResponse(f"not an integer: {text[:40]!r}")
    correct = text == answer.strip()
    return (1.0 if correct else 0.0), correct


# ---------------------------------------------------------------------------------------
# math_verify: equivalence judged by the math-verify package (LaTeX, fractions, sets, \boxed{})


@functools.lru_cache(maxsize=4096)  # each reference is scored sample_num times per step
def _parsed_reference(answer: str) -> list[Any]:
    from math_verify import parse

    return parse(f"${answer}$")  # as LaTeX math, so "\frac{1}{2}" and "1/2" both parse


def math_verify_answer(response: str, answer: str | None) -> tuple[float, bool]:
    r"""+1.0 if math-verify judges the response's final answer (the last \boxed{}, else the last
    expression it recognises) equivalent to the reference, else -1.0.

    Raises MalformedResponse when it finds no answer in the response. math-verify itself gives up
    (no parse, or not equivalent) on input it cannot handle or that takes too long; its time limit
    is a SIGALRM, so it must run in the main thread, as rollout scores.
    """
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("math_verify needs a reference answer")
    reference = _parsed_reference(answer)
    if not reference:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    extracted = parse(response)
    if not extracted:
        raise MalformedResponse("math-verify found no answer")
    correct = bool(verify(reference, extracted))
    return (1.0 if correct else -1.0), correct


BUILTIN_RULES: dict[str, RewardRule] = {
    "demo_arithmetic": RewardRule("demo_arithmetic", demo_arithmetic, wrong_score=0.0, needs_answer=True),
    "math_answer": RewardRule("math_answer", math_answer, wrong_score=-1.0, needs_answer=True),
    "math_verify": RewardRule("math_verify", math_verify_answer, wrong_score=-1.0, needs_answer=True,
                              requires=("math_verify", "math")),
}


def _check_installed(rule: RewardRule) -> RewardRule:
    if rule.requires is not None:
        module, extra = rule.requires
        try:
            importlib.import_module(module)
        except ImportError:
            raise UserError(f"reward_fn {rule.name} needs the {module} package, which is not installed: "
                            f"pip install -e '.[{extra}]'") from None
    return rule


def resolve_rule(name: str) -> RewardRule:
    """A built-in rule by name, or a user's `module:function`; UserError (one line naming
    reward_fn) when it cannot be used.

    A user's function is one of two kinds, told apart by its parameters: ours,
    fn(response_text, reference_answer_or_None) -> (score, correct); or verl's,
    compute_score(data_source, solution_str, ground_truth, extra_info=None), called by keyword
    as verl calls it. Either may return (score, correct), a bare score (correct when > 0) or a dict
    with "score" and optionally "acc" (verl's). Its score for responses on which it raises is
    the function's `wrong_score` attribute if it has one, else 0.0.
    """
    if ":" not in name:
        if name not in BUILTIN_RULES:
            builtins = ", ".join(sorted(BUILTIN_RULES))
            raise UserError(f"unknown reward_fn {name!r} (built-ins: {builtins}; or module:function)")
        return _check_installed(BUILTIN_RULES[name])

    module_name, _, attr_name = name.partition(":")
    if not module_name or not attr_name:
        raise UserError(f"reward_fn {name!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user's module may fail to import in any way (SyntaxError, ...)
        raise UserError(f"reward_fn {name!r}: cannot import module {module_name!r}: {exc}") from None
    fn = getattr(module, attr_name, None)
    if fn is None:
        raise UserError(f"reward_fn {name!r}: module {module_name!r} has no attribute {attr_name!r}")
    if not callable(fn):
        raise UserError(f"reward_fn {name!r}: {attr_name!r} is not callable")
    wrong_score = getattr(fn, "wrong_score", 0.0)
    if isinstance(wrong_score, bool) or not isinstance(wrong_score, (int, float)):
        raise UserError(f"reward_fn {name!r}: wrong_score must be a number, got {wrong_score!r}")
    return RewardRule(name, fn, wrong_score=float(wrong_score), verl_style=_takes_verl_arguments(name, fn))


def _takes_verl_arguments(name: str, fn: Callable[..., Any]) -> bool:
    """Whether fn is a verl reward function (True: verl calls them by keyword, so they name
    solution_str and ground_truth) or ours (False: two positional arguments); UserError for neither."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as ours
        return False
    names = {p.name for p in parameters}
    if {"solution_str", "ground_truth"} <= names:
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) <= 2 and (len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters)):
        return False
    raise UserError(f"reward_fn {name!r}: takes ({', '.join(p.name for p in parameters)}); {SIGNATURES}")


_warned_failures: set[tuple[str, str]] = set()


def _warn_once(rule: RewardRule, exc: Exception) -> None:
    # MalformedResponse is expected model behaviour; anything else is likely a bug in the
    # rule, which the user should see once rather than only as a malformed count.
    key = (rule.name, type(exc).__name__)
    if isinstance(exc, MalformedResponse) or key in _warned_failures:
        return
    _warned_failures.add(key)
    logger.warning("reward rule %s raised %s: %s (scored as wrong, counted as malformed)",
                   rule.name, type(exc).__name__, exc)


def _as_score(result: Any) -> tuple[float, bool]:
    """(score, correct) from what a rule returned: that pair, a bare score (correct when > 0),
    or verl's dict with "score" and optionally "acc"."""
    if isinstance(result, dict) and "score" in result:
        score, correct = result["score"], result.get("acc")
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        score, correct = result
    else:
        score, correct = result, None
    if isinstance(score, bool) or not isinstance(score, (int, float)) and not (
            isinstance(score, torch.Tensor) and score.numel() == 1):
        raise TypeError(f"returned {type(result).__name__} {result!r:.80}, not a score")
    score = float(score)
    if not math.isfinite(score):
        raise ValueError(f"non-finite score {score}")
    return score, bool(score > 0 if correct is None else correct)


def _score_one(rule: RewardRule, response: str, answer: str | None, info: Any = None) -> tuple[float, bool]:
    if rule.verl_style:  # called as verl calls it
        return _as_score(rule.fn(data_source=getattr(info, "data_source", None), solution_str=response,
                                 ground_truth=answer, extra_info=getattr(info, "extra_info", None)))
    return _as_score(rule.fn(response, answer))


def probe_rule(rule: RewardRule, answer: str | None, info: Any, where: str) -> None:
    """Call the rule once, before any model loads, on a row's own reference answer as the
    response; UserError (one line) when it raises anything but MalformedResponse or returns
    something that is not a score, which would otherwise score every response wrong."""
    try:
        _score_one(rule, answer or "", answer, info)
    except MalformedResponse:
        pass
    except Exception as exc:  # a user's function may fail in any way
        raise UserError(f"reward_fn {rule.name} failed on the first row ({where}): {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''} ({SIGNATURES})") from None


def score_with_rule(rule: RewardRule, responses: list[str], answers: list[str | None],
                    infos: list[Any] | None = None) -> Scored:
    """Score each response; a rule failure on a response scores it wrong and counts it. ``infos``:
    each row's data_source and extra_info (data_prep.RowInfo), for verl-style functions."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} reference answers")
    if rule.needs_answer and any(answer is None for answer in answers):
        raise ValueError(f"reward rule {rule.name} needs a reference answer for every prompt")
    scores: list[float] = []
    correct: list[bool] = []
    num_malformed = 0
    for response, answer, info in zip(responses, answers, infos or [None] * len(answers)):
        try:
            score, is_correct = _score_one(rule, response, answer, info)
        except Exception as exc:  # model output must never crash a step
            _warn_once(rule, exc)
            score, is_correct = rule.wrong_score, False
            num_malformed += 1
        scores.append(score)
        correct.append(is_correct)
    return Scored(scores=scores, correct=correct, num_malformed=num_malformed)


# ---------------------------------------------------------------------------------------
# Reward model


def reward_model_dtype(rollout_dtype: str) -> torch.dtype:
    """The dtype a rollout rank holds its reward model in: the rollout's compute dtype (bf16
    for bf16 and FP8 rollouts, fp32 only for an fp32 rollout). In fp32 a 7B reward model would
    take 28 GB of every rollout rank's device; memory_plan counts it at this dtype."""
    return RolloutDtype.of(rollout_dtype).compute


class RewardModelScorer:
    """AutoModelForSequenceClassification with num_labels=1; scores prompt+response by its logit.

    The text scored is `prompt + response`, tokenized by the reward model's own tokenizer with
    its default special tokens. Batches are right-padded so every real token keeps the
    position it has unpadded; the model reads the logit at the last non-pad token.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ) -> None:
        # Imported here: transformers takes seconds to import and rule rewards do not need it.
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        if config.num_labels != 1:
            raise ValueError(f"reward model {model_path} has num_labels={config.num_labels}; expected 1")

        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(f"reward model tokenizer at {model_path} has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"

        # Read straight onto the device in ``dtype``: never a full-precision copy on the host
        # (six rollout ranks share one), nor one on the device before the cast.
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, config=config, dtype=dtype, device_map={"": torch.device(device)}, local_files_only=True
        )
        # The model finds each sequence's last real token by comparing ids with this pad id;
        # unset, it refuses batches, and a different id would read a logit off padding.
        # Newer transformers read it from the text config (a separate object in multimodal models).
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id

        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)  # frozen: scoring never builds a graph
        self.device = torch.device(device)
        self.batch_size = batch_size

    @classmethod
    def for_rollout(cls, model_path: str, rollout_dtype: str, device: torch.device | str,
                    batch_size: int = 16) -> "RewardModelScorer":
        """The reward model of a rollout rank: on its device, in the rollout's compute dtype."""
        return cls(model_path, device=device, dtype=reward_model_dtype(rollout_dtype), batch_size=batch_size)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> Scored:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [prompt + response for prompt, response in zip(prompts, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start : start + self.batch_size], padding=True, return_tensors="pt")
            logits = self.model(
                input_ids=batch["input_ids"].to(self.device),
                attention_mask=batch["attention_mask"].to(self.device),
            ).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return Scored(scores=scores, correct=None, num_malformed=0)
