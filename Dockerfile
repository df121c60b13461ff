# The one EaaS image: operator, expert server and attention client (`eaas ...`).
# Build: docker build -t ghcr.io/eaas-project/eaas:0.1.0 .
# PyPI's default torch wheel is the CUDA build, so the same image runs on CPU and GPU nodes.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*   # Triton compiles its launcher with a C compiler
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
RUN useradd --uid 65532 --create-home eaas
USER 65532
ENTRYPOINT ["eaas"]
