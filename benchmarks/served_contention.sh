#!/usr/bin/env bash
# The CPU path under contention through Triton (issue 34, decision 056): make serve's server (SmolLM2), one
# HTTP generate of 16 greedy tokens at a time, 3 rounds of quiet then beside one spinning process, one server per
# OpenMP wait policy: old (libgomp's default spin), new (PASSIVE, what loraplex-serve sets), spinN (GOMP_SPINCOUNT=N).
# Usage: [POLICIES="old new spin20000"] bash benchmarks/served_contention.sh   (ports 18200-18202)
cd "$(dirname "$0")/.."
req() { python3 - <<'PY'
import json, time, urllib.request
b = json.dumps({"text_input": "Write a short poem about the sea.", "parameters": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}}).encode()
t = time.perf_counter()
urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:18200/v2/models/lora_llm/generate", data=b)).read()
print(f"{16 / (time.perf_counter() - t):.1f}")
PY
}
for policy in ${POLICIES:-old new}; do
  case $policy in old) export OMP_WAIT_POLICY=""; unset GOMP_SPINCOUNT;; new) unset OMP_WAIT_POLICY GOMP_SPINCOUNT;; spin*) export OMP_WAIT_POLICY="" GOMP_SPINCOUNT=${policy#spin};; esac
  setsid .venv/bin/loraplex-serve --http-port 18200 --grpc-port 18201 --metrics-port 18202 --adapter-store /tmp/sc-store > /tmp/sc-$policy.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf localhost:18200/v2/health/ready >/dev/null && break; sleep 1; done
  req >/dev/null; req >/dev/null
  q=(); b=()
  for r in 1 2 3; do
    q+=($(req))
    python3 -c 'while True: pass' & sp=$!; sleep 0.5
    b+=($(req)); kill $sp; wait $sp 2>/dev/null; sleep 0.5
  done
  echo "$policy quiet ${q[*]} busy ${b[*]}"
  kill -TERM -- -$pid; wait $pid 2>/dev/null; sleep 3
done
