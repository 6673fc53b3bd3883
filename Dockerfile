# syntax=docker/dockerfile:1.7
# pdfleet images: one Dockerfile, two targets.
#
#   docker build --target operator -t pdfleet-operator:0.1.0 .
#   docker build --target worker   -t pdfleet-worker:0.1.0 .                     # CPU torch (default)
#   docker build --target worker   -t pdfleet-worker:0.1.0-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .    # CUDA torch
#
# The install steps are the ones CI runs (pip with -c constraints.txt and the extra), so the
# versions in an image are the versions the test suite passed with. No image is built in CI: the
# development machines have no Docker engine (see README, "Images").

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A fixed non-root user; the chart's securityContext runs as this uid with a read-only root fs.
RUN groupadd --gid 10001 pdfleet && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin pdfleet
WORKDIR /opt/pdfleet
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY workers ./workers

# --- operator: kopf + the Kubernetes client, no torch --------------------------------------------
FROM base AS operator
RUN pip install -c constraints.txt '.[operator]' \
    && python -c "import pdfleet_operator.cli, sys; assert 'torch' not in sys.modules"
USER 10001:10001
# `pdfleet operator` defaults: /metrics on 8080, /healthz on 8081; the Alertmanager receiver listens
# only when --alertmanager-port is given (the chart passes 9090, 8080 and 9443).
EXPOSE 8080 8081 9090 9443
ENTRYPOINT ["pdfleet", "operator"]

# --- worker: engine, server and router (torch) ----------------------------------------------------
FROM base AS worker
# CPU wheels by default; pass the CUDA wheel index to build the GPU image. torch is installed first,
# from that index, at the version constraints.txt pins; the rest then resolves against it.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "$(grep '^torch==' constraints.txt)" \
    && pip install -c constraints.txt '.[worker]'
USER 10001:10001
# HF/torch caches under /tmp: the root filesystem is read-only in the chart's pods.
ENV HF_HOME=/tmp/hf TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
ENTRYPOINT ["pdfleet"]
CMD ["worker", "--help"]
