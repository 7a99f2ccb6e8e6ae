#!/usr/bin/env bash
# The measurements worth a lent GPU, in one bounded run (at most about 9 minutes on one H200, each step
# under its own timeout), for the open issues:
#   issue 14: tokens/s and MFU of a 1.5B LLaMA-architecture model (qwen2_1.5b) at sequence 4096, bf16, against
#             the plain loop in the same process: eager, compiled (both sides), float8 (compiled, both sides);
#             a profiler summary of a compiled step (device busy share, top operators, host waits per step);
#             an asynchronous checkpoint of FSDP2 shards (pinned staging); the pinned loader and compiled flex
#             attention over changing shapes.
#   issue 13: max_memory_allocated / max_memory_reserved against the estimate on several configurations;
#             offload_params on one device (losses against the plain path, pinned host state).
#   issue 16: train.profile on CUDA (kernels in the trace, a memory snapshot, the summary's shares).
#   issue 26: a MoE block's experts in bf16: torch._grouped_mm against the padded fallback and the per-expert loop.
# Usage: bash bench/gpu_checks.sh OUT_DIR [STEP,STEP,...]   (run from the repository's root; python3 with CUDA torch;
# the second argument reruns only the named steps). A machine without a package registry gets the packages it
# lacks as wheels: bench/gpu_wheels.sh puts them in .whl/ (SHARDWISE_WHEELS names another folder), carried along,
# and they are installed under /tmp/site first. The run stops at once when shardwise does not import.
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT_DIR [STEP,...]}
only=${2:-}
wheels=${SHARDWISE_WHEELS:-.whl}
mkdir -p "$out"
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
    || { echo "installing the wheels in $wheels/ failed"; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SHARDWISE_CACHE=/tmp/shardwise-cache
python3 -c "import shardwise.train.trainer" || {
  echo "shardwise does not import here (above: the missing module); where pip works, run bench/gpu_wheels.sh and carry .whl/"
  exit 2; }
step() {
  local name=$1 limit=$2; shift 2
  if [[ -n "$only" && ",$only," != *",$name,"* ]]; then return; fi
  echo "=== $name ($(date +%T), at most ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.json" 2> "$out/$name.err"
  echo "rc=$? $(tail -c 900 "$out/$name.json")"; tail -n 3 "$out/$name.err"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -c "import torchao.float8, torchao; print('torchao', torchao.__version__)" || echo "no torchao: the float8 row will be refused"
# log_steps 10: the trainer reads its figures one step late (no sync in the step); the plain loop reads its loss every step.
model=(--set model.preset=qwen2_1.5b --set optimize.mixed_precision=bf16 --set data.seq_length=4096
       --set train.micro_batch_size=2 --set train.log_steps=10)
step throughput_bf16_eager 60 python3 bench/train_throughput.py bench/bench_llama.yaml --no-memory --rounds 2 --steps 3 \
  "${model[@]}" --set run.compile=false --plain-compile off
step throughput_bf16_compiled 100 python3 bench/train_throughput.py bench/bench_llama.yaml --no-memory --rounds 2 --steps 3 \
  --warmup 2 "${model[@]}" --set run.compile=true --plain-compile on
step throughput_float8_compiled 100 python3 bench/train_throughput.py bench/bench_llama.yaml --no-memory --rounds 2 --steps 3 \
  --warmup 2 "${model[@]}" --set run.compile=true --set optimize.float8=true --plain-compile on
step memory_vs_estimate 100 python3 bench/gpu_memory.py --steps 3
step step_profile 40 python3 bench/step_profile.py bench/bench_llama.yaml "${model[@]}" --set run.compile=true \
  --steps 8 --trace "$out/step_trace.json"
step moe_grouped_mm 15 python3 bench/moe_grouped_mm.py --dtype bf16 --tokens 16384 --rounds 9
step offload_params_cuda 45 python3 tests/train/offload_params_cuda.py
step async_save_cuda 30 python3 tests/checkpoint/async_save_cuda.py /tmp/async_save_cuda
step input_shapes_cuda 50 python3 tests/models/input_shapes_cuda.py --parts loader,kernels
step profile_cuda 30 python3 tests/train/profile_cuda.py /tmp/profile_cuda
echo "=== done ($(date +%T))"
