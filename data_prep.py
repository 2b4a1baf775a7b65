"""Datasets to chat-templated prompts, length statistics and buckets, reward checks, demo assets.

What this file owns
- `load_prompts`: a JSONL / JSON / Parquet file of rows -> system + user prompts rendered with
  the policy's chat template and tokenized (article 3.3: the response is left empty, the policy
  writes it during training).
- `python data_prep.py stats`: prompt-length percentiles, a proposed bucket size and the
  padding it costs (article 3.3: "measure the lengths first, then cut into buckets"); the
  bucket arithmetic itself is in buckets.py, shared with the rollout.
- `python data_prep.py reward-check`: the reward distribution over a dataset before training
  (article 5.4: a reward with almost no spread gives the policy nothing to learn from).
- `python data_prep.py demo`: the offline demo assets (tiny Qwen3-MoE, tokenizer, task data); the
  model, its tokenizer and its warm start are demo_model.py.

Dataset rows
Each row is an object whose `prompt_key` field is either a string (the user message) or a
list of chat messages ``[{"role": ..., "content": ...}, ...]`` ending with a user message, and
whose optional `answer_key` field is the reference answer (a string; numbers are converted).
Both keys may be dotted paths into nested objects (`reward_model.ground_truth`); with the default
`answer_key` ("answer"), a row without an `answer` takes verl's `reward_model.ground_truth`, so
files in verl's layout (`data_source`, `prompt` as chat messages, `ability`, `reward_model`,
`extra_info`) train as they are. A row's `data_source` and `extra_info` travel with its prompt to
the reward function (rewards.py: verl-style functions receive them).
A missing and a null field are the same thing. Errors name the place in the file:
- JSONL: ``FILE:LINE: ...`` with the 1-based line number (blank lines count as lines);
- JSON and Parquet: ``FILE: row N: ...`` with the 1-based row number.
`PromptSet.source_rows` holds those same numbers. JSON and JSONL are parsed with the `json`
module, not with `datasets`: the `datasets` JSON loader reports no line numbers and coerces
mixed-type columns (an answer "2" next to a numeric answer came back as the number 2).
Parquet, which is typed, is read with `datasets`.

Demo task
Prompts ``a+b=`` with single-digit operands (100 problems), answer the sum. RL did not
generalise to held-out operand pairs at this model size (docs/platform.md), so the demo does not
pretend to measure generalisation: val.jsonl is all 100 problems and train.jsonl is the same
100 problems, shuffled. Validation accuracy therefore measures how well the policy has learnt
the task's own problems. RL from a random init never learns this task (the policy collapses
onto one constant answer), so the build ends with a short supervised warm start that is
stopped as soon as greedy answers depend on the operands and a few are right; see
`build_demo_assets` and demo_model.warm_start.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from buckets import (MAX_BUCKET_PADDING, batch_max_widths, bucket_bound, bucketed_batches, padding_fraction,
                     propose_bucket_size)
from config import DATASET_SUFFIXES, Config, UserError
from demo_model import WARM_START_MAX_STEPS, build_demo_model, build_demo_tokenizer, one_intra_op_thread, warm_start


DEFAULT_ANSWER_KEY = "answer"
VERL_ANSWER_KEY = "reward_model.ground_truth"  # where verl's preprocessing scripts put the answer


@dataclass(frozen=True)
class RowInfo:
    """What a row says beside its prompt and answer that a verl-style reward function takes."""

    data_source: Optional[str] = None
    extra_info: Optional[dict[str, Any]] = None


class DataError(ValueError):
    """Bad user input (file, row, field, model folder); the message is one line naming it."""


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# ---------------------------------------------------------------------------------------------
# Reading rows

OVERLONG_MODES = ("drop", "truncate_left")


@dataclass
class PromptRows:
    """Validated rows of a dataset file, before rendering."""

    messages: list[list[dict[str, str]]] = field(default_factory=list)
    answers: list[Optional[str]] = field(default_factory=list)
    infos: list[RowInfo] = field(default_factory=list)
    source_rows: list[int] = field(default_factory=list)  # JSONL: line number; else 1-based row
    locations: list[str] = field(default_factory=list)  # "FILE:LINE" / "FILE: row N", for messages
    num_bad_rows: int = 0


@dataclass
class PromptSet:
    """Prompts ready for generation, index-aligned."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str]  # rendered by the chat template (after truncation, if any)
    answers: list[Optional[str]]
    source_rows: list[int]  # JSONL: 1-based line number; JSON / Parquet: 1-based row number
    infos: list[RowInfo] = field(default_factory=list)
    num_bad_rows: int = 0
    num_overlong_dropped: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _invalid_json(where: str, exc: json.JSONDecodeError) -> DataError:
    return DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")


def _jsonl_records(path: Path, text: str) -> Iterator[tuple[int, str, Any]]:
    # Split on "\n" only: str.splitlines also splits at U+2028, which JSON strings may hold raw.
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            yield line_number, where, json.loads(line)
        except json.JSONDecodeError as exc:
            yield line_number, where, _invalid_json(where, exc)


def _json_records(path: Path, text: str) -> Iterator[tuple[int, str, Any]]:
    """A list of row objects, an object holding such a list under "data", or JSON Lines."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        # "Extra data": a first document parsed and more follow, i.e. JSON Lines (Dataset.to_json
        # writes those into .json files); anything else is a broken single document.
        if exc.msg != "Extra data" or text.lstrip().startswith("["):
            raise _invalid_json(f"{path}:{exc.lineno}", exc) from None
        document = None
    if isinstance(document, list):
        rows = document
    elif isinstance(document, dict) and isinstance(document.get("data"), list):
        rows = document["data"]
    else:
        yield from _jsonl_records(path, text)
        return
    for row_number, row in enumerate(rows, start=1):
        yield row_number, f"{path}: row {row_number}", row


def _parquet_records(path: Path) -> Iterator[tuple[int, str, Any]]:
    import datasets

    if "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:  # the user's own choice wins
        datasets.disable_progress_bars()  # its "Generating train split" bars would clutter the training log
    try:
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as exc:  # arrow raises its own types for damaged files
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(exc)})") from None
    for row_number, row in enumerate(table, start=1):
        yield row_number, f"{path}: row {row_number}", row


def _records(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(source row number, location for messages, row object or a DataError for that row)."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix not in DATASET_SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'!r} (expected .jsonl, .json or .parquet)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return _jsonl_records(path, text) if suffix == ".jsonl" else _json_records(path, text)


def _field(row: dict[str, Any], key: str) -> Any:
    """row[key]; a dotted key that is not a field of its own walks into nested objects."""
    if key in row or "." not in key:
        return row.get(key)
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _row_messages(row: Any, prompt_key: str, system_prompt: Optional[str]) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise DataError(f"expected an object with a {prompt_key!r} field, got {type(row).__name__}")
    prompt = _field(row, prompt_key)
    if prompt is None:
        raise DataError(f"missing field {prompt_key!r}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{prompt_key!r} is empty")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{prompt_key!r}: each chat message must be an object with string 'role' and 'content'")
        if prompt[-1]["role"] != "user":
            raise DataError(f"{prompt_key!r}: the last chat message must have role 'user', got {prompt[-1]['role']!r}")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise DataError(f"{prompt_key!r} must be a string or a list of chat messages, got {type(prompt).__name__}")
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _row_answer(row: dict[str, Any], answer_key: str) -> Optional[str]:
    answer = _field(row, answer_key)
    if answer is None and answer_key == DEFAULT_ANSWER_KEY:
        answer, answer_key = _field(row, VERL_ANSWER_KEY), VERL_ANSWER_KEY
    if answer is None or isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    raise DataError(f"{answer_key!r} must be a string or a number, got {type(answer).__name__}")


def _row_info(row: dict[str, Any]) -> RowInfo:
    source, extra = row.get("data_source"), row.get("extra_info")
    if source is not None and not isinstance(source, str):
        raise DataError(f"'data_source' must be a string, got {type(source).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"'extra_info' must be an object, got {type(extra).__name__}")
    return RowInfo(source, extra)


def read_rows(path: str | os.PathLike, *, prompt_key: str = "prompt", answer_key: str = DEFAULT_ANSWER_KEY,
              system_prompt: Optional[str] = None, skip_bad_rows: bool = False) -> PromptRows:
    """Read and validate every row: chat messages (system prompt added) and reference answers.

    Raises DataError at the first bad row, or skips and counts bad rows with skip_bad_rows.
    """
    path = Path(path)
    rows = PromptRows()
    for source_row, where, record in _records(path):
        try:
            if isinstance(record, DataError):
                raise record
            messages = _row_messages(record, prompt_key, system_prompt)
            answer = _row_answer(record, answer_key)
            info = _row_info(record)
        except DataError as exc:
            if not skip_bad_rows:
                message = str(exc)
                raise DataError(message if message.startswith(where) else f"{where}: {message}") from None
            rows.num_bad_rows += 1
            continue
        rows.messages.append(messages)
        rows.answers.append(answer)
        rows.infos.append(info)
        rows.source_rows.append(source_row)
        rows.locations.append(where)
    if not rows.messages and not rows.num_bad_rows:
        raise DataError(f"{path}: holds no rows")
    return rows


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing


def render_prompts(rows: PromptRows, tokenizer, *, max_prompt_length: Optional[int] = None,
                   overlong_prompts: str = "drop", skip_bad_rows: bool = False) -> PromptSet:
    """Apply the chat template (system + user, generation prompt added) and tokenize.

    The rendered text already holds the template's special tokens, so it is tokenized without
    adding any again. Prompts over max_prompt_length are dropped ("drop") or keep their last
    max_prompt_length tokens ("truncate_left"); either way they are counted.
    """
    if overlong_prompts not in OVERLONG_MODES:
        raise ValueError(f"overlong_prompts must be one of {OVERLONG_MODES}, got {overlong_prompts!r}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")

    kept: list[int] = []
    texts: list[str] = []
    num_bad_rows = rows.num_bad_rows
    for index, messages in enumerate(rows.messages):
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise jinja errors of their own for unsupported turns
            if not skip_bad_rows:
                raise DataError(f"{rows.locations[index]}: chat template failed ({_one_line(exc)})") from None
            num_bad_rows += 1
            continue
        kept.append(index)
        texts.append(text)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    prompts = PromptSet(prompt_ids=[], prompt_texts=[], answers=[], source_rows=[], num_bad_rows=num_bad_rows)
    for index, text, prompt_ids in zip(kept, texts, ids):
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            if overlong_prompts == "drop":
                prompts.num_overlong_dropped += 1
                continue
            prompt_ids = prompt_ids[-max_prompt_length:]
            text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
            prompts.num_truncated += 1
        prompts.prompt_ids.append(list(prompt_ids))
        prompts.prompt_texts.append(text)
        prompts.answers.append(rows.answers[index])
        prompts.infos.append(rows.infos[index])
        prompts.source_rows.append(rows.source_rows[index])
    return prompts


def load_prompts(path: str | os.PathLike, tokenizer, *, prompt_key: str = "prompt", answer_key: str = DEFAULT_ANSWER_KEY,
                 system_prompt: Optional[str] = None, max_prompt_length: Optional[int] = None,
                 overlong_prompts: str = "drop", skip_bad_rows: bool = False) -> PromptSet:
    """Read a JSONL / JSON / Parquet dataset and return chat-templated, tokenized prompts.

    Raises DataError (one line naming the file and the line or row) on a bad row unless
    skip_bad_rows, which skips and counts it instead.
    """
    rows = read_rows(path, prompt_key=prompt_key, answer_key=answer_key, system_prompt=system_prompt,
                     skip_bad_rows=skip_bad_rows)
    return render_prompts(rows, tokenizer, max_prompt_length=max_prompt_length,
                          overlong_prompts=overlong_prompts, skip_bad_rows=skip_bad_rows)


def load_run_inputs(cfg: Config, warn: Callable[[str], None]) -> tuple[Any, PromptSet, Optional[PromptSet]]:
    """A training run's tokenizer, training prompts and validation prompts (None without a
    val_dataset); bad input raises UserError with one line, before any model is loaded."""
    from transformers import AutoTokenizer

    model_path = Path(cfg.model.model_path)
    if not (model_path / "config.json").is_file():
        raise UserError(f"model_path {model_path}: no config.json (expected a Hugging Face model folder)")
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = cfg.data
    options = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, system_prompt=data.system_prompt,
                   max_prompt_length=data.max_prompt_length, overlong_prompts=data.overlong_prompts,
                   skip_bad_rows=data.skip_bad_rows)
    try:
        train_set = load_prompts(data.dataset, tokenizer, **options)
        val_set = load_prompts(data.val_dataset, tokenizer, **options) if data.val_dataset else None
    except DataError as e:
        raise UserError(str(e)) from None
    for name, prompts in (("dataset", train_set), ("val_dataset", val_set)):
        if prompts is not None and (prompts.num_bad_rows or prompts.num_overlong_dropped or prompts.num_truncated):
            warn(f"{name}: skipped {prompts.num_bad_rows} bad rows, dropped {prompts.num_overlong_dropped} "
                 f"and left-truncated {prompts.num_truncated} prompts longer than max_prompt_length")
    if not train_set.prompt_ids:
        raise UserError(f"dataset {data.dataset}: no usable prompts")
    return tokenizer, train_set, val_set


def check_reward_on_data(cfg: Config) -> None:
    """Refuse (UserError) before any model loads a reward rule that fails on the first training
    row, or that compares with reference answers where a row (training or validation) has none."""
    from rewards import probe_rule, resolve_rule

    if cfg.model.reward_model:
        return
    rule = resolve_rule(cfg.model.reward_fn)
    data = cfg.data
    try:
        files = [read_rows(path, prompt_key=data.prompt_key, answer_key=data.answer_key,
                           skip_bad_rows=data.skip_bad_rows) for path in (data.dataset, data.val_dataset) if path]
    except DataError as exc:
        raise UserError(str(exc)) from None
    for rows in files:
        missing = next((i for i, answer in enumerate(rows.answers) if answer is None), None)
        if rule.needs_answer and missing is not None:
            fallback = f" (nor at {VERL_ANSWER_KEY})" if data.answer_key == DEFAULT_ANSWER_KEY else ""
            raise UserError(f"{rows.locations[missing]}: no reference answer at answer_key {data.answer_key!r}"
                            f"{fallback}, which reward_fn {rule.name} needs (set answer_key to the field that holds it)")
    rows = files[0]
    if rows.answers:
        probe_rule(rule, rows.answers[0], rows.infos[0], rows.locations[0])


# ---------------------------------------------------------------------------------------------
# Shared CLI helpers: statistics, histograms, models


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, mean, std (population), min, p10, p50, p90, p99, max."""
    array = np.asarray(values, dtype=np.float64)
    summary = {"count": float(array.size), "mean": float(array.mean()), "std": float(array.std()),
               "min": float(array.min())}
    summary.update({f"p{q}": float(np.percentile(array, q)) for q in (10, 50, 90, 99)})
    summary["max"] = float(array.max())
    return summary


def save_histogram(values: Sequence[float], path: str | os.PathLike, *, title: str, xlabel: str,
                   marker: Optional[float] = None, marker_label: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    # The range includes the marker so a narrow distribution far below a limit stays visible.
    low = min(min(values), marker if marker is not None else math.inf)
    high = max(max(values), marker if marker is not None else -math.inf)
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(values, bins=50, range=(low, high if high > low else low + 1))
    if marker is not None:
        axes.axvline(marker, color="red", linestyle="--", label=marker_label)
        axes.legend()
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("count")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _require_model_dir(path: str, flag: str) -> None:
    if not Path(path).is_dir():
        raise DataError(f"{flag} {path}: no such folder")
    if not (Path(path) / "config.json").is_file():
        raise DataError(f"{flag} {path}: not a model folder (no config.json)")


def _load_tokenizer(path: str, flag: str):
    from transformers import AutoTokenizer

    _require_model_dir(path, flag)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ---------------------------------------------------------------------------------------------
# stats


def cmd_stats(args: argparse.Namespace) -> None:
    rows = read_rows(args.dataset, prompt_key=args.prompt_key, system_prompt=args.system_prompt,
                     skip_bad_rows=args.skip_bad_rows)
    tokenizer = _load_tokenizer(args.model_path, "--model_path")
    prompts = render_prompts(rows, tokenizer, skip_bad_rows=args.skip_bad_rows)
    lengths = [len(ids) for ids in prompts.prompt_ids]
    if not lengths:
        raise DataError(f"{args.dataset}: no valid rows")
    summary = summarize(lengths)
    print(f"prompts: {len(lengths)} (bad rows skipped: {prompts.num_bad_rows})")
    print("prompt tokens: min {min:.0f} mean {mean:.1f} p50 {p50:.1f} p90 {p90:.1f} p99 {p99:.1f} max {max:.0f}"
          .format(**summary))
    if args.max_prompt_length is not None:
        over = sum(length > args.max_prompt_length for length in lengths)
        print(f"over max_prompt_length {args.max_prompt_length}: {over} ({100 * over / len(lengths):.1f}%)")

    proposed = propose_bucket_size(lengths)
    print(f"proposed bucket_size: {proposed} (largest power of two up to the median's that pads "
          f"<= {MAX_BUCKET_PADDING:.0%} of tokens)")
    bucket_size = args.bucket_size or proposed
    # One bucket holding every prompt is plain shuffled batching.
    plain = batch_max_widths(lengths, bucketed_batches(lengths, args.batch_size, max(max(lengths), 1), seed=args.seed))
    bucketed = [bucket_bound(length, bucket_size) for length in lengths]
    print(f"padding, batches of {args.batch_size} padded to their longest prompt: "
          f"{padding_fraction(lengths, plain):.1%} ({len(set(plain))} distinct widths)")
    print(f"padding, bucket_size {bucket_size} (batches padded to the bucket bound): "
          f"{padding_fraction(lengths, bucketed):.1%} ({len(set(bucketed))} distinct widths)")
    if args.max_prompt_length is not None:
        static = [args.max_prompt_length] * len(lengths)
        print(f"padding, every prompt padded to max_prompt_length: {padding_fraction(lengths, static):.1%}")
    if args.plot:
        save_histogram(lengths, args.plot, title=f"prompt lengths: {Path(args.dataset).name}", xlabel="tokens",
                       marker=args.max_prompt_length, marker_label="max_prompt_length")
        print(f"histogram: {args.plot}")


# ---------------------------------------------------------------------------------------------
# reward-check

LOW_SPREAD_ABS = 1e-3
LOW_SPREAD_REL = 0.05


def low_spread_warning(scores: Sequence[float]) -> Optional[str]:
    """A warning when the reward barely varies: std < 1e-3, or std < 5% of |mean|.

    DAPO normalises rewards within each group of samples; a reward that is (nearly) the same
    for every response leaves advantages made of noise (article 5.4).
    """
    summary = summarize(scores)
    if summary["std"] < max(LOW_SPREAD_ABS, LOW_SPREAD_REL * abs(summary["mean"])):
        return (f"reward std {summary['std']:.3f} over {len(scores)} samples: this reward gives the policy "
                f"no signal to learn from (article 5.4)")
    return None


def _sample_policy(args: argparse.Namespace, tokenizer, prompts: PromptSet) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout import generate_responses

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype="auto", local_files_only=True).to(args.device)
    torch.manual_seed(args.seed)
    repeated = [ids for ids in prompts.prompt_ids for _ in range(args.samples_per_prompt)]
    generated = generate_responses(model, tokenizer, repeated, max_new_tokens=args.max_new_tokens, do_sample=True,
                                   temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in generated]


def cmd_reward_check(args: argparse.Namespace) -> None:
    from rewards import RewardModelScorer, resolve_rule, score_with_rule

    rule = resolve_rule(args.reward_fn) if args.reward_fn else None
    if args.reward_model:
        _require_model_dir(args.reward_model, "--reward_model")
    if args.model_path:
        _require_model_dir(args.model_path, "--model_path")
    rows = read_rows(args.dataset, prompt_key=args.prompt_key, answer_key=args.answer_key,
                     system_prompt=args.system_prompt, skip_bad_rows=args.skip_bad_rows)
    limit = args.num_samples or len(rows.messages)
    rows = PromptRows(messages=rows.messages[:limit], answers=rows.answers[:limit], infos=rows.infos[:limit],
                      source_rows=rows.source_rows[:limit], locations=rows.locations[:limit],
                      num_bad_rows=rows.num_bad_rows)
    scorer = RewardModelScorer(args.reward_model, device=args.device, batch_size=args.batch_size) \
        if args.reward_model else None

    if args.model_path:
        # The trainer renders prompts with the policy's template; sampling needs those ids anyway.
        tokenizer = _load_tokenizer(args.model_path, "--model_path")
        prompts = render_prompts(rows, tokenizer)
        responses = _sample_policy(args, tokenizer, prompts)
        source = f"{len(prompts)} prompts x {args.samples_per_prompt} samples from {args.model_path}"
    else:
        missing = [where for where, answer in zip(rows.locations, rows.answers) if answer is None]
        if missing:
            raise DataError(f"{missing[0]}: no {args.answer_key!r}; without --model_path reward-check scores the "
                            f"reference answers")
        # Without a policy, the reward model's own chat template renders the prompt text.
        if scorer and not getattr(scorer.tokenizer, "chat_template", None):
            raise DataError(f"--reward_model {args.reward_model}: its tokenizer has no chat template to render "
                            f"prompts with; pass --model_path to render them with the policy's")
        prompts = render_prompts(rows, scorer.tokenizer) if scorer else None
        responses = list(rows.answers)
        source = f"reference answers of {len(responses)} rows"
    group = args.samples_per_prompt if args.model_path else 1
    prompt_texts = [text for text in prompts.prompt_texts for _ in range(group)] if prompts else []
    answers = [answer for answer in (prompts.answers if prompts else rows.answers) for _ in range(group)]
    infos = [info for info in (prompts.infos if prompts else rows.infos) for _ in range(group)]

    scored = scorer(prompt_texts, responses) if scorer else score_with_rule(rule, responses, answers, infos)
    print(f"reward: {args.reward_model or args.reward_fn} on {source}")
    report_reward_check(args, scored, group, rows.locations if rule is not None and not args.model_path else None)


def report_reward_check(args: argparse.Namespace, scored, group: int, reference_locations: Optional[list[str]]) -> None:
    """Print the spread of the scores; ``reference_locations`` when the rule judged reference
    answers, which should all be correct (their spread says nothing about learning)."""
    summary = summarize(scored.scores)
    print("reward: count {count:.0f} mean {mean:.4f} std {std:.4f} min {min:.4f} p10 {p10:.4f} p50 {p50:.4f} "
          "p90 {p90:.4f} max {max:.4f}".format(**summary))
    if scored.correct is not None:
        num_correct = sum(scored.correct)
        print(f"correct: {num_correct} of {len(scored.correct)} ({num_correct / len(scored.correct):.1%}); "
              f"malformed: {scored.num_malformed}")
    if group > 1:
        flat = sum(len(set(scored.scores[g:g + group])) == 1 for g in range(0, len(scored.scores), group))
        print(f"groups with one reward for all {group} samples (no learning signal): {flat} of "
              f"{len(scored.scores) // group}")
    if args.plot:
        save_histogram(scored.scores, args.plot, title=f"reward: {Path(args.dataset).name}", xlabel="reward")
        print(f"histogram: {args.plot}")

    if reference_locations is not None:
        rejected = [where for where, ok in zip(reference_locations, scored.correct) if not ok]
        if rejected:
            print(f"warning: the rule rejects {len(rejected)} of {len(rejected) + sum(scored.correct)} reference "
                  f"answers (first: {rejected[0]}): check --answer_key and the rule", file=sys.stderr)
    else:
        warning = low_spread_warning(scored.scores)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Demo assets: the task's files here; the tiny model and its warm start in demo_model.py


def demo_problems() -> list[dict[str, str]]:
    """All 100 problems a+b= with operands 0-9, in order."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _install(staging: Path, out_dir: Path, names: Sequence[str]) -> None:
    """Move finished files and folders into out_dir, replacing old ones; a folder is either the
    old complete one, absent for a moment, or the new complete one, never half-written."""
    for name in names:
        target, built = out_dir / name, staging / name
        if target.is_dir():
            target.rename(staging / f"{name}.old")
        os.replace(built, target)


def build_demo_assets(out_dir: str | os.PathLike, seed: int = 0) -> dict[str, Any]:
    """Write OUT/model (tiny Qwen3-MoE + tokenizer), OUT/train.jsonl, OUT/val.jsonl and
    OUT/demo_info.json; returns the info. Deterministic from the seed: the model is built and
    warm-started on one intra-op thread, so two builds on the same machine give bit-identical
    weights whatever OMP_NUM_THREADS says. The caller's RNG state and thread count are untouched.
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    problems = demo_problems()
    train_rows = list(problems)
    random.Random(seed).shuffle(train_rows)

    with tempfile.TemporaryDirectory(prefix=".demo-build-", dir=out_dir) as staging_name:
        staging = Path(staging_name)
        _write_jsonl(staging / "train.jsonl", train_rows)
        _write_jsonl(staging / "val.jsonl", problems)
        tokenizer = build_demo_tokenizer()
        with torch.random.fork_rng(devices=[]), one_intra_op_thread():
            torch.manual_seed(seed)
            model = build_demo_model(tokenizer)
            info = warm_start(model, tokenizer, load_prompts(staging / "val.jsonl", tokenizer), seed=seed)
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        info = {"seed": seed, **info, "num_parameters": sum(p.numel() for p in model.parameters()),
                "vocab_size": len(tokenizer), "num_train_problems": len(train_rows), "num_val_problems": len(problems),
                "build_seconds": round(time.perf_counter() - started, 1)}
        # demo_info.json goes last: its presence says the rest is in place.
        (staging / "demo_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        _install(staging, out_dir, ["model", "train.jsonl", "val.jsonl", "demo_info.json"])
    return info


def cmd_demo(args: argparse.Namespace) -> None:
    info = build_demo_assets(args.out, seed=args.seed)
    print(f"demo assets in {args.out}: tiny Qwen3-MoE with {info['num_parameters']:,} parameters, "
          f"vocab {info['vocab_size']}")
    print(f"warm start: {info['warm_start_steps']} steps; greedy accuracy {info['greedy_accuracy']:.2f} on the "
          f"{info['num_val_problems']} problems, {info['distinct_answers']} distinct answers "
          f"({info['build_seconds']} s)")
    if not info["warm_start_target_met"]:
        print(f"warning: warm start stopped at {WARM_START_MAX_STEPS} steps without reaching its target",
              file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data_prep.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def dataset_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--dataset", required=True, help=".jsonl, .json or .parquet file")
        sub.add_argument("--prompt_key", default="prompt")
        sub.add_argument("--system_prompt", default=None, help="added as a system message to rows without one")
        sub.add_argument("--skip_bad_rows", action="store_true", help="skip and count bad rows instead of failing")
        sub.add_argument("--seed", type=int, default=0)

    stats = commands.add_parser("stats", help="prompt-length statistics and a bucket size proposal")
    dataset_options(stats)
    stats.add_argument("--model_path", required=True, help="model folder whose tokenizer renders the prompts")
    stats.add_argument("--max_prompt_length", type=_positive_int, default=None)
    stats.add_argument("--bucket_size", type=_positive_int, default=None, help="evaluate this instead of the proposal")
    stats.add_argument("--batch_size", type=_positive_int, default=32, help="generation batch size for padding figures")
    stats.add_argument("--plot", default=None, help="save a histogram of prompt lengths to this PNG")
    stats.set_defaults(run=cmd_stats)

    check = commands.add_parser("reward-check", help="reward distribution over a dataset before training")
    dataset_options(check)
    reward = check.add_mutually_exclusive_group(required=True)
    reward.add_argument("--reward_fn", help="built-in rule name or module:function")
    reward.add_argument("--reward_model", help="sequence-classification reward model folder")
    check.add_argument("--model_path", default=None, help="policy to sample responses from (else: reference answers)")
    check.add_argument("--answer_key", default="answer")
    check.add_argument("--num_samples", type=_positive_int, default=None, help="score only the first K rows")
    check.add_argument("--samples_per_prompt", type=_positive_int, default=1, help="with --model_path")
    check.add_argument("--max_new_tokens", type=_positive_int, default=256)
    check.add_argument("--temperature", type=float, default=1.0)
    check.add_argument("--top_p", type=float, default=1.0)
    check.add_argument("--batch_size", type=_positive_int, default=16)
    check.add_argument("--device", default="cpu")
    check.add_argument("--plot", default=None, help="save a histogram of rewards to this PNG")
    check.set_defaults(run=cmd_reward_check)

    demo = commands.add_parser("demo", help="build the offline demo assets")
    demo.add_argument("--out", required=True, help="output folder")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (DataError, ValueError, FileNotFoundError, OSError) as exc:
        print(f"data_prep.py {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
