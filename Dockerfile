# syntax=docker/dockerfile:1
# The one EaaS image: operator, expert server and attention client (`eaas ...`).
# Without Docker, `make image` / `make image VARIANT=cpu` build the same image from Debian's archive
# (image/build.sh; docs/install.md, "Container image"). With Docker (BuildKit):
#   docker build -t ghcr.io/eaas-project/eaas:0.1.0 .                          # cuda (default)
#   docker build --build-arg VARIANT=cpu -t ghcr.io/eaas-project/eaas:0.1.0-cpu .
# VARIANT=cuda: PyPI's torch, the CUDA build, with its nvidia-*/cuda-* wheels; runs on CPU and GPU nodes.
# VARIANT=cpu: torch's CPU build from PyTorch's index (PyPI's torch does not import without its
# nvidia-* wheels, so it cannot be slimmed by leaving them out).
# Base: Debian 12 (bookworm) and its python3 (3.11); gcc because Triton compiles its launcher.
# Both variants include the `nixl` extra (nixl-cu13, transport nixl; it starts without CUDA too).
# Licence terms of what ships, NIXL's NVIDIA-proprietary parts included: docs/install.md,
# "Container image".
ARG VARIANT=cuda
# VARIANT=cpu needs TORCH_CPU_INDEX: the URL of PyTorch's CPU wheel index (or a mirror of it).
ARG TORCH_CPU_INDEX=""

FROM debian:bookworm-slim AS base
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 eaas && useradd --uid 65532 --gid 65532 --create-home --shell /bin/sh eaas

FROM base AS build
ARG VARIANT
ARG TORCH_CPU_INDEX
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
COPY image/imagetool.py /usr/local/bin/
# The wheel and its dependencies (nixl extra included), pinned with their sha256, as image/build.sh
# does.
RUN if [ "$VARIANT" = cpu ] && [ -z "$TORCH_CPU_INDEX" ]; then \
        echo "VARIANT=cpu needs --build-arg TORCH_CPU_INDEX=<PyTorch's CPU wheel index>" >&2; exit 1; fi \
    && if [ "$VARIANT" = cpu ]; then export PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX"; fi \
    && python3 -m venv /opt/pip && /opt/pip/bin/pip install -q --upgrade pip \
    && /opt/pip/bin/pip wheel -q --no-deps --wheel-dir /dist . \
    && /opt/pip/bin/pip install -q --dry-run --ignore-installed --report /tmp/report.json \
        "$(ls /dist/eaas-*.whl)[nixl]" \
    && python3 /usr/local/bin/imagetool.py requirements --variant "$VARIANT" /tmp/report.json \
        > /dist/requirements.txt \
    && /opt/pip/bin/pip download -q --no-deps --dest /dist -r /dist/requirements.txt

FROM base
# Installed offline from the build stage's wheels, which stay out of every layer.
RUN --mount=type=bind,from=build,source=/dist,target=/tmp/dist \
    python3 -m venv /opt/eaas \
    && /opt/eaas/bin/pip install -q --no-cache-dir --no-index --no-deps --find-links /tmp/dist \
        --require-hashes -r /tmp/dist/requirements.txt \
    && /opt/eaas/bin/pip install -q --no-cache-dir --no-index --no-deps /tmp/dist/eaas-*.whl \
    && cp /tmp/dist/requirements.txt /opt/eaas/
ENV PATH=/opt/eaas/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/home/eaas
USER 65532:65532
WORKDIR /home/eaas
ENTRYPOINT ["eaas"]
