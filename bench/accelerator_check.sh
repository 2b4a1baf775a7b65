#!/usr/bin/env bash
# Does this project run on this machine's GPU or NPU, and how fast? One command: 263 s on one
# H200 (docs/platform.md "One NVIDIA H200, the accelerator check"); on a 2-core CPU with
# PROBE_SMALL=1 about 3 minutes:
#
#     bash bench/accelerator_check.sh
#
# Prints one line per check, PASS, FAIL or SKIP, with its seconds:
#   device  the versions (python, torch, transformers, trl) and the device chosen
#   smoke   a matmul on the device and a 1-process all_reduce on its backend (smoke.py, which
#           always takes the device that auto picks)
#   ipc     the device's memory opened in place by another process, as a vLLM engine's worker
#           opens a rollout rank's weight buckets, and the copy's GB/s (bench/ipc_check.py)
#   decode  the built-in engine's decode loop on a random 1.4B Qwen3-MoE (hidden 2048, 4 layers, 64
#           experts top-8), 32 rows, 64 new tokens after 256: a decode step's ms in bf16 and FP8,
#           eager and compiled (on CUDA in CUDA graphs), the speeds compiled / eager and FP8 / bf16,
#           each compile's seconds and the host syncs per step (bench/decode.py --check)
#   demo    the demo trains STEPS steps on the device, checkpoints, and resumes exactly
#           (bench/demo_on_device.py)
#   probe   3 DAPO steps on Qwen3-30B-A3B's geometry with PROBE_LAYERS of its layers: the step
#           time split into generation, train and weight sync, tokens/s, MFU, peak device memory
#           (bench/probe_step.py)
#   trl     TRL's GRPOTrainer on the same probe and work, and the ratios ours / TRL; SKIP when
#           trl or datasets is not installed (bench/probe_trl.py)
# A failed check prints "FAIL <check>: <why>" and the next one still runs; the exit status is 1
# when any check failed. Needs torch, transformers, safetensors, accelerate, pyyaml (with the
# numpy, tokenizers and tqdm they bring) and matplotlib (train_dapo draws curves.png at every
# validation and at the end); not datasets or tensorboard, no network and no pip install: the
# project runs from this folder through PYTHONPATH.
#
# A machine without network (an image with torch, transformers, accelerate, pandas, pyarrow,
# xxhash and huggingface_hub but not TRL) takes the trl line's packages as wheels, ~1.8 MB,
# downloaded where pip works, carried in a folder .whl and installed beside the image's:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#     pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (multiprocess's wheel is per Python version: py312 above.) vLLM does not travel so: its CUDA
# wheels are hundreds of MB and pin their own torch.
#
# Settings, from the environment:
#   PYTHON         the interpreter (python3)
#   DEVICE         auto, cuda, npu or cpu (auto: device.select_platform picks npu, cuda, then cpu)
#   STEPS          demo steps, an even number; the resumed run restarts at STEPS/2 (100)
#   PROBE_LAYERS   probe layers, of Qwen3-30B-A3B's 48 (4: 3.1B parameters, 6 GB on disk)
#   PROBE_SMALL    1: a tiny probe and decode geometry, to try this script on a CPU (0)
#   PROBE_COMPILE  the probe's rollout_compile: false, true or null (false: compiling its decode
#                  step, once per attended length, would take longer than its 3 steps; the
#                  decode line measures the compiled step)
#   PEAK_TFLOPS    the device's dense bf16 peak, for MFU (989: H100 and H200 SXM)
#   CHECK_TIMEOUT  seconds after which a check is stopped and counted as failed (300); one check's
#                  own: TIMEOUT_<CHECK>, e.g. TIMEOUT_DEMO=240
#   OUT            where runs, the probe and each check's log (OUT/<check>.log) go (a new /tmp folder)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-auto}
STEPS=${STEPS:-100}
PROBE_LAYERS=${PROBE_LAYERS:-4}
PROBE_SMALL=${PROBE_SMALL:-0}
PROBE_COMPILE=${PROBE_COMPILE:-false}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-300}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/accelerator_check.XXXXXX")}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1
mkdir -p "$OUT" || exit 1

checks=0
failures=0

# report LINE: print a check's line; anything but PASS or SKIP counts as a failure.
report() {
  echo "$1"
  checks=$((checks + 1))
  [[ $1 == PASS* || $1 == SKIP* ]] || failures=$((failures + 1))
}

last_line() {
  grep -v '^[[:space:]]*$' "$1" | tail -n 1 | cut -c1-300
}

# run_check NAME COMMAND...: run COMMAND with its output in OUT/NAME.log and report the
# "PASS|FAIL|SKIP NAME: ..." line it printed last, or why it printed none.
run_check() {
  local name=$1
  shift
  local log="$OUT/$name.log" started=$SECONDS status line limit_name="TIMEOUT_${name^^}"
  local limit=${!limit_name:-$CHECK_TIMEOUT}
  timeout "$limit" "$@" >"$log" 2>&1
  status=$?
  line=$(grep -E "^(PASS|FAIL|SKIP) $name:" "$log" | tail -n 1)
  if [[ $status -eq 124 ]]; then
    line="FAIL $name: stopped after $limit s ($limit_name or CHECK_TIMEOUT; log: $log)"
  elif [[ -z $line || ($status -ne 0 && $line != FAIL*) ]]; then
    line="FAIL $name: exit status $status: $(last_line "$log") (log: $log)"
  fi
  report "$line [$((SECONDS - started)) s]"
}

# Inline rather than a file of its own: a few lines that only this script needs.
read -r -d '' DEVICE_REPORT <<'PY'
import platform, sys
from importlib import metadata

import torch, transformers
from device import select_platform

plat = select_platform(sys.argv[1])
try:
    trl = metadata.version("trl")
except metadata.PackageNotFoundError:
    trl = "not installed"
if plat.module is None:
    hardware = platform.processor() or platform.machine()
else:
    hardware = f"{plat.module.get_device_name(plat.local_rank)}, {plat.memory_bytes() / 2**30:.0f} GiB"
print(f"PASS device: {plat.device} ({hardware}), backend {plat.backend}; python {platform.python_version()}, "
      f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl}")
PY

smoke_check() {
  local log="$OUT/smoke.log" started=$SECONDS
  if timeout "$CHECK_TIMEOUT" "$PYTHON" smoke.py matmul >"$log" 2>&1 &&
    timeout "$CHECK_TIMEOUT" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 \
      smoke.py all_reduce >>"$log" 2>&1; then
    report "PASS smoke: a matmul on $(grep -m1 -o 'device=[^ ]*' "$log" | cut -d= -f2) and a 1-process all_reduce on \
$(grep -m1 -o 'backend=[^ ]*' "$log" | cut -d= -f2) give the host's sums [$((SECONDS - started)) s]"
  else
    report "FAIL smoke: $(last_line "$log") (log: $log) [$((SECONDS - started)) s]"
  fi
}

probe_options=(--layers "$PROBE_LAYERS")
[[ $PROBE_SMALL == 1 ]] && probe_options+=(--small)

echo "accelerator_check: DEVICE=$DEVICE STEPS=$STEPS PROBE_LAYERS=$PROBE_LAYERS PROBE_SMALL=$PROBE_SMALL; runs and logs in $OUT"
run_check device "$PYTHON" -c "$DEVICE_REPORT" "$DEVICE"
smoke_check
run_check ipc "$PYTHON" bench/ipc_check.py --device "$DEVICE"
# 256 + 64 positions: every decode step attends over all 320 (kv_cache.attended_length), one step
# shape, so each compiled case compiles once.
decode_options=(--hidden 2048 --layers 4 --experts 64 --top_k 8 --moe_intermediate 768 --vocab 32768 --rows 32
  --prompt_len 256 --short 64 --rounds 5)
[[ $PROBE_SMALL == 1 ]] && decode_options=(--hidden 256 --layers 2 --experts 8 --top_k 2 --rows 4 --short 16
  --rounds 1)
run_check decode "$PYTHON" bench/decode.py --check --device "$DEVICE" "${decode_options[@]}"
run_check demo "$PYTHON" bench/demo_on_device.py --out "$OUT/demo" --device "$DEVICE" --steps "$STEPS"
run_check probe "$PYTHON" bench/probe_step.py --out "$OUT" --device "$DEVICE" --peak-tflops "$PEAK_TFLOPS" \
  --rollout-compile "$PROBE_COMPILE" "${probe_options[@]}"
if [[ -f $OUT/probe/probe.json ]]; then
  run_check trl "$PYTHON" bench/probe_trl.py --out "$OUT" --device "$DEVICE"
else
  report "SKIP trl: no probe model was built (see the probe line)"
fi
echo "accelerator_check: $failures of $checks checks failed"
exit $((failures > 0))
