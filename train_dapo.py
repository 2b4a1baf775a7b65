"""DAPO training: the entry point, the only file with side effects at start-up, and the
algorithm's override points (:class:`Trainer`).

    python train_dapo.py --config configs/demo_cpu.yaml [--KEY VALUE ...]      # one process, both roles
    torchrun --nproc_per_node=8 train_dapo.py --config ... [--KEY VALUE ...]  # 6 rollout + 2 learner ranks

The work lives with its role: roles.py (each role's loop: who sends what to whom, in which
order), exchange.py (both ends of everything that crosses between ranks), rollout.py
(generation, rewards, dynamic sampling, validation), learner.py (FSDP2 learners, the DAPO
update), ckpt.py (what a checkpoint holds, what a resume checks). To change the algorithm, subclass
:class:`Trainer` and override :meth:`Trainer.compute_advantages`, :meth:`Trainer.policy_loss` or
:meth:`Trainer.update_policy`.
"""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

import ckpt
import config
import dapo_loss
import dry_run
import memory_plan
import plan_advice
import resuming
import stopping
import versions
from config import Config, Derived, UserError, load_config, split_inspection, warnings_for
from data_prep import check_reward_on_data
from device import (Platform, bind_host_cores, seed_everything, select_platform, use_deterministic_algorithms,
                    write_env_report)
from learner import check_model_type, dapo_policy_loss, uses_reference_model
from metrics import check_report_to, log, quiet, warn
from moe_kernels import experts_implementation
from ranks import Groups, Layout, PhaseError, finish_together, init_world, leave_world
from roles import Roles
from rollout import check_engine, check_rollout_inputs
from samples import SampleBatch
from weight_sync import every_engine_rank_takes_weights, host_bounce_reason


class Trainer(Roles):
    """DAPO on one process (both roles) or on a rank of a torchrun job (one role); the roles'
    loops and the exchanges between them are roles.py's and exchange.py's.

    Override points (article 4.1): ``compute_advantages(batch) -> Tensor[N]``, one advantage per
    response (default: DAPO's, group-relative); ``policy_loss(log_prob, old_log_prob, advantages,
    response_mask, *, loss_agg_mode, normalizer, is_weights) -> (loss, metrics)``, the
    policy-gradient term of each micro-batch (default: DAPO's clipped loss);
    ``update_policy(batch, advantages) -> dict``, the whole training step on the step's samples,
    returning metrics.csv values (keys of metrics.COLUMNS).
    """

    def compute_advantages(self, batch: SampleBatch) -> torch.Tensor:
        """Group-relative advantages, one per response (docs/algorithm.md §2)."""
        return dapo_loss.group_advantages(batch.reward, batch.group_size, norm_by_std=self.cfg.algo.norm_adv_by_std)

    def policy_loss(self, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, *, loss_agg_mode: str, normalizer: float,
                    is_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The policy-gradient term of one micro-batch's loss and its aggregation (docs/algorithm.md
        §4; default: DAPO's clipped loss, dapo_loss.policy_loss with the run's clip ratios).

        log_prob [n, T]: the policy's, with gradient; old_log_prob [n, T]: the learner's at the
        step's start; advantages [n]: compute_advantages's; response_mask [n, T] bool: the tokens
        the loss counts (rollout_rs's rejected ones left out); is_weights [n, T] or None: the
        rollout correction's truncated importance weights, to multiply into each token's term
        before aggregating, which only the loss can do (None unless rollout_is is set); the
        weights and the rejection are computed outside, once per step. loss_agg_mode and normalizer
        (the whole mini-batch's token, or sequence, count, over every micro-batch and learner) are
        dapo_loss.aggregate's, so the micro-batches' losses add up to the mini-batch's. Returns
        (scalar loss, metrics): any of learner.PG_METRICS as means over this call's tokens; one left
        out is empty in metrics.csv. The learner adds the KL, entropy and length-penalty terms
        outside: regularisers that any estimator keeps, as verl's policy losses leave them out.
        Settings come from self.cfg.
        """
        return dapo_policy_loss(self.cfg.algo)(log_prob, old_log_prob, advantages, response_mask,
                                               loss_agg_mode=loss_agg_mode, normalizer=normalizer,
                                               is_weights=is_weights)

    def update_policy(self, batch: SampleBatch, advantages: torch.Tensor) -> dict[str, Any]:
        """One training step on the step's samples (learner.py), its loss's policy-gradient term
        :meth:`policy_loss`; returns metrics.csv values."""
        return self.learner.update(batch, advantages, self.step, policy_loss=self.policy_loss)


def launch_layout(cfg: Config, ranks: Optional[int], nodes: Optional[int]) -> tuple[Derived, Layout]:
    """The world this process is in (torchrun's), or the one --plan / --dry_run lays out: its
    ``ranks`` over ``nodes``, each torchrun's when not given."""
    world_size = ranks or int(os.environ.get("WORLD_SIZE", "1"))
    derived = Derived.of(cfg, world_size, nodes=nodes or config.torchrun_nodes())
    return derived, Layout.of(derived, rank=int(os.environ.get("RANK", "0")))


def check_inputs(cfg: Config, *, reads_data: bool) -> None:
    """Refuse (UserError, one line naming the key) what this run could not read or use, before
    anything loads: every path it reads (--plan and --dry_run read no data, ``reads_data`` False),
    the model's type, the rollout settings, the reporters."""
    config.check_input_paths(cfg, reads_data=reads_data)
    if reads_data:
        resuming.check_resume_path(Path(cfg.run.output_dir), cfg.run.resume_from_checkpoint,
                                   restarted=resuming.restarted_by_torchrun())
    check_model_type(cfg.model.model_path)
    check_rollout_inputs(cfg)
    check_report_to(cfg.run.report_to)


def start_up_warnings(cfg: Config, platform_kind: str) -> list[str]:
    """Legal but suspicious settings (config.warnings_for), and a weight sync slower than it
    should be on this platform."""
    notes = warnings_for(cfg)
    if cfg.model.rollout_engine == "vllm" and (slow_sync := host_bounce_reason(platform_kind)):
        notes.append(slow_sync)
    return notes


def join_world(cfg: Config, plat: Platform, layout: Layout) -> Optional[Groups]:
    """This rank's device made current and the job's process groups; None for a job of one rank."""
    if layout.world_size == 1:
        return None
    plat.bind()
    return init_world(layout, plat.backend, cfg.run.dist_timeout_s, plat.learner_backend(cfg.model.learner_offload),
                      every_engine_rank_takes_weights(cfg.model.rollout_engine, plat.kind, layout.tensor_parallel))


@config.answers_usage  # -h/--help: every key with its default, exit 0; no arguments: the usage, exit 2
def main(argv: list[str], trainer_class: type[Trainer] = Trainer) -> int:
    """The run; ``trainer_class`` is a user's subclass of :class:`Trainer` (README.md)."""
    restore_determinism = None
    try:
        argv, inspection, *asked = split_inspection(argv)  # --plan / --dry_run [WORLD_SIZE] [--nnodes N]
        cfg = load_config(argv)
        derived, layout = launch_layout(cfg, *asked)
        world_size, lead = layout.world_size, layout.is_lead
        plat = select_platform(cfg.run.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        versions.check_stack(plat.kind, cfg.model.rollout_engine)  # --plan and --dry_run too
        restore_determinism = use_deterministic_algorithms(plat.kind, cfg.run.deterministic)  # before any kernel
        check_inputs(cfg, reads_data=inspection is None)  # before anything loads and output_dir is written
        if inspection == "dry_run":
            return dry_run.run(cfg, derived)
        if (status := plan_advice.check(cfg, derived, plat.memory_bytes(), with_reference=uses_reference_model(cfg),
                                        plan_only=inspection == "plan", lead=lead, platform_kind=plat.kind)) is not None:
            return status  # --plan: 0 when it fits, 1 when it does not
        check_engine(cfg, plat)  # vLLM installed, FP8 available: before output_dir is written
        check_reward_on_data(cfg)
        from transformers.utils import logging as hf_logging  # here: a bad command line fails fast
        hf_logging.disable_progress_bar()  # weight-loading bars would bury the training log
        for message in start_up_warnings(cfg, plat.kind) if lead else []:
            warn(message)  # "no val_dataset" among them
        out = Path(cfg.run.output_dir)
        restarted = resuming.restarted_by_torchrun()
        resume = resuming.find_resume_checkpoint(out, cfg.run.resume_from_checkpoint, restarted=restarted,
                                                 warn=warn if lead else quiet, log=log if lead else quiet)
        resuming.prepare_output_dir(out, overwrite=cfg.run.overwrite_output_dir, create=lead,
                                    resuming=cfg.run.resume_from_checkpoint is not None or resume is not None or restarted)
        role = "rollout+learner" if world_size == 1 else layout.role + " (lead)" * lead if layout.is_learner \
            else layout.title
        log(f"rank {layout.rank}/{world_size} role={role} pid={os.getpid()} device={plat.device} "
            f"backend={plat.backend} moe_experts={experts_implementation(plat.kind)}")
        bind_host_cores(plat)  # before the run's threads and processes start: they inherit its cores
        stopping.watch(layout, out)  # Ctrl-C and SIGTERM end the run with one line from here on
        groups = join_world(cfg, plat, layout)
        seed_everything(cfg.run.seed + layout.rank)
        trainer = trainer_class(cfg, plat, derived, layout, groups, resume)  # checks the inputs; writes nothing
        if lead and (resumed := trainer.schedule.resumed_from) >= cfg.run.max_steps:
            log(f"the checkpoint is at step {resumed}, max_steps is {cfg.run.max_steps}: nothing to train")
        elif lead:  # a resume that trains nothing leaves the run's config.yaml and env report as they were
            (out / "config.yaml").write_text(cfg.to_yaml())
            write_env_report(out / "env_report.json", plat, world_size)
        trainer.train()
        memory_plan.record_usage(layout, plat, out)
        finish_together()
    except UserError as e:
        stopping.say_once_per_job(f"error: {e}")
        return stopping.BAD_INPUT_STATUS
    except (PhaseError, ckpt.CheckpointError, OSError) as e:  # OSError: a full disk among others
        stopping.say_once_per_job(f"error: {stopping.failure_line(e)}")
        return 1
    finally:
        stopping.unwatch()
        leave_world()
        if restore_determinism is not None:
            restore_determinism()
    return 0


if __name__ == "__main__":
    if "triton" not in sys.modules:
        # What the imports made lives as long as the process: no collection, the exit's included,
        # walks it again (2 CPU s of a rank). Not triton's: nanobind would report it leaked at exit.
        gc.freeze()
    sys.exit(main(sys.argv[1:]))
