# Loraplex GPU image on NVIDIA's Triton container (Python backend, CUDA 12).
#   docker build -t loraplex .
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 -v /models/llama:/model loraplex \
#       loraplex-serve --model-dir /model
# Without --model-dir the offline demo model is built on first start (CPU-sized, for smoke tests).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/loraplex
COPY pyproject.toml README.md ./
COPY backend backend
COPY kernels kernels
COPY clients clients
COPY model_repository model_repository

# The container's Python runs the Python-backend stub; the pinned torch comes from PyPI's default
# index here as its CUDA build. numpy<2 because the container's stub predates NumPy 2.
RUN pip install --no-cache-dir -e '.[test]' 'cupy-cuda12x<14'

ENV LORAPLEX_TRITON_ROOT=/opt/tritonserver
EXPOSE 8000 8001 8002
CMD ["loraplex-serve"]
