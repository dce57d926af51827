#!/usr/bin/env bash
# Triton on the GPU machine (decision 058), a stage of gpu_session.sh: unpack the carried bundle
# (benchmarks/triton_gpu_bundle.sh: tritonserver, the Python backend and stub, their libraries, a NumPy 1
# wheel), make a virtualenv over the machine's Python (--system-site-packages: its torch, transformers,
# peft) whose own NumPy 1 shadows the system's NumPy 2 (the stub's pybind11 needs NumPy 1; CuPy 14 does
# not import beside it, so the engine runs with LORAPLEX_KERNELS=reference: torch and SDPA on CUDA), then
# benchmarks/triton_gpu.py: the real loraplex-serve exact against peft, a concurrency run, the in-process
# ratio. Usage: bash benchmarks/triton_gpu_stage.sh WORKDIR [triton_gpu.py flags...]
# EXTRA_SITE (for a check on a machine whose torch lives in another virtualenv): a site-packages folder
# the new virtualenv adds after its own.
set -euo pipefail
WORKDIR=$1; shift
BUNDLE=${BUNDLE:-.cache/gpu-carry/triton-gpu.tar.xz}
PY=${PY:-python3}
[[ -f $BUNDLE ]] || { echo "no $BUNDLE: run benchmarks/triton_gpu_bundle.sh and carry .cache/gpu-carry" >&2; exit 2; }
mkdir -p "$WORKDIR"
tar -C "$WORKDIR" -xJf "$BUNDLE"
$PY -m venv --system-site-packages "$WORKDIR/venv"
SITE=$("$WORKDIR/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[[ -n ${EXTRA_SITE:-} ]] && echo "import site; site.addsitedir('$EXTRA_SITE')" > "$SITE/zz-extra-site.pth"
"$WORKDIR/venv/bin/python" -m pip install -q --no-deps --no-index "$WORKDIR"/wheels/numpy-1.*.whl
if ! "$WORKDIR/venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e . > "$WORKDIR/install.log" 2>&1; then
  echo "editable install failed (install.log); importing loraplex through a link"
  ln -sfn "$PWD/backend" "$SITE/loraplex"
  printf '#!%s\nfrom loraplex.launch.serve import main\nraise SystemExit(main())\n' "$WORKDIR/venv/bin/python" \
    > "$WORKDIR/venv/bin/loraplex-serve" && chmod +x "$WORKDIR/venv/bin/loraplex-serve"
fi
"$WORKDIR/venv/bin/python" -c "import numpy, torch, loraplex; print('stub env: numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
export LORAPLEX_TRITON_ROOT="$WORKDIR/site/pytriton" LORAPLEX_KERNELS=reference
exec "$WORKDIR/venv/bin/python" benchmarks/triton_gpu.py "$@"
