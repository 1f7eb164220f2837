# clawrl for GPU machines: CUDA PyTorch, then clawrl with its runtime extras; nothing else.
#
#   docker build -t clawrl .
#   docker run --gpus all --shm-size=16g -v "$PWD":/workspace clawrl train --hf-checkpoint /workspace/model ...
#
# --shm-size: Ray keeps its object store in /dev/shm, which Docker limits to 64 MB by default.
# Other CUDA versions: --build-arg CUDA_IMAGE=nvidia/cuda:<tag> --build-arg TORCH_INDEX=<matching wheel index>.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=all
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# gcc, libc6-dev and python3-dev: Triton compiles a small C launcher for the engine's kernels at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CUDA wheel index, so that installing clawrl keeps this build.
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install "torch>=2.11" --index-url "$TORCH_INDEX"

WORKDIR /opt/clawrl
COPY pyproject.toml README.md ./
COPY clawrl ./clawrl
RUN pip install ".[${EXTRAS}]"

WORKDIR /workspace
ENTRYPOINT ["clawrl"]
CMD ["--help"]
