"""Run configuration: dataclasses, YAML, command-line overrides.

Precedence is defaults < YAML (``--config``) < command line. Every key has one flat name, unique
across sections, so ``--kl_coef 0.01`` and a YAML ``kl_coef: 0.01`` (at the top level or under any
section heading) mean the same thing. The user's settings are never mutated after loading; values
derived from them live in :class:`Derived`.

Each key is declared once, as a field of its section's dataclass made by :func:`key`: its type
(the annotation), default, line of ``--help``, the check of its value alone and whether a resume
may change it without a warning. ``--help`` (:data:`KEY_HELP`), :func:`validate` and the resume's
warning (:data:`RESUMABLE_KEYS`) read them from there.

Bad input raises :class:`ConfigError` with one line that names the key; ``train_dapo.py`` prints
it and exits with status 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, TextIO

import yaml


class UserError(ValueError):
    """Bad input that ends the run with one line on stderr and exit status 2."""


class ConfigError(UserError):
    """A user mistake in the configuration; the message is one line naming the key."""


# ----- each key declared once: type (the annotation), default, help, check, resumable ----------

# A check sees one key's value (null, where a key allows it, always passes: it means a default the
# run works out) and returns None when the value will do, else what is wrong with it, which the
# error message puts after the key's name. Checks that weigh one key against another stay in
# validate.
Check = Callable[[Any], Optional[str]]


def key(default: Any, help: str, *, resumable: bool, check: Optional[Check] = None) -> Any:
    """A config key's field. ``help``: its line of --help. ``resumable``: a resume may change it
    without a warning, because it cannot change what the run computes (samples, rewards, losses,
    weights and the metrics measured from them): only where and how often the run writes and
    reports, how it plans memory, how long it waits. ``check``: the test of a value on its own.
    A list default is copied for each instance (a dataclass refuses a shared mutable one)."""
    metadata = {"help": help, "resumable": resumable, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def at_least(low: int, note: str = "") -> Check:
    return lambda value: None if value >= low else f"must be >= {low}{note}"


def above(low: int, note: str = "") -> Check:
    return lambda value: None if value > low else f"must be > {low}{note}"


def _probability(value: float) -> Optional[str]:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def _clip_epsilon(value: float) -> Optional[str]:
    if value < 0:
        return "must be >= 0"
    return None if value < 1 else "must be < 1: it is an epsilon, the ratio floor is 1 - clip_ratio_low"


# What report_to takes: csv (metrics.csv, always written: checkpoints keep it), console (verl's
# name for the console line, always printed), tensorboard and wandb (optional extras), none
# (neither extra).
REPORTERS = ("csv", "console", "tensorboard", "wandb", "none")


def _reporters(value: list[str]) -> Optional[str]:
    if not set(value) <= set(REPORTERS):
        return f"takes {', '.join(REPORTERS)}, got {value}"
    if "none" in value and len(set(value)) != 1:
        return f"none means no reporter but the console and metrics.csv: give it alone, got {value}"
    return None


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = key("runs/demo_assets/model", "Hugging Face model folder (config.json, tokenizer, safetensors "
                          "weights); never downloaded", resumable=False)  # the KL's reference model loads from it
    reward_model: Optional[str] = key(None, "sequence-classification reward model folder; when set it scores "
                                      "responses instead of reward_fn", resumable=False)
    reward_fn: str = key("math_answer", "rule reward: math_answer, math_verify (the math extra), demo_arithmetic, "
                         "or module:function", resumable=False)
    rollout_dtype: Literal["fp32", "bf16", "fp8"] = key(
        "bf16", "dtype of the rollout copy of the weights (fp8: README \"FP8 rollout\")", resumable=False)
    rollout_engine: Literal["builtin", "vllm"] = key(
        "builtin", "what generates: the built-in decode loop, or one vLLM engine per rollout rank (README \"vLLM "
        "rollout\")", resumable=False)
    rollout_tensor_parallel: int = key(
        1, "vLLM: one engine per this many consecutive rollout ranks, tensor parallel over their devices; the "
        "others hold no model (must divide the rollout ranks)", resumable=False,
        check=at_least(1, " (devices per rollout engine)"))
    learner_dtype: Literal["fp32", "bf16"] = key(
        "bf16", "learner compute dtype (bf16: FSDP2 mixed precision over fp32 master weights)", resumable=False)
    # Recomputed activations may take other kernels than the forward's: not resumable.
    gradient_checkpointing: bool = key(False, "recompute activations in the backward pass", resumable=False)
    learner_offload: bool = key(False, "keep the learners' parameters, gradients and AdamW state in host memory "
                                "(needs torchrun)", resumable=False)  # AdamW then steps on the CPU
    # verl's name: the learner's forwards run on each micro-batch's real tokens packed into one row
    use_remove_padding: bool = key(
        True, "the learner's forwards (old log-probs, reference, update) compute each micro-batch's real tokens "
        "packed into one row, attention kept inside each sequence; false: rows padded to the micro-batch's "
        "longest", resumable=False)
    eos_token_ids: list[int] = key([], "stop token ids besides the tokenizer's EOS, e.g. [151645, 151643] for "
                                   "Qwen3", resumable=False)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = key("runs/demo_assets/train.jsonl", "training prompts: JSONL, JSON or Parquet", resumable=False)
    val_dataset: Optional[str] = key(None, "validation prompts, same formats; null = no validation", resumable=False)
    prompt_key: str = key("prompt", "row field holding the prompt (a string or a list of chat messages)",
                          resumable=False)
    answer_key: str = key("answer", "row field holding the reference answer the reward reads", resumable=False)
    system_prompt: Optional[str] = key(None, "system message put before every prompt that has none; null = none",
                                       resumable=False)
    max_prompt_length: int = key(2048, "longest prompt in tokens; longer ones are handled as overlong_prompts says",
                                 resumable=False, check=at_least(1))
    overlong_prompts: Literal["drop", "truncate_left"] = key(
        "drop", "what happens to a prompt over max_prompt_length: dropped (counted) or cut on the left",
        resumable=False)
    skip_bad_rows: bool = key(False, "skip and count malformed rows instead of stopping", resumable=False)
    bucket_size: int = key(1024, "generation batches pad to their length bucket's bound, so shapes repeat",
                           resumable=False, check=at_least(1))


@dataclass(frozen=True)
class RolloutConfig:
    max_response_length: int = key(2048, "longest response in tokens", resumable=False, check=at_least(1))
    temperature: float = key(1.0, "sampling temperature for training responses", resumable=False,
                             check=above(0, " (use val_temperature 0 for greedy validation)"))
    top_p: float = key(1.0, "nucleus sampling for training responses", resumable=False, check=_probability)
    sample_num: int = key(8, "responses per prompt (the group)", resumable=False, check=at_least(1))
    prompts_per_step: int = key(32, "informative groups trained on per step", resumable=False, check=at_least(1))
    dynamic_sampling: bool = key(True, "DAPO dynamic sampling: keep only groups whose metric varies, generate more "
                                 "until full", resumable=False)
    # auto: acc where the reward has a notion of correct (a rule), else reward (a reward model),
    # as DAPO filters; with overlong shaping, reward would keep all-wrong groups that differ in length.
    dynamic_sampling_metric: Literal["auto", "reward", "acc"] = key(
        "auto", "what must vary in a group: acc (right/wrong) or reward; auto = acc with a rule reward",
        resumable=False)
    max_gen_batches: int = key(10, "stop with an error after this many generation batches in one step (0 = no "
                               "limit)", resumable=False, check=at_least(0, " (0 = no limit)"))
    # Validation's settings change the validation metrics and the overfit alarm: not resumable.
    val_temperature: float = key(0.0, "validation temperature (0 = greedy)", resumable=False,
                                 check=at_least(0, " (0 = greedy)"))
    val_top_p: float = key(1.0, "validation nucleus when val_temperature > 0", resumable=False, check=_probability)
    val_max_prompts: int = key(0, "validation prompts used (0 = the whole set)", resumable=False)
    # The host's checks decide when finished rows leave the batch, and a batch of other rows may
    # take other kernels on a device: not resumable.
    rollout_stop_check_every: int = key(
        8, "built-in engine: decode steps between the host's checks that every row has stopped", resumable=False,
        check=at_least(1, " (decode steps per host check)"))
    rollout_compile: Optional[bool] = key(None, "built-in engine: torch.compile the decode step (null: on on CUDA, "
                                          "in CUDA graphs for bf16 and fp8 rollouts; off on CPU and NPU)",
                                          resumable=False)
    rollout_enforce_eager: Optional[bool] = key(
        None, "vLLM: run eagerly, no graphs (null: CUDA graphs on CUDA for 1 up to an engine's sequences a call; "
        "eager on CPU, where vLLM would compile instead, and on NPU)", resumable=False)


@dataclass(frozen=True)
class AlgoConfig:
    clip_ratio_low: float = key(0.2, "clip epsilon below: the ratio floor is 1 - clip_ratio_low", resumable=False,
                                check=_clip_epsilon)
    clip_ratio_high: float = key(0.28, "clip epsilon above (DAPO clip-higher): the ratio ceiling is 1 + "
                                 "clip_ratio_high", resumable=False, check=at_least(0))
    clip_ratio_c: float = key(10.0, "dual-clip bound for negative advantages (> 1)", resumable=False,
                              check=above(1, " (dual clip)"))
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = key(
        "token-mean", "how token losses are averaged into the step's loss", resumable=False)
    norm_adv_by_std: bool = key(True, "divide group advantages by the group's spread (false: Dr.GRPO)",
                                resumable=False)
    kl_coef: float = key(0.0, "weight of the KL to the reference model (0 = no reference model is loaded)",
                         resumable=False)
    kl_coef_init: Optional[float] = key(None, "KL weight for the first kl_warmup_steps steps; null = kl_coef "
                                        "throughout", resumable=False)
    kl_warmup_steps: int = key(0, "training steps that use kl_coef_init", resumable=False)
    kl_type: Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"] = key("low_var_kl", "KL estimator",
                                                                               resumable=False)
    length_penalty_coef: float = key(0.0, "weight of the length penalty (docs/algorithm.md section 5)",
                                     resumable=False)
    overlong_buffer_len: int = key(0, "DAPO soft overlong punishment: tokens before max_response_length where it "
                                   "starts (0 = off)", resumable=False)
    overlong_penalty_factor: float = key(1.0, "DAPO soft overlong punishment at max_response_length",
                                         resumable=False)
    entropy_coeff: float = key(0.0, "entropy bonus (entropy is always logged)", resumable=False)
    tis_cap: float = key(0.0, "old name: tis_cap C is rollout_is token with rollout_is_threshold C (0 = off)",
                         resumable=False)
    # Rollout correction as verl names it (rollout_correction.py): importance weights and rejection.
    rollout_is: Optional[Literal["token", "sequence"]] = key(
        None, "importance weights for the rollout/learner mismatch, per token or per sequence [token | sequence] "
        "(null = off)", resumable=False)
    rollout_is_threshold: str = key(
        "2.0", "C: weights truncated at C (TIS; 2.0 with FP8 rollout); 'L_U': weight 0 outside [L, U] (IcePop; "
        "quote it in YAML)", resumable=False)
    rollout_is_batch_normalize: bool = key(
        False, "divide the importance weights by their mean over the step's tokens (or sequences)", resumable=False)
    rollout_rs: Optional[str] = key(
        None, "rejection: comma-separated token_k1/2/3, seq_sum_k1/2/3, seq_mean_k1/2/3, seq_max_k2/3; a token must "
        "pass all (null = off)", resumable=False)
    rollout_rs_threshold: Optional[str] = key(
        None, "per rollout_rs mode, comma-separated (or one for all): k1 a ratio band 'L_U' (U alone: 1/U_U), k2/k3 "
        "an upper bound", resumable=False)
    # Routing replay (R3; verl: router_replay.mode R3, Megatron: moe_enable_routing_replay): the
    # learner routes each token to the experts rollout chose (routing.py).
    routing_replay: bool = key(
        False, "MoE: the engine records each token's top-k experts per layer and the learner's forwards route to "
        "them, gate weights from its own router (R3; README \"Routing replay\")", resumable=False)

    def importance_sampling(self) -> tuple[Optional[str], str]:
        """(rollout_is, rollout_is_threshold), tis_cap read as what it always meant: token-level
        truncation at tis_cap."""
        if self.tis_cap > 0:
            return "token", str(self.tis_cap)
        return self.rollout_is, self.rollout_is_threshold


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = key(1e-6, "AdamW learning rate (large MoE models: ~1e-6)", resumable=False,
                               check=above(0))
    lr_warmup_steps: int = key(0, "linear warmup over this many training steps (as verl counts them)",
                               resumable=False)  # training steps, not optimizer steps
    weight_decay: float = key(0.1, "AdamW weight decay", resumable=False)
    grad_clip: float = key(1.0, "gradient norm clip", resumable=False)
    # Batch shapes are not resumable either: a forward over other rows may take other kernels.
    per_device_batch_size: int = key(4, "sequences per micro-batch on a learner rank", resumable=False,
                                     check=at_least(1))
    gradient_accumulation_steps: int = key(8, "micro-batches per optimizer step", resumable=False, check=at_least(1))
    ppo_epochs: int = key(1, "passes over a step's samples", resumable=False, check=at_least(1))
    # Sequences per forward of the no-grad log-probs (old log-probs, the KL reference), as verl's
    # log_prob_micro_batch_size: without a graph to keep they can take more rows than training.
    log_prob_batch_size: Optional[int] = key(
        None, "sequences per no-grad forward of the old and reference log-probs on a learner rank (null = "
        "per_device_batch_size)", resumable=False, check=at_least(1, " (null = per_device_batch_size)"))
    # verl's names: micro-batches filled by real tokens (prompt + response) up to a budget per
    # learner rank instead of a number of rows; the mini-batches, and so the optimizer steps, stay.
    use_dynamic_bsz: bool = key(
        False, "micro-batches filled by real tokens up to ppo_max_token_len_per_gpu (the forwards of log-probs: "
        "log_prob_max_token_len_per_gpu) instead of per_device_batch_size rows; the mini-batches stay; a longer "
        "row is a micro-batch of its own", resumable=False)
    ppo_max_token_len_per_gpu: int = key(
        16384, "with use_dynamic_bsz: real tokens (prompt + response) per training micro-batch on a learner rank "
        "(--plan says which fits)", resumable=False, check=at_least(1))
    log_prob_max_token_len_per_gpu: Optional[int] = key(
        None, "with use_dynamic_bsz: real tokens per no-grad forward of the old and reference log-probs (null = "
        "ppo_max_token_len_per_gpu)", resumable=False, check=at_least(1, " (null = ppo_max_token_len_per_gpu)"))

    @property
    def log_prob_rows(self) -> int:
        """Sequences per no-grad log-prob forward on a learner rank."""
        return self.log_prob_batch_size or self.per_device_batch_size

    @property
    def update_token_budget(self) -> Optional[int]:
        """Real tokens per training micro-batch on a learner rank; None: per_device_batch_size rows."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    @property
    def log_prob_token_budget(self) -> Optional[int]:
        """Real tokens per no-grad log-prob forward on a learner rank; None: log_prob_rows rows."""
        if not self.use_dynamic_bsz:
            return None
        return self.log_prob_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu




@dataclass(frozen=True)
class RunConfig:
    """What a resume may change (resumable): the YAML's path (its keys are compared one by one),
    where the run writes, how often it saves and what it keeps (a checkpoint's bytes are the
    same either way: tests/test_checkpoint.py), what it logs and reports (the MFU's peak, the
    alarms' patience), the memory plan's inputs, the weight-sync buckets (whole tensors, copied
    exactly) and timeouts. Not: the device, the seed, the rank layout, staleness, deterministic
    kernels and when it validates (the validation metrics, the overfit alarm)."""

    config: Optional[str] = key(None, "YAML file of settings (keys at the top level or under their section)",
                                resumable=True)
    device: Literal["auto", "cpu", "cuda", "npu"] = key(
        "auto", "auto picks npu, then cuda, then cpu; a device named but absent is refused", resumable=False)
    seed: int = key(0, "random seed (each rank adds its rank)", resumable=False)
    # torch's deterministic kernels and the vendor libraries' settings for them (device.
    # use_deterministic_algorithms): two runs, and a run and its resume, compute the same on a GPU or
    # NPU, at some speed. A CPU computes the same twice either way.
    deterministic: bool = key(
        False, "deterministic kernels and collectives on GPU/NPU (torch, cuBLAS, HCCL settings), so that two runs "
        "and a resume match bit for bit; slower", resumable=False)
    output_dir: str = key("runs/dapo", "where the run writes metrics, checkpoints and the exported model",
                          resumable=True)
    overwrite_output_dir: bool = key(False, "start over in an output_dir that holds another run", resumable=True)
    # A finished run extended with a larger max_steps continues exactly (Schedule.collects_past_the_end).
    max_steps: int = key(100, "training steps", resumable=True, check=at_least(1))
    log_every: int = key(1, "console line and completions.jsonl every this many steps", resumable=True,
                         check=at_least(1))
    log_completions: int = key(2, "prompts per logged step written to completions.jsonl, with all responses (0 = "
                               "off)", resumable=True, check=at_least(0, " (0 = off)"))
    report_to: list[str] = key(["csv"], "csv (metrics.csv, always written), tensorboard, wandb (optional extras), "
                               "console, or none", resumable=True, check=_reporters)
    val_every: int = key(10, "validate every this many steps (0 = never)", resumable=False, check=at_least(0))
    save_every: int = key(1, "checkpoint every this many steps, and the last (0 = never)", resumable=True,
                          check=at_least(0, " (0 = never)"))
    keep_last: int = key(3, "complete checkpoints kept", resumable=True, check=at_least(1))
    # verl's name. True: each checkpoint's learner shards are copied to host memory and written beside
    # training; False: written from the learner's own tensors while the step waits, and no host copy.
    async_save: bool = key(
        True, "checkpoint learner shards through a host copy written beside training (12 B a parameter of each "
        "learner's shard in host memory); false: no copy, the step waits while they are written", resumable=True)
    hf_export_every: int = key(0, "Hugging Face weights in checkpoints of steps divisible by it (0 = the last step "
                               "only)", resumable=True, check=at_least(0, " (0 = the last step only)"))
    hf_export_file_mb: int = key(5120, "largest weight file of an export, MB", resumable=True,
                                 check=at_least(1))  # one larger tensor fills a file alone
    resume_from_checkpoint: Optional[str] = key(
        None, "auto (the newest usable checkpoint in output_dir) or a step folder", resumable=True)
    # The layout is in the checkpoint's fingerprint too, which refuses a resume onto another one.
    learner_ranks: int = key(2, "learner ranks of a torchrun job (the others roll out; ignored with one process)",
                             resumable=False, check=at_least(1))
    max_staleness: int = key(1, "1: rollout generates one step ahead of training; 0: synchronous", resumable=False,
                             check=lambda value: None if value in (0, 1) else "must be 0 or 1")
    dist_timeout_s: float = key(600.0, "seconds a collective may wait for a silent peer", resumable=True,
                                check=above(0))
    # The memory plan's inputs: they decide whether a run starts, not what it computes (vLLM's KV
    # cache is the plan's, in bytes, whatever the device's size).
    device_memory_gb: Optional[float] = key(
        None, "GiB per device for the memory plan; null = what the device reports", resumable=True,
        check=above(0, " (null = what the machine reports)"))
    host_memory_gb: Optional[float] = key(
        None, "GiB of host memory per node for the memory plan; null = this machine's MemTotal", resumable=True,
        check=above(0, " (null = what the machine reports)"))
    disk_gb: Optional[float] = key(
        None, "GiB free for checkpoints under output_dir for the memory plan; null = what its filesystem has free",
        resumable=True, check=above(0, " (null = what the machine reports)"))
    disk_write_gb_per_s: float = key(
        1.0, "GiB/s a node writes checkpoints at, for the memory plan's time per save of each async_save mode (1.0: "
        "a conservative share of a local NVMe or a shared filesystem)", resumable=True, check=above(0))
    weight_sync_bucket_mb: int = key(256, "size of the buckets weights are broadcast in, MB", resumable=True)
    peak_tflops: Optional[float] = key(
        None, "a learner device's dense bf16 peak TFLOPS, for the MFU columns (null: from the device's name, Ascend "
        "910B/C and NVIDIA data-center GPUs; none on a CPU)", resumable=True,
        check=above(0, " (null = by the device's name)"))
    length_alarm_steps: int = key(20, "steps of rising response length that fire alarm_length_rising",
                                  resumable=True)
    overfit_alarm_checks: int = key(3, "validations of falling val reward and rising train reward that fire "
                                    "alarm_overfit", resumable=True)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "algo": AlgoConfig,
    "optim": OptimConfig,
    "run": RunConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def flat(self) -> dict[str, Any]:
        return {name: getattr(getattr(self, section), name) for name, section in KEY_SECTION.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump({s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}, sort_keys=False)


def _section_of_each_key() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"config key {f.name!r} is defined in both {owner.get(f.name)} and {section}"
            owner[f.name] = section
    return owner


KEY_SECTION = _section_of_each_key()
_FIELD_TYPES = {
    name: typing.get_type_hints(SECTIONS[section])[name] for name, section in KEY_SECTION.items()
}
_FIELDS = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
# Read from each field's declaration (:func:`key`): --help's line a key, and the keys a resume
# may change without a warning (resuming.check_resumable).
KEY_HELP: dict[str, str] = {name: f.metadata.get("help", "") for name, f in _FIELDS.items()}
RESUMABLE_KEYS = frozenset(name for name, f in _FIELDS.items() if f.metadata.get("resumable"))


def _unknown_key(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, KEY_SECTION, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{where}{hint}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(inner[0]) + " or null"
    if origin is list:
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}[typing.get_args(tp)[0]]
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _parse_text(text: str) -> Any:
    """A command-line value read the way YAML reads a scalar: 1e-6, true, null, [1, 2]."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def coerce(key: str, value: Any, tp: Any = None) -> Any:
    """Return ``value`` as the declared type of ``key``; raise ConfigError naming key and type."""
    tp = _FIELD_TYPES[key] if tp is None else tp
    origin = typing.get_origin(tp)
    bad = ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return coerce(key, value, next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if origin is list:
        items = _parse_text(value) if isinstance(value, str) else value
        if isinstance(items, (int, float, str)) and not isinstance(items, bool):  # one item: --report_to tensorboard
            items = [items]
        if not isinstance(items, list):
            raise bad
        try:
            return [coerce(key, item, typing.get_args(tp)[0]) for item in items]
        except ConfigError:
            raise bad from None
    if isinstance(value, str) and tp is not str:
        value = _parse_text(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise bad
        return str(value)
    raise AssertionError(f"config key {key!r} has a type the loader does not handle: {tp}")


def _flatten_yaml(doc: Any, path: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        key = str(key)
        if key in SECTIONS and key not in KEY_SECTION and isinstance(value, dict):
            entries = value.items()
        else:
            entries = [(key, value)]
        for name, item in entries:
            if name not in KEY_SECTION:
                raise _unknown_key(str(name), f" in {path}")
            if name in flat:
                raise ConfigError(f"{path}: config key '{name}' is set twice")
            flat[name] = item
    return flat


def _parse_cli(argv: list[str]) -> dict[str, str]:
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument '{arg}': options look like --key value")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in KEY_SECTION:
            raise _unknown_key(name, " on the command line")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"option --{name} needs a value")
            i += 1
            value = argv[i]
        overrides[name] = value
        i += 1
    return overrides


def load_config(argv: list[str]) -> Config:
    """Build the run's Config from the command line (which may name a YAML file with --config)."""
    cli = _parse_cli(argv)
    values: dict[str, Any] = {}
    if cli.get("config"):
        path = cli["config"]
        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{where} is not valid YAML") from None
        values.update(_flatten_yaml(doc, path))
    values.update(cli)
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        sections[KEY_SECTION[name]][name] = coerce(name, value)
    cfg = Config(**{s: SECTIONS[s](**kw) for s, kw in sections.items()})
    validate(cfg)
    return cfg


def split_inspection(argv: list[str]) -> tuple[list[str], Optional[str], Optional[int], Optional[int]]:
    """(the other arguments, "plan" or "dry_run" when ``--plan [WORLD_SIZE] [--nnodes N]`` or
    ``--dry_run [WORLD_SIZE] [--nnodes N]`` asks to look before running, the world size to lay
    out: by default torchrun's WORLD_SIZE, else one node of 8 devices; the nodes it spans: by
    default torchrun's, else 1). A run, which takes its layout from torchrun, gets None for both."""
    argv, nodes = _split_nnodes(argv)
    asked = [flag for flag in ("--plan", "--dry_run") if flag in argv]
    if not asked:
        if nodes is not None:
            raise ConfigError("--nnodes goes with --plan or --dry_run: a run takes its nodes from torchrun (--nnodes)")
        return argv, None, None, None
    if len(asked) > 1:
        raise ConfigError("give --plan or --dry_run, not both (the dry run prints the plan beside what it measures)")
    at = argv.index(asked[0])
    given = argv[at + 1] if at + 1 < len(argv) and argv[at + 1].isdigit() else None
    rest = argv[:at] + argv[at + 1 + (given is not None):]
    world_size = int(given) if given else int(os.environ.get("WORLD_SIZE", "8"))
    return rest, asked[0][2:], world_size, nodes if nodes is not None else torchrun_nodes()


def _split_nnodes(argv: list[str]) -> tuple[list[str], Optional[int]]:
    """The arguments without ``--nnodes N`` (or ``--nnodes=N``), and N (None when not given)."""
    at = next((i for i, arg in enumerate(argv) if arg == "--nnodes" or arg.startswith("--nnodes=")), None)
    if at is None:
        return argv, None
    inline = argv[at].partition("=")[2] if "=" in argv[at] else None
    value = inline if inline is not None else (argv[at + 1] if at + 1 < len(argv) else "")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--nnodes expects a number of nodes >= 1, got {value!r}")
    return argv[:at] + argv[at + 1 + (inline is None):], int(value)


def torchrun_nodes() -> int:
    """The nodes of this torchrun job (WORLD_SIZE // LOCAL_WORLD_SIZE; every node runs as many
    processes), 1 outside torchrun."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    return max(1, int(world) // int(local)) if world and local else 1


def validate(cfg: Config) -> None:
    """Reject values no run can use; each message names the key and the allowed range. Each key's
    own check comes from its field (:func:`key`); those here weigh one key against another."""
    for name, value in cfg.flat().items():
        check = _FIELDS[name].metadata.get("check")
        problem = check(value) if check is not None and value is not None else None
        if problem:
            raise ConfigError(f"{name} {problem}")
    checks = [
        (cfg.model.rollout_tensor_parallel == 1 or cfg.model.rollout_engine == "vllm",
         f"rollout_tensor_parallel {cfg.model.rollout_tensor_parallel} needs rollout_engine vllm: the built-in "
         f"engine runs on its rank's device alone (rollout_tensor_parallel 1)"),
        (0 <= cfg.algo.overlong_buffer_len <= cfg.rollout.max_response_length,
         "overlong_buffer_len must be in [0, max_response_length]"),
        (not (cfg.model.reward_model and cfg.rollout.dynamic_sampling_metric == "acc"),
         "dynamic_sampling_metric acc needs a rule reward (reward_fn); a reward_model has no notion of correct"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_rollout_correction(cfg.algo)


def _check_rollout_correction(algo: AlgoConfig) -> None:
    if algo.tis_cap > 0 and algo.rollout_is is not None:
        raise ConfigError(f"tis_cap {algo.tis_cap:g} is the old name of rollout_is token with rollout_is_threshold "
                          f"{algo.tis_cap:g}: set rollout_is and rollout_is_threshold, not tis_cap too")
    import rollout_correction  # torch: every caller of load_config has it loaded already

    try:
        rollout_correction.check_settings(*algo.importance_sampling(), algo.rollout_rs, algo.rollout_rs_threshold)
    except ValueError as error:
        raise ConfigError(str(error)) from None


# How a shipped config marks a path its user must set (configs/qwen3_30b_a3b_dapo.yaml).
PLACEHOLDER_PREFIX = "/path/to/"
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")


def check_input_paths(cfg: Config, *, reads_data: bool) -> None:
    """UserError (one line naming the key and the path) unless model_path, and reward_model when
    set, name a local model folder with its config.json, dataset and val_dataset a file of a format
    the run reads, and none of them nor output_dir is a shipped config's /path/to/ placeholder.
    Checked before anything reads them: transformers takes a missing folder for a Hub repo id, and
    a folder without config.json for one of an unknown model; a missing dataset would surface only
    after the tokenizer loaded. --plan and --dry_run read no data (``reads_data`` False)."""
    models = [("model_path", cfg.model.model_path), ("reward_model", cfg.model.reward_model)]
    data = [("dataset", cfg.data.dataset), ("val_dataset", cfg.data.val_dataset)] if reads_data else []
    for key, path in [*models, *data, ("output_dir", cfg.run.output_dir)]:
        if path is not None and path.startswith(PLACEHOLDER_PREFIX):
            raise ConfigError(f"{key} {path} is the config's placeholder: set your own with --{key} (or in the config)")
    for key, path in models:
        if path is None:
            continue
        if not Path(path).is_dir():
            raise ConfigError(f"{key} {path}: no such folder (a local Hugging Face model folder; nothing is downloaded)")
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{key} {path}: no config.json in this folder (expected a Hugging Face model folder)")
    for key, path in data:
        if path:  # val_dataset "" (or null): no validation
            _check_dataset_file(key, Path(path))


def _check_dataset_file(key: str, path: Path) -> None:
    formats = ", ".join(DATASET_SUFFIXES)
    if path.is_dir():
        raise ConfigError(f"{key} {path}: a folder, not a dataset file (one {formats} file)")
    if not path.is_file():
        raise ConfigError(f"{key} {path}: no such file (one {formats} file)")
    if path.suffix.lower() not in DATASET_SUFFIXES:
        raise ConfigError(f"{key} {path}: unsupported file type {path.suffix or '(none)'!r} (expected {formats})")


# The learning-rate warning: above HIGH_LR on a model of more than LARGE_MODEL_PARAMS parameters.
HIGH_LR, LARGE_MODEL_PARAMS = 1e-5, 1e9


def model_params(model_path: str) -> Optional[int]:
    """The parameters of the model in ``model_path``, estimated from its config.json alone (no
    weights, no torch): embeddings and lm_head, and per layer the attention projections and the
    MLP or its experts and router; norms and biases, a rounding error, are left out. None when
    there is no config.json or it lacks the sizes of a decoder-only transformer."""
    try:
        doc = json.loads((Path(model_path) / "config.json").read_text())
        text = doc.get("text_config") or doc  # a multimodal config nests its language model
        hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        experts = int(text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0)
        if experts:
            expert = 3 * hidden * int(text.get("moe_intermediate_size") or text["intermediate_size"])
            shared = 3 * hidden * int(text.get("shared_expert_intermediate_size") or 0)
            mlp = experts * (expert + hidden) + shared
        else:
            mlp = 3 * hidden * int(text["intermediate_size"])
        tied = bool(text.get("tie_word_embeddings", doc.get("tie_word_embeddings", False)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None
    return vocab * hidden * (1 if tied else 2) + layers * (attention + mlp)


def warnings_for(cfg: Config) -> list[str]:
    """Legal but suspicious settings, printed at start-up."""
    notes = []
    if cfg.algo.clip_ratio_high >= 1:
        notes.append(
            f"clip_ratio_high={cfg.algo.clip_ratio_high} is an epsilon, so the ratio may reach "
            f"{1 + cfg.algo.clip_ratio_high:g}; DAPO uses 0.28 (the article's 1.1 reads like a ratio bound)"
        )
    if cfg.algo.clip_ratio_high < cfg.algo.clip_ratio_low:
        notes.append("clip_ratio_high < clip_ratio_low: this is the opposite of DAPO's clip-higher")
    params = model_params(cfg.model.model_path) if cfg.optim.learning_rate > HIGH_LR else None
    if params is not None and params > LARGE_MODEL_PARAMS:
        notes.append(f"learning_rate={cfg.optim.learning_rate:g} is high for RL on a model of {params / 1e9:.1f}B "
                     f"parameters (article 5.4: ~1e-6 for a large MoE model)")
    if cfg.algo.kl_coef_init is not None and cfg.algo.kl_warmup_steps == 0:
        notes.append("kl_coef_init is set but kl_warmup_steps is 0, so it is never used")
    if cfg.data.val_dataset is None and cfg.run.val_every:
        notes.append("no val_dataset: validation is off")
    if cfg.model.reward_model and cfg.model.reward_fn != ModelConfig.reward_fn:
        notes.append(f"reward_model is set, so reward_fn {cfg.model.reward_fn} is ignored: the reward model scores "
                     f"every response")
    return notes


@dataclass(frozen=True)
class Derived:
    """Values computed from the config and the launch, kept apart from the user's settings."""

    world_size: int
    num_rollout_ranks: int
    num_learner_ranks: int
    sequences_per_step: int  # prompts_per_step * sample_num
    minibatch_sequences: int  # per learner rank per optimizer step
    optimizer_steps_per_step: int
    dynamic_sampling_metric: str  # "acc" or "reward": dynamic_sampling_metric with auto resolved
    nodes: int = 1  # the ranks are spread evenly over them, by index (ranks.Layout.node_ranks)
    # Rollout ranks per engine. Which ranks learn, which rollout ranks drive an engine and which
    # share one: ranks.Layout.of(derived), the one place that places them.
    rollout_tensor_parallel: int = 1

    @staticmethod
    def of(cfg: Config, world_size: int, nodes: int = 1) -> "Derived":
        # One process runs both roles and ignores learner_ranks; W processes need a rollout rank
        # besides the learner_ranks learners.
        if world_size > 1 and cfg.run.learner_ranks > world_size - 1:
            raise ConfigError(
                f"learner_ranks {cfg.run.learner_ranks} needs at least {cfg.run.learner_ranks + 1} processes (the "
                f"learners and a rollout rank), this job has {world_size}: set learner_ranks to at most "
                f"{world_size - 1} or start more processes")
        if world_size % nodes:
            raise ConfigError(f"--nnodes {nodes} does not split {world_size} ranks evenly: every node runs "
                              f"WORLD_SIZE / nnodes ranks (nodes that fit: {_divisors(world_size)})")
        learners = cfg.run.learner_ranks if world_size > 1 else 1
        sequences = cfg.rollout.prompts_per_step * cfg.rollout.sample_num
        if cfg.model.learner_offload and world_size == 1:
            raise ConfigError("learner_offload needs a torchrun job: FSDP2 offloads over the learner ranks' process group")
        per_rank_mb = cfg.optim.per_device_batch_size * cfg.optim.gradient_accumulation_steps
        if sequences % (per_rank_mb * learners):
            raise ConfigError(
                f"prompts_per_step * sample_num = {sequences} sequences must split evenly into mini-batches of "
                f"per_device_batch_size * gradient_accumulation_steps = {per_rank_mb} per learner rank "
                f"x {learners} learner rank(s)"
            )
        rollout_ranks = world_size - learners if world_size > 1 else 1
        check_engine_groups(cfg.model.rollout_tensor_parallel, world_size, rollout_ranks, nodes)
        return Derived(
            world_size=world_size,
            num_rollout_ranks=rollout_ranks,
            num_learner_ranks=learners,
            sequences_per_step=sequences,
            minibatch_sequences=per_rank_mb,
            optimizer_steps_per_step=sequences // (per_rank_mb * learners) * cfg.optim.ppo_epochs,
            dynamic_sampling_metric=(cfg.rollout.dynamic_sampling_metric if cfg.rollout.dynamic_sampling_metric != "auto"
                                     else "reward" if cfg.model.reward_model else "acc"),
            nodes=nodes,
            rollout_tensor_parallel=cfg.model.rollout_tensor_parallel,
        )


def check_engine_groups(tensor_parallel: int, world_size: int, rollout_ranks: int, nodes: int) -> None:
    """ConfigError unless every engine spans ``tensor_parallel`` consecutive rollout ranks, all
    on one node (their devices are one vLLM engine's). The groups and nodes are ranks.Layout's
    (engine_groups, node_ranks), counted here in the key's terms: config cannot import ranks."""
    if tensor_parallel == 1:
        return
    if world_size == 1:
        raise ConfigError(f"rollout_tensor_parallel {tensor_parallel} needs a torchrun job: an engine spans the "
                          f"devices of {tensor_parallel} rollout ranks, one process has one device")
    if rollout_ranks % tensor_parallel:
        raise ConfigError(f"rollout_tensor_parallel {tensor_parallel} does not divide the {rollout_ranks} rollout "
                          f"ranks ({world_size} ranks - learner_ranks {world_size - rollout_ranks}): values that "
                          f"do: {_divisors(rollout_ranks)}")
    per_node = world_size // nodes
    for first in range(0, rollout_ranks, tensor_parallel):
        last = first + tensor_parallel - 1
        if first // per_node != last // per_node:
            raise ConfigError(f"rollout_tensor_parallel {tensor_parallel}: the engine of rollout ranks {first}-{last} "
                              f"would span two nodes ({per_node} ranks a node); an engine's devices are on one node")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def uses_fsdp(cfg: Config, num_learners: int) -> bool:
    """Whether the learner runs under FSDP2: to split its state over several learners or into host
    memory, and, on a single rank too, to compute in bf16 (learner.shard_model: autocast does not
    reach the fused MoE experts)."""
    return num_learners > 1 or cfg.model.learner_offload or cfg.model.learner_dtype == "bf16"


@dataclass(frozen=True)
class Schedule:
    """Which weight versions are validated and checkpointed, from the run settings and the step
    a resumed run continues from (0 for a fresh start)."""

    run: RunConfig
    has_val_set: bool
    resumed_from: int = 0

    def validates(self, version: int) -> bool:
        run = self.run
        if not self.has_val_set or run.val_every == 0:
            return False
        return version == 0 or version % run.val_every == 0 or version == run.max_steps

    def saves(self, version: int) -> bool:
        """Whether this run writes checkpoint ``version`` (a resumed run has its first one already)."""
        every = self.run.save_every
        return version > self.resumed_from and bool(every) and (version % every == 0 or
                                                                 version == self.run.max_steps)

    def exports(self, version: int) -> bool:
        """Whether checkpoint ``version`` holds the weights in Hugging Face format too (model/)."""
        every = self.run.hf_export_every
        return self.saves(version) and (version == self.run.max_steps or bool(every) and version % every == 0)

    def collects_past_the_end(self) -> bool:
        """With rollout ahead, the final checkpoint holds the next step's batch like every other
        one, so a finished run extended with a larger max_steps continues exactly."""
        return self.run.max_staleness > 0 and self.saves(self.run.max_steps)


# ----- --help: the usage and every key, with its default and meaning --------------------------

def _default_text(value: Any) -> str:
    """A default as it would be written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # 1e-06, 0.28, 600.0: what YAML reads back as the same number
    if isinstance(value, list):
        return "[" + ", ".join(_default_text(item) for item in value) + "]"
    return str(value)


def default_texts() -> dict[str, str]:
    """Every key's default, as --help prints it."""
    return {name: _default_text(value) for name, value in Config().flat().items()}


def usage(prog: str = "train_dapo.py") -> str:
    return (f"usage: python {prog} --config FILE.yaml [--KEY VALUE ...]\n"
            f"       torchrun --nproc_per_node=N {prog} --config FILE.yaml [--KEY VALUE ...]\n"
            f"       python {prog} --config FILE.yaml [--KEY VALUE ...] (--plan | --dry_run) [WORLD_SIZE] [--nnodes N]\n"
            f"       python {prog} --help\n")


def help_text(prog: str = "train_dapo.py") -> str:
    """The usage, the inspection flags and every config key, by section, with default and meaning."""
    lines = [usage(prog),
             "DAPO reinforcement learning. One process runs both roles; N processes under torchrun run",
             "learner_ranks learner ranks and N - learner_ranks rollout ranks. Settings: the defaults below,",
             "then the YAML file (--config), then --KEY VALUE (or --KEY=VALUE) on the command line. In the",
             "YAML file a key may sit under its section's heading or at the top level. Values read as YAML",
             "reads them: 1e-6, true, null, [1, 2].",
             "",
             "  --plan [WORLD_SIZE]     print what each rank and node will hold (OUTPUT_DIR/memory_plan.json)",
             "                          and exit: 0 when it fits, 1 when it does not",
             "  --dry_run [WORLD_SIZE]  check the plan by tracing one learner step on fake tensors and exit",
             "                          (WORLD_SIZE: torchrun's, else 8)",
             "  --nnodes N              with --plan or --dry_run: the nodes WORLD_SIZE is spread over, evenly",
             "                          (torchrun's, else 1)",
             "  -h, --help              this text",
             ""]
    defaults = default_texts()
    width = max(len(name) for name in KEY_SECTION) + 2
    for section in SECTIONS:
        lines.append(f"{section}:")
        for name, owner in KEY_SECTION.items():
            if owner != section:
                continue
            meaning = KEY_HELP.get(name, "")
            if typing.get_origin(_FIELD_TYPES[name]) is Literal:
                meaning += f" [{' | '.join(typing.get_args(_FIELD_TYPES[name]))}]"
            lines.append(f"  --{name:<{width}} {defaults[name]}")
            lines.append(f"      {meaning}")
        lines.append("")
    return "\n".join(lines)


def answer_usage(argv: list[str], prog: Optional[str] = None, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None) -> Optional[int]:
    """-h or --help: print the help to ``out`` (stdout), return 0. No arguments at all: the usage
    to ``err`` (stderr), return 2 (a run needs at least its config). Otherwise None: go on."""
    out, err = out or sys.stdout, err or sys.stderr
    if prog is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        prog = script if script.endswith(".py") else "train_dapo.py"
    if "-h" in argv or "--help" in argv:
        out.write(help_text(prog))
        out.flush()
        return 0
    if not argv:
        err.write(usage(prog) + f"error: no arguments: give --config FILE.yaml and --KEY VALUE settings "
                                f"(python {prog} --help lists every key)\n")
        err.flush()
        return 2
    return None


def answers_usage(main: Callable[..., int]) -> Callable[..., int]:
    """Decorates an entry point ``main(argv, ...)`` so that -h/--help and an empty command line
    are answered (:func:`answer_usage`) before it runs; a user's script calling it gets the same."""
    @functools.wraps(main)
    def entry(argv: list[str], *args: Any, **kwargs: Any) -> int:
        status = answer_usage(argv)
        return main(argv, *args, **kwargs) if status is None else status
    return entry
