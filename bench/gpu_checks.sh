#!/usr/bin/env bash
# The measurements worth a lent GPU, in one run (about 8 minutes on one H200), each step bounded:
#   document-masked attention (flex vs explicit mask vs causal), training throughput against a plain
#   loop (bench model and a 1.5B model, bf16), and an end-to-end `shardwise train` on the Chinese
#   demo (prepare, document masks through flex attention, checkpoint, eval) on CUDA.
# Usage: bash bench/gpu_checks.sh OUT_DIR   (python3 must have torch with CUDA; pydantic etc. importable)
set -uo pipefail
out=${1:?usage: bench/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SHARDWISE_CACHE=/tmp/shardwise-cache
step() { local name=$1 limit=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$limit" "$@" > "$out/$name.json" 2> "$out/$name.err"; echo "rc=$? $(tail -c 600 "$out/$name.json")"; tail -n 3 "$out/$name.err"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step attn_bench_llama 90 python3 bench/document_attention.py --preset bench_llama --seq-length 4096 --batch 8 --doc-length 300
step attn_qwen2_1.5b 110 python3 bench/document_attention.py --preset qwen2_1.5b --seq-length 4096 --batch 2 --doc-length 300
step throughput_bench_llama 90 python3 bench/train_throughput.py bench/bench_llama.yaml --no-memory --rounds 2 --steps 10 \
  --set optimize.mixed_precision=bf16 --set data.seq_length=2048 --set train.micro_batch_size=16
step throughput_qwen2_1.5b 150 python3 bench/train_throughput.py bench/bench_llama.yaml --no-memory --rounds 2 --steps 5 \
  --set model.preset=qwen2_1.5b --set optimize.mixed_precision=bf16 --set data.seq_length=2048 --set train.micro_batch_size=8
echo "=== e2e demo_zh on cuda ($(date +%T))"
timeout 120 python3 -m shardwise.cli train configs/demo_zh.yaml --set run.device=cuda --set train.max_steps=300 \
  --set train.micro_batch_size=64 --set train.progress_bar=false --set train.output_dir=/tmp/demo_zh \
  --set train.eval_steps=150 --set train.save_steps=300 > "$out/e2e.log" 2>&1; echo "rc=$?"
tail -n 8 "$out/e2e.log"
