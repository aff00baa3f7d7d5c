# syntax=docker/dockerfile:1
# The image every Tandem pod runs (helm/tandem): CUDA runtime, Python, the CUDA build of
# PyTorch, NIXL with its bundled UCX (nixl-cu12 or nixl-cu13 to match the CUDA major version,
# plus the verbs libraries UCX needs for RDMA), and this package. The entrypoint is the
# `tandem` command; the chart passes the service:
#   tandem gateway|router|prefill|decode FLAGS    (flags fall back to TANDEM_* variables)
#
#   docker build -t ghcr.io/tandem-serving/tandem:0.1.0 .                  # CUDA 12.8
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 --build-arg NIXL=cu13 .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
      libibverbs1 ibverbs-providers librdmacm1 libnuma1 \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/tandem \
    PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv "$VIRTUAL_ENV"

# PyTorch first, from the CUDA index: installed after the package, pip would pick whatever build
# PyPI's default wheel is. Triton comes with it.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# FlashAttention 3 for Hopper GPUs (kernels.flash_attn: prefill and mixed steps): the one
# extension file of vLLM's wheel, which is built against one torch release (vLLM 0.26.0: torch
# 2.11, as above). Keep FA3_FROM in step with TORCH_VERSION; FA3_FROM="" leaves it out (Triton
# attention throughout; --attention-backend auto falls back by itself).
ARG FA3_FROM=vllm==0.26.0
RUN if [ -n "${FA3_FROM}" ]; then \
      pip download --no-deps --only-binary=:all: -d /tmp/fa3 "${FA3_FROM}" \
   && python3 -c "import glob, site, zipfile; w = zipfile.ZipFile(glob.glob('/tmp/fa3/*.whl')[0]); \
open(site.getsitepackages()[0] + '/_vllm_fa3_C.abi3.so', 'wb').write(w.read('vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so'))" \
   && rm -rf /tmp/fa3; fi

# The package (engine, kernels, libkv, services and the generated tandem.v1 API), not editable,
# with the NIXL build of the image's CUDA major version (the `cu12` / `cu13` extra).
ARG NIXL=cu12
COPY . /src
RUN pip install "/src[${NIXL}]" && rm -rf /src

# Unprivileged at run time; the model volume is mounted read-only, /dev/shm is an emptyDir.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin tandem
USER 1000:1000
WORKDIR /home/tandem

# gateway 8000 (HTTP), router 50051, prefill 50061, decode 50071 (gRPC), metrics 9400.
EXPOSE 8000 50051 50061 50071 9400
# SIGTERM (what Kubernetes sends) drains each service; see helm/tandem/README.md.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tandem"]
CMD ["--help"]
