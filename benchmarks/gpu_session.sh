#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no Triton, no network there): install the checkout
# offline, then kernel numerics + bandwidth, the engine vs transformers+peft on CUDA, and the
# multi-LoRA throughput. Everything lands in $OUT. Usage (device tool): bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/loraplex-gpu-out}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "install failed (see install.log)"
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "exit $?" >> "$OUT/$name.txt"
  tail -n 25 "$OUT/$name.txt"
}
run engine_check 90 python3 benchmarks/engine_check.py --device cuda --json "$OUT/engine_check.json"
run engine_check_eager 70 python3 benchmarks/engine_check.py --device cuda --eager --json "$OUT/engine_check_eager.json"
run gpu_kernels 220 python3 benchmarks/gpu_kernels.py --budget-s 160 --out "$OUT/gpu_kernels.json"
run step_host_time 45 python3 benchmarks/step_host_time.py --seqs 256 --steps 30
run step_host_time_eager 45 python3 benchmarks/step_host_time.py --seqs 256 --steps 30 --eager
run lora_throughput 100 python3 benchmarks/lora_throughput.py --device cuda --hidden 2048 --intermediate 5632 \
    --layers 8 --heads 16 --kv-heads 16 --batch 64 --max-tokens 64 --json "$OUT/lora_throughput.json"
