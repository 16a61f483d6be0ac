# hotlock's commands. `make test` is what CI runs (.ci/run): it installs what a fresh
# Debian/Ubuntu machine lacks, builds the extension (required), starts its own Redis
# (tests/conftest.py) and runs the whole suite.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# apt-get needs root; use sudo when we are not root and it exists.
SUDO   := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
APT_PACKAGES := redis-server redis-sentinel redis-tools libhiredis-dev pkg-config gcc openssl

.PHONY: deps venv compile test test-slow test-pure lint bench demo clean

# System packages, only when something is missing (so a warm machine pays nothing).
deps:
	@missing=""; \
	for cmd in redis-server redis-sentinel redis-cli pkg-config gcc openssl; do \
	  command -v $$cmd >/dev/null 2>&1 || missing=1; done; \
	pkg-config --exists hiredis 2>/dev/null || missing=1; \
	if [ -n "$$missing" ]; then \
	  echo "installing $(APT_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel Cython
	$(PY) -m pip install -q -e ".[test]" --no-build-isolation
	touch $@

venv: deps $(VENV)/.installed

# Builds hotlock._native in place; a failed build is an error here, never a silent fallback.
compile: venv
	HOTLOCK_REQUIRE_EXTENSIONS=1 $(PY) setup.py -q build_ext --inplace

# The long fault and soak runs (marked slow) have short forms that run here; test-slow runs them whole.
# Every server-facing test runs on Redis and on Valkey (tests/conftest.py): two workers (-n 2,
# pytest-xdist, each with its own servers) keep that within the time one server used to take.
test: compile
	HOTLOCK_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -n 2 -m "not slow"

test-slow: compile
	HOTLOCK_REQUIRE_EXTENSIONS=1 $(PY) -m pytest -q -m slow

# The same suite with the extension switched off at run time: the pure-Python mode.
test-pure: venv
	HOTLOCK_PURE_PYTHON=1 $(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

bench: compile
	$(PY) -m pip install -q -e ".[bench]" --no-build-isolation
	$(PY) -m bench
	# Server CPU per extend/release, script path against Lua-free, on Redis and on Valkey.
	$(PY) -m bench.dialect

demo: venv
	-@$(MAKE) -s compile >/dev/null 2>&1 || echo "demo: the native extension did not build; running on redis-py"
	$(PY) examples/settle_invoices.py

clean:
	rm -rf build dist src/*.egg-info src/hotlock/*.so ext/*.c ext/*.html .pytest_cache .mypy_cache .ruff_cache
