"""The learner's throughput columns (throughput.py): active parameters, the peak, MFU per phase."""
import pytest
import torch

import throughput
from metrics import console_line


def test_an_moe_counts_top_k_of_its_experts_as_active(demo_assets):
    from hf_weights import empty_model

    model = empty_model(demo_assets / "model", "cpu", torch.float32, None)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    assert experts > total / 2  # the demo is mostly experts: 8, of which 2 run per token
    assert throughput.active_parameters(model) == total - experts + experts * 2 // 8


def test_the_peak_is_the_setting_else_the_devices_entry_else_unknown():
    assert throughput.peak_tflops("Ascend910B3", None) == 313.0
    assert throughput.peak_tflops("NVIDIA H200", None) == 989.0
    assert throughput.peak_tflops("NVIDIA H200", 500.0) == 500.0
    assert throughput.peak_tflops(None, None) is None and throughput.peak_tflops("Some CPU", None) is None


def test_phase_metrics_count_real_tokens_padding_and_model_flops():
    row = throughput.phase_metrics({"old_logp": (800.0, 1000.0), "ref": (0.0, 0.0), "update": (800.0, 800.0)},
                                   {"old_logp": 2.0, "update": 4.0}, active=10**9, learners=2, peak=100.0)
    assert row["old_logp_tokens_per_s"] == 400.0 and row["old_logp_padding_frac"] == pytest.approx(0.2)
    # a forward: 2 x 1e9 x 800 FLOPs in 2 s over 2 devices of 100 TFLOPS; forward and backward: 6x
    assert row["old_logp_mfu"] == pytest.approx(2 * 1e9 * 800 / 2.0 / 2e14)
    assert row["update_mfu"] == pytest.approx(6 * 1e9 * 800 / 4.0 / 2e14) and row["update_padding_frac"] == 0.0
    assert row["ref_tokens_per_s"] is row["ref_padding_frac"] is row["ref_mfu"] is None  # no reference model
    no_peak = throughput.phase_metrics({"update": (8.0, 8.0)}, {"update": 1.0}, active=1, learners=1, peak=None)
    assert no_peak["update_mfu"] is None and no_peak["update_tokens_per_s"] == 8.0


def test_the_console_shows_each_phase():
    row = {"step": 3, "policy_loss": 0.1, "step_time_s": 1.0, "old_logp_tokens_per_s": 5000.0,
           "old_logp_padding_frac": 0.25, "update_tokens_per_s": 1200.0, "update_padding_frac": 0.0,
           "update_mfu": 0.123, "old_logp_mfu": 0.05}
    line = console_line(row)
    assert "old/ref/upd tok/s 5000/-/1200 pad 0.25/-/0.00 mfu 5.0%/-/12.3%" in line
    assert "tok/s" not in console_line({"step": 3, "policy_loss": 0.1})
