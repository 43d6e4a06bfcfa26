# Docker: `setup-docker` installs Debian's engine and compose v2 where missing, starts dockerd when none runs,
# builds the base image from Debian where python:3.11-slim cannot be pulled, the host-built wheelhouse and the
# NATS image (scripts/docker_setup.sh; a second run takes seconds). `test-compose` runs the compose cluster for
# real (each replica its own NATS user, every attack road of tests/system/attack_roads.py refused while it
# trains), and the 3-node NATS cluster with a node killed mid-run (tests/system/test_compose_run.py, ~6 min on a
# quiet machine), and skips with the reason where no engine can run;
# `setup-os-docker` (mk/os.mk) builds the OS task's images on the same base.
.PHONY: setup-docker test-compose

DOCKER_STATE ?= $(or $(JETRL_CACHE),$(HOME)/.cache/jetrl)/docker

setup-docker:
	DOCKER_STATE=$(DOCKER_STATE) scripts/docker_setup.sh

test-compose: venv
	@DOCKER_STATE=$(DOCKER_STATE) scripts/docker_setup.sh >/dev/null \
		|| echo "warning: make setup-docker failed; the compose test will skip if no engine answers"
	set -a; [ -f $(DOCKER_STATE)/images.env ] && . $(DOCKER_STATE)/images.env; set +a; \
		JETRL_COMPOSE_TEST=1 $(BIN)/python -m pytest -q -ra -s tests/system/test_compose_run.py
