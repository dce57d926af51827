#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no network there; Triton from the carried bundle): install the
# checkout offline, then the engine vs transformers+peft on CUDA (decode graphs, eager, the tiled prefill
# kernel; syncs per step counted), Triton on the GPU, kernel numerics + bandwidth, the 8B roofline, every
# model family's and MoE's paths and the attention and quantized kernels exact on CUDA, the loop's host
# time per step, the multi-LoRA throughput and tests/engine (its engines on the default device run on CUDA).
# Stages run in order of importance under one deadline (SESSION_S, default 480 s): a stage gets at most its
# own cap and what is left; one that fails or times out does not stop the rest. The goals' figures come
# first (engine_check, triton_gpu, gpu_kernels, decode_roofline), then the new paths' exactness.
# $OUT gets two files, both kept current after every stage (the device tool brings back at most 8):
# session.log (everything printed) and results.tgz (each stage's output and JSON). STAGES (names,
# space-separated) runs only those stages.
# Usage (device tool, carry [".cache/gpu-carry"] after `bash benchmarks/triton_gpu_bundle.sh` here):
#   SESSION_S=480 [STAGES="engine_check gpu_kernels"] bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/loraplex-gpu-out}
WORK=$(mktemp -d /tmp/loraplex-gpu-XXXX)
DEADLINE=$(( $(date +%s) + ${SESSION_S:-480} ))
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1
# results.tgz: the stages' outputs and JSON; a file over 2 MB stays out (the tool brings back 16 MiB a file)
bundle() { (cd "$WORK" && find . -type f -size -2M -print0 | tar czf "$OUT/results.tgz" --null -T -) ; }

nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1
python3 -m pip install --no-deps --no-build-isolation -e . > "$WORK/install.log" 2>&1 || echo "install failed (see install.log)"
if ! python3 -c "import loraplex.engine.llm_engine" 2>> "$WORK/install.log"; then  # the engine needs no loraplex.clients
  mkdir -p "$WORK/src" && ln -sfn "$PWD/backend" "$WORK/src/loraplex"
  export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
  echo "editable install unusable: importing loraplex from $WORK/src (a link to backend/)"
fi
# structured outputs' packages the machine lacks (xgrammar, pydantic, ...), carried as wheels by triton_gpu_bundle.sh
WHEELS=${WHEELS:-.cache/gpu-carry/wheels}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=$(mktemp -d /tmp/loraplex-gpu-site-XXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl >> "$WORK/install.log" 2>&1 \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE" || echo "wheels from $WHEELS did not install (see install.log)"
fi
python3 - <<'EOF' 2>&1 | tee "$WORK/versions.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "numpy", "cupy", "transformers", "peft", "xgrammar", "pydantic", "loraplex"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(module, "__file__", ""))
    except Exception as err:
        print(name, "unavailable:", err)
import torch
print("cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
EOF
bundle

run() {  # name, cap in seconds, command...
  local name=$1 cap=$2 left=$(( DEADLINE - $(date +%s) )); shift 2
  [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]] && return
  (( left < cap )) && cap=$left
  if (( cap < 15 )); then echo "=== $name skipped: ${left}s left"; return; fi
  echo "=== $name (at most ${cap}s)"
  local start=$(date +%s)
  timeout "$cap" "$@" > "$WORK/$name.txt" 2>&1
  echo "exit $? after $(( $(date +%s) - start ))s" >> "$WORK/$name.txt"
  tail -n 30 "$WORK/$name.txt"
  bundle
}
run engine_check 90 python3 benchmarks/engine_check.py --device cuda --json "$WORK/engine_check.json"
# Triton end to end on the GPU (decision 058): needs .cache/gpu-carry carried (benchmarks/triton_gpu_bundle.sh)
run triton_gpu 150 bash benchmarks/triton_gpu_stage.sh "$(mktemp -d /tmp/loraplex-triton-XXXX)" --device cuda --eager \
    --json "$WORK/triton_gpu.json"
run gpu_kernels 150 python3 benchmarks/gpu_kernels.py --budget-s 100 --batches 64 256 --contexts 1024 4096 \
    --ranks 16 64 --out "$WORK/gpu_kernels.json"
# Llama-3-8B's shapes (random bf16 weights, CUDA graphs) vs the HBM roofline: base, 8 and 32 adapters (decision 057)
run decode_roofline 120 python3 benchmarks/decode_roofline.py --batches 1 16 64 256 --adapters 0 8 32 \
    --json "$WORK/decode_roofline.json"
# issues 40 and 41 on CUDA, against the same oracles as on the CPU: every dense family (head_dim 256, soft-capping,
# sliding windows, ...) and MoE expert LoRA through the engine (LORAPLEX_TEST_DEVICE, tests/support/exactness.py);
# then the attention kernels with windows, caps and head_dim 256, the FP8 / INT4 linear kernels, and an FP8 base with
# LoRA and base rows in one captured CUDA graph (the SGLang case), each against its reference
EXACT_TESTS=(tests/engine/test_families.py tests/engine/test_moe.py tests/engine/test_sliding_window.py
             tests/engine/test_window_kv.py)
run exact_paths 120 env LORAPLEX_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider "${EXACT_TESTS[@]}"
run cuda_kernel_tests 90 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_attention_variants.py \
    tests/kernels/test_quant_kernels.py
# issue 41 (decision 073): the FP8 / INT4 linear kernels' figures at 8B shapes
run quant_gemm 150 python3 benchmarks/quant_gemm.py --budget-s 120 --batches 1 16 64 256 --json "$WORK/quant_gemm.json"
run engine_check_eager 60 python3 benchmarks/engine_check.py --device cuda --eager --json "$WORK/engine_check_eager.json"
run engine_check_prefill_kernel 60 env LORAPLEX_PREFILL_ATTENTION=kernel \
    python3 benchmarks/engine_check.py --device cuda --json "$WORK/engine_check_prefill_kernel.json"
run step_host_time 45 python3 benchmarks/step_host_time.py --seqs 256 --steps 30
run step_host_time_profile 45 python3 benchmarks/step_host_time.py --seqs 256 --steps 30 --profile
run step_host_time_eager 45 python3 benchmarks/step_host_time.py --seqs 256 --steps 30 --eager
run lora_throughput 150 python3 benchmarks/lora_throughput.py --device cuda --hidden 2048 --intermediate 5632 \
    --layers 8 --heads 16 --kv-heads 16 --batch 64 --max-tokens 64 --adapters 8,32 --repeats 1 \
    --json "$WORK/lora_throughput.json"
# issue 42 (decision 078): routing_sim.py's costs on the GPU (step by batch and adapters, slot loads, reads); then
# `routing_sim.py --costs <it> --knee --policies ...` here re-decides the ring's hash_balance_factor and the goal
run routing_costs 120 python3 benchmarks/routing_costs.py --rounds 2 --out "$WORK/routing_costs_cuda.json"
# the other engine tests as they are: those on the default device run on CUDA there (graphs, swap, containment, ...)
run engine_tests 150 python3 -m pytest -q -p no:cacheprovider tests/engine "${EXACT_TESTS[@]/#/--ignore=}"
echo "=== issue 43's goals from what ran (benchmarks/gpu_goals.py)"
python3 benchmarks/gpu_goals.py "$WORK" > "$WORK/goals.md" 2>&1; cat "$WORK/goals.md"
bundle
echo "=== done, $(( DEADLINE - $(date +%s) ))s before the deadline"
sleep 1  # let tee write the last lines before the tool collects $OUT
