"""The parts of bench/accelerator_check.sh that hold on any machine: the probe's parameter and
FLOP counts, a probe tokenizer that decodes every id the model can sample and stops on none of
them, the demo comparison that ignores timings and names the first difference, and the IPC
check on this CPU's shared memory."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from demo_on_device import first_difference  # noqa: E402
from probe_model import FULL_WORK, Probe, build_tokenizer, count_parameters, probe_config, probe_prompts  # noqa: E402


def test_the_probe_is_qwen3_30b_a3b_with_4_layers_3_1b_parameters_and_8_of_128_experts_active():
    config = probe_config(4, small=False)
    params, active_layer_params, lm_head_params = count_parameters(config)
    attention = 2048 * (32 + 4 + 4) * 128 + 32 * 128 * 2048
    routed_experts = 8 * 3 * 2048 * 768  # gate, up and down of the 8 experts a token goes to
    router, norms = 128 * 2048, 2 * 2048 + 2 * 128
    assert round(params / 1e9, 2) == 3.11
    assert active_layer_params == 4 * (attention + routed_experts + router + norms)
    assert lm_head_params == 151936 * 2048


def test_the_probe_step_is_about_170_tflop_of_learner_work():
    params, active_layer_params, lm_head_params = count_parameters(probe_config(4, small=False))
    probe = Probe(folder=Path("unused"), layers=4, small=False, work=FULL_WORK, prompt_tokens=36, params=params,
                  active_layer_params=active_layer_params, lm_head_params=lm_head_params)
    # docs/platform.md estimates ~200 TFLOP, counting the lm_head on every token and in the recompute.
    assert 1.5e14 < probe.training_flops(FULL_WORK.sequences * FULL_WORK.new_tokens) < 2.0e14


def test_the_probe_tokenizer_decodes_every_model_id_and_its_eos_lies_past_them():
    tokenizer = build_tokenizer(vocab_size=512)
    assert len(tokenizer) == 513 and tokenizer.eos_token_id == 512 and tokenizer.pad_token_id < 512
    assert all(tokenizer.decode([token]) for token in range(512))
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                              tokenize=False) for row in probe_prompts(16)]
    lengths = {len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered}
    assert len(lengths) == 1  # one length bucket, no padding
    assert tokenizer.eos_token_id not in tokenizer(rendered[0], add_special_tokens=False)["input_ids"]


def test_the_demo_comparison_ignores_timings_and_names_the_first_difference():
    rows = [{"step": "0", "val_acc": "0.17", "step_time_s": ""},
            {"step": "1", "val_acc": "", "policy_loss": "0.5", "step_time_s": "0.3"}]
    retimed = [dict(rows[0]), {**rows[1], "step_time_s": "0.9"}]
    assert first_difference(rows, retimed, through=1) is None
    changed = [dict(rows[0]), {**rows[1], "policy_loss": "0.6"}]
    assert first_difference(rows, changed, through=1) == "step 1 policy_loss: 0.5 vs 0.6"
    assert first_difference(rows, changed, through=0) is None
    assert first_difference(rows, rows[:1], through=1) == "2 metrics rows through step 1 vs 1"


def test_the_ipc_check_opens_this_cpus_shared_memory_in_another_process():
    """bench/ipc_check.py, the accelerator check's "ipc" line, as it runs on a CPU: the child maps
    the rank's buffer by its handle, reads the rank's bytes in it, and its write comes back."""
    proc = subprocess.run([sys.executable, "bench/ipc_check.py", "--device", "cpu", "--mb", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("PASS ipc: cpu memory opened in place"), proc.stdout


def test_the_probe_step_takes_the_check_s_compile_choice_and_settings_over_its_own():
    """probe_step's --rollout-compile and --set reach train_dapo's command line, each key once,
    the override in place of the probe's own value (the H200 check compared packing on and off)."""
    from probe_step import train_argv

    probe = Probe(folder=Path("unused"), layers=4, small=True, work=FULL_WORK, prompt_tokens=36, params=1,
                  active_layer_params=1, lm_head_params=1)
    argv = train_argv(probe, Path("run"), "cuda", "false", ["use_remove_padding=false", "seed=3"])
    keys = argv[::2]
    settings = dict(zip(keys, argv[1::2]))
    assert len(keys) == len(set(keys))
    assert settings["--rollout_compile"] == "false" and settings["--use_remove_padding"] == "false"
    assert settings["--seed"] == "3" and settings["--rollout_dtype"] == "bf16"
