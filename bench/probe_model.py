"""The probe: Qwen3-30B-A3B's geometry with a few of its 48 layers and random bf16 weights, the
work of one DAPO step on it, and the FLOPs of that work. Imported by probe_step.py (this
project's trainer) and probe_trl.py (TRL on the same model and work); not run by itself.

The probe folder holds model/ (config, weights, tokenizer), prompts.jsonl and probe.json (what
was built, written last). Two choices make both trainers do exactly the same work:
- Every response runs the full ``new_tokens``: the tokenizer's EOS is the one id past the
  model's vocabulary, which the model cannot sample; every id it can sample decodes (the demo's
  characters, then synthetic words up to the vocabulary size).
- All prompts have the same token count and fill one length bucket, so each step generates
  for every prompt in one batch and nothing is padded.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from demo_model import DEMO_CHAT_TEMPLATE, DEMO_SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
QWEN3_30B_A3B = ROOT / "configs" / "models" / "qwen3-30b-a3b"
PROBE_EOS = "<|probe_eos|>"
# A geometry a 2-core CPU runs in seconds, to test the probe scripts without an accelerator.
SMALL_GEOMETRY = dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, vocab_size=4096)
# One FLOP-weighted pass = 2 FLOPs per active weight per token. Per trained token the decoder
# layers run the old-log-prob forward (1), the training forward (1), the backward (2) and the
# gradient-checkpointing recompute (1); the lm_head is not checkpointed, so it skips the last.
LAYER_PASSES = 5
LM_HEAD_PASSES = 4


@dataclass(frozen=True)
class Work:
    prompts: int
    samples: int
    new_tokens: int

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples


FULL_WORK = Work(prompts=16, samples=8, new_tokens=256)
SMALL_WORK = Work(prompts=16, samples=8, new_tokens=32)


@dataclass(frozen=True)
class Probe:
    """What probe.json records about a built probe folder."""

    folder: Path  # where it was loaded from (not saved: the folder may move)
    layers: int
    small: bool
    work: Work
    prompt_tokens: int  # every prompt's length after the chat template
    params: int
    active_layer_params: int  # decoder layers, counting only the experts a token is routed to
    lm_head_params: int

    @property
    def model_path(self) -> Path:
        return self.folder / "model"

    @property
    def dataset(self) -> Path:
        return self.folder / "prompts.jsonl"

    @property
    def active_params(self) -> int:
        return self.active_layer_params + self.lm_head_params

    def training_flops(self, response_tokens: int) -> float:
        """FLOPs of one step's learner work on ``response_tokens`` generated tokens (attention
        scores, ~2% at these lengths, left out; the input embedding is a lookup, no FLOPs)."""
        sequence_tokens = self.work.sequences * self.prompt_tokens + response_tokens
        return 2.0 * (LAYER_PASSES * self.active_layer_params * sequence_tokens
                      + LM_HEAD_PASSES * self.lm_head_params * response_tokens)

    def describe(self) -> str:
        geometry = "small CPU geometry" if self.small else "Qwen3-30B-A3B geometry"
        layers = f"{self.layers} of 48 layers" if not self.small else f"{self.layers} layer{'s' * (self.layers > 1)}"
        return (f"{geometry}, {layers}, {_count(self.params)} params ({_count(self.active_params)} "
                f"active); {self.work.prompts} prompts x {self.work.samples} samples x {self.work.new_tokens} tokens")


def _count(number: int) -> str:
    return f"{number / 1e9:.2f}B" if number >= 1e8 else f"{number / 1e6:.1f}M"


def zero_reward(response: str, answer: Optional[str]) -> tuple[float, bool]:
    """The probe's reward rule (reward_fn probe_model:zero_reward): 0 for every response, what
    random weights earn anyway, without spending time on scoring."""
    return 0.0, False


def probe_config(layers: int, small: bool):
    """Qwen3-30B-A3B's config.json with ``layers`` layers (and the small geometry when asked)."""
    from transformers import AutoConfig

    overrides = SMALL_GEOMETRY if small else {}
    config = AutoConfig.from_pretrained(QWEN3_30B_A3B, local_files_only=True, num_hidden_layers=layers, **overrides)
    # The tokenizer's EOS lies past the vocabulary (see the top of this file), so the model
    # declares none: TRL would otherwise also stop at the model's own EOS id.
    config.eos_token_id = config.bos_token_id = None
    config.pad_token_id = 0
    return config


def build_tokenizer(vocab_size: int):
    """Ids 0..vocab_size-1 all decode (specials, characters, synthetic words); EOS is id vocab_size."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    characters = ["\n", "\t"] + [chr(code) for code in range(0x20, 0x7F)]
    named = [*DEMO_SPECIAL_TOKENS, *characters]
    tokens = named + [f" w{index}" for index in range(vocab_size - len(named))] + [PROBE_EOS]
    # BPE without merges encodes character by character; the synthetic words only ever decode.
    backend = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=[],
                                   unk_token="<unk>"))
    backend.add_special_tokens([*DEMO_SPECIAL_TOKENS, PROBE_EOS])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=PROBE_EOS, pad_token="<|endoftext|>",
                                   unk_token="<unk>", padding_side="left", chat_template=DEMO_CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def probe_prompts(count: int) -> list[dict[str, str]]:
    """``count`` (up to 100) questions of one length, so they share a length bucket."""
    return [{"prompt": f"What is {index % 10} plus {index // 10}?"} for index in range(count)]


def count_parameters(config) -> tuple[int, int, int]:
    """(all parameters, active decoder-layer parameters, lm_head parameters), counted on the
    meta device: an expert's weights count num_experts_per_tok / num_experts of their size."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed_share = config.num_experts_per_tok / config.num_experts
    active_layers = sum(p.numel() * (routed_share if ".mlp.experts." in name else 1.0)
                        for name, p in model.model.layers.named_parameters())
    return (sum(p.numel() for p in model.parameters()), round(active_layers),
            model.get_output_embeddings().weight.numel())


def build_probe(folder: Path, layers: int, small: bool, device: torch.device) -> Probe:
    """Write the probe folder, or reuse it when probe.json says it was built the same way. The
    random bf16 weights are drawn on ``device``: an accelerator draws 3.1B of them far faster
    than the host."""
    from transformers import AutoModelForCausalLM

    marker = folder / "probe.json"
    if marker.is_file():
        probe = load_probe(folder)
        if (probe.layers, probe.small) == (layers, small):
            return probe
        marker.unlink()  # a build cut short must not pass for the old one
    folder.mkdir(parents=True, exist_ok=True)
    config = probe_config(layers, small)
    tokenizer = build_tokenizer(config.vocab_size)
    work = SMALL_WORK if small else FULL_WORK
    rows = probe_prompts(work.prompts)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    del model
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}],
                                             add_generation_prompt=True, tokenize=False)
    params, active_layer_params, lm_head_params = count_parameters(config)
    probe = Probe(folder=folder, layers=layers, small=small, work=work,
                  prompt_tokens=len(tokenizer(rendered, add_special_tokens=False)["input_ids"]), params=params,
                  active_layer_params=active_layer_params, lm_head_params=lm_head_params)
    saved = {key: value for key, value in asdict(probe).items() if key != "folder"}
    marker.write_text(json.dumps(saved, indent=2) + "\n")
    return probe


def load_probe(folder: Path) -> Probe:
    saved = json.loads((folder / "probe.json").read_text())
    return Probe(**{**saved, "folder": folder, "work": Work(**saved["work"])})
