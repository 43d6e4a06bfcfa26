# OS task: the Debian rootfs every bwrap sandbox overlays (built once by mmdebstrap, ~300 MB, cached
# under ~/.cache/jetrl/data/os or $(JETRL_DATA)/os); `packages` adds npm; `docker` builds the images.
.PHONY: setup-os setup-os-packages setup-os-docker

OS_DATA_ARG = $(if $(JETRL_DATA),--env.data_dir=$(JETRL_DATA),)

setup-os: venv
	@command -v bwrap >/dev/null && command -v mmdebstrap >/dev/null || \
		(apt-get update -q && apt-get install -y -q bubblewrap mmdebstrap)
	$(BIN)/python -m services.envs.os_task.setup default $(OS_DATA_ARG)

setup-os-packages: setup-os
	$(BIN)/python -m services.envs.os_task.setup packages $(OS_DATA_ARG)

# FROM ubuntu:22.04 where it can be pulled, else FROM the Debian base image setup-docker builds
setup-os-docker: venv setup-docker
	$(BIN)/python -m services.envs.os_task.setup docker
