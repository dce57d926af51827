#!/usr/bin/env bash
# Pack what the GPU machine lacks to run Triton (decision 058): the nvidia-pytriton wheel's tritonserver,
# its Python backend and the stub for the GPU machine's Python, the bundled libraries they link (ldd), and
# a NumPy 1 wheel for the stub's environment (the 24.10 stub's pybind11 misreads NumPy 2's dtypes).
# Writes $OUT_FILE, default .cache/gpu-carry/triton-gpu.tar.xz (about 43 MB), and beside it wheels/: what the
# engine's structured outputs need that the GPU machine lacks (xgrammar, tvm-ffi, pydantic; jsonschema for the
# tests; about 8 MB, versions as constraints.txt and the Makefile pin them; gpu_session.sh installs them).
# Carry .cache/gpu-carry with the device tool.
# Usage: bash benchmarks/triton_gpu_bundle.sh [python tag of the GPU machine, default 3.12]
set -euo pipefail
TAG=${1:-3.12}
VPY=${VPY:-.venv/bin/python}
SITE=$($VPY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ROOT=$SITE/pytriton/tritonserver
LIBS=$SITE/nvidia_pytriton.libs
OUT_FILE=${OUT_FILE:-.cache/gpu-carry/triton-gpu.tar.xz}
STAGE=$(mktemp -d /tmp/loraplex-triton-bundle-XXXX)
trap 'rm -rf "$STAGE"' EXIT
[[ -x $ROOT/bin/tritonserver && -f $ROOT/python_backend_stubs/$TAG/triton_python_backend_stub ]] || {
  echo "no tritonserver or no stub for Python $TAG under $ROOT (run make setup)" >&2; exit 2; }

# the tree find_triton() knows (pytriton layout): <pkg>/tritonserver/... beside <pkg>/../nvidia_pytriton.libs
mkdir -p "$STAGE/site/pytriton/tritonserver/python_backend_stubs" "$STAGE/site/nvidia_pytriton.libs" "$STAGE/wheels"
cp -a "$ROOT/bin" "$ROOT/backends" "$ROOT/caches" "$STAGE/site/pytriton/tritonserver/"
cp -a "$ROOT/python_backend_stubs/$TAG" "$STAGE/site/pytriton/tritonserver/python_backend_stubs/"
LD_LIBRARY_PATH=$LIBS ldd "$ROOT/bin/tritonserver" "$ROOT/backends/python/libtriton_python.so" \
    "$ROOT/python_backend_stubs/$TAG/triton_python_backend_stub" "$ROOT/caches/local/libtritoncache_local.so" \
  | awk '$3 ~ /nvidia_pytriton.libs/ {print $3}' | xargs -r readlink -f | sort -u | xargs -r cp -L -t "$STAGE/site/nvidia_pytriton.libs/"
$VPY -m pip download -q numpy==1.26.4 --only-binary :all: --python-version "$TAG" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --no-deps -d "$STAGE/wheels"
mkdir -p "$(dirname "$OUT_FILE")"
tar -C "$STAGE" -cJf "$OUT_FILE" site wheels
du -h "$OUT_FILE"
WHEELS=$(dirname "$OUT_FILE")/wheels
rm -rf "$WHEELS" && mkdir -p "$WHEELS"
$VPY -m pip download -q --no-deps --only-binary :all: --python-version "$TAG" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -c constraints.txt -d "$WHEELS" \
    "$(sed -n "s/^XGRAMMAR := '\(.*\)'/\1/p" Makefile)" apache-tvm-ffi pydantic pydantic-core annotated-types \
    typing-inspection typing-extensions jsonschema jsonschema-specifications referencing rpds-py
du -sh "$WHEELS"
