# Two entry points on a fresh Debian 12 machine (as root, or with sudo for apt-get):
#   make demo   sets everything up, runs the main job and verifies its bundle
#   make test   sets everything up and runs the tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
APT_PACKAGES := bubblewrap iproute2 dnsmasq-base qemu-system-x86 busybox-static e2fsprogs mmdebstrap chromium unzip postgresql fontconfig
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test system venv bench clean

system:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The package's modules compiled, as a non-editable pip install has them: with PYTHONDONTWRITEBYTECODE set (as on
# these machines) a kernel start would otherwise compile every tkbox_nb module twice, on the host and in the box.
venv: system $(VENV)/.installed
	@$(PY) -m compileall -q tkbox_nb

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) -m tkbox_nb.cli.demo

bench: venv
	$(PY) -m bench

clean:
	rm -rf $(VENV) out
