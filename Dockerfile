# The image the chart and the operator name by default (engines, routers and the operator):
#   docker build -t ghcr.io/splitserve/splitserve:0.1.0 .
# CUDA runtime base (Mooncake's CUDA wheel needs libcudart 12; torch brings its own CUDA
# libraries). Installs exactly what `scripts/install.sh --cuda` installs.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 python3-venv libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHON=/opt/venv/bin/python PIP_NO_CACHE_DIR=1

WORKDIR /opt/splitserve
COPY . .
RUN scripts/install.sh --cuda

# The chart runs the operator as 65532 with a read-only root; engines write their caches here.
ENV HOME=/tmp
USER 65532:65532
ENTRYPOINT ["splitserve"]
CMD ["--help"]
