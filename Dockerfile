# syntax=docker/dockerfile:1.7
# pdfleet images: the operator, and the worker (engine, server and router) built once per platform.
#
#   docker build --target operator -t REG/pdfleet-operator:0.1.0 .
#   docker build --target worker -t REG/pdfleet-worker:0.1.0-cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .      # CPU torch
#   docker build --target worker -t REG/pdfleet-worker:0.1.0-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .    # NVIDIA's CUDA torch
#   docker build --target vendor -t REG/pdfleet-worker:0.1.0-npu \
#       --build-arg VENDOR_BASE=<an image with Python 3.11, torch and torch_npu on CANN> .
#
# `make images` runs these (docs/cluster.md): the tag's -<platform> suffix is what the operator checks
# against each AcceleratorClass (decide/worker_images.py). The install steps are the ones CI runs (pip with
# -c constraints.txt and the extras), so the versions in an image are the versions the test suite passed
# with. No image is built in CI: the development machines have no Docker engine.

ARG PYTHON_VERSION=3.11
# The vendors' builds start from the vendor's own PyTorch image, which carries the bridge and the userland it
# needs: torch_npu on CANN (Ascend), torch_mlu on Neuware (Cambricon), DTK's torch (Hygon).
ARG VENDOR_BASE=python:3.11-slim-bookworm

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

# --- torch: the worker's Python environment, torch from TORCH_INDEX_URL (CPU or CUDA wheels) --------
FROM base AS torch
# torch is installed first, from that index, at the version constraints.txt pins; the rest then resolves
# against it.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# TCMALLOC=1 (make images passes it for the cpu image only) installs Debian's tcmalloc, which the worker stage
# preloads: what `pdfleet up` gives CPU workers (1.04-1.12x a CPU worker's tokens/s under `vllm bench serve`,
# bench/HISTORY.md, fifteenth session) and what vLLM's CPU docs preload. GPU workers were not measured with it.
ARG TCMALLOC=
RUN if [ -n "$TCMALLOC" ]; then apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
        && rm -rf /var/lib/apt/lists/*; fi
RUN pip install --index-url "${TORCH_INDEX_URL}" "$(grep '^torch==' constraints.txt)" \
    && pip install -c constraints.txt '.[worker]'

# --- kernels: the CPU kernels compiled ahead of time, one library per ISA level (the only stage with g++) ----
FROM torch AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && python -m pdfleet_worker.layers.prebuilt_kernels build /opt/pdfleet/kernels

# --- worker: engine, server and router on the torch above, with the prebuilt kernels and no compiler ----------
FROM torch AS worker
COPY --from=kernels /opt/pdfleet/kernels /opt/pdfleet/kernels
# HF/torch caches under /tmp: the root filesystem is read-only in the chart's pods; the kernels come prebuilt.
ENV HF_HOME=/tmp/hf TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PDFLEET_KERNEL_DIR=/opt/pdfleet/kernels
# tcmalloc in every process of a TCMALLOC=1 image, by soname (a pod turns it off with LD_PRELOAD=""); the build fails
# when the library it names did not load.
ARG TCMALLOC=
ENV LD_PRELOAD=${TCMALLOC:+libtcmalloc_minimal.so.4}
RUN python -m pdfleet_worker.layers.prebuilt_kernels check /opt/pdfleet/kernels \
    && ! command -v g++ \
    && { [ -z "$LD_PRELOAD" ] || grep -q libtcmalloc_minimal /proc/self/maps; }
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
ENTRYPOINT ["pdfleet"]
CMD ["worker", "--help"]

# --- vendor: the worker on the vendor's PyTorch image (its torch and bridge kept: no torch from PyPI) ---------
FROM ${VENDOR_BASE} AS vendor
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/tmp/hf TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
WORKDIR /opt/pdfleet
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY workers ./workers
# The worker extra without its torch pin (the base's torch drives the device), then pdfleet itself.
RUN grep -v '^torch==' constraints.txt > /tmp/constraints-vendor.txt \
    && python -m pip install -c /tmp/constraints-vendor.txt '.[router]' safetensors tokenizers jinja2 llguidance \
    && python -m pip install --no-deps . \
    && python -c "import torch, pdfleet_worker.cli; print('torch', torch.__version__)"
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["pdfleet"]
CMD ["worker", "--help"]
