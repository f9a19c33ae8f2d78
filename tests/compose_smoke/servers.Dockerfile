# The compose smoke's stand-ins for images no registry serves here (redis, etcd, Prometheus):
# the same servers from Debian's own packages on the local base image. Not for production; the
# compose file names the upstream images, and the smoke's override swaps only the image.
#   docker build -f tests/compose_smoke/servers.Dockerfile --network host \
#     --build-arg BASE=llmesh-smoke/python:3.11-bookworm --target redis -t llmesh-smoke/redis .
ARG BASE
# Redis as the official image runs it: protected mode off (that image builds redis-server so; the
# compose file keeps Redis on an internal network instead), data in /data.
FROM ${BASE} AS redis
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data \
 && printf '#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n' > /usr/local/bin/redis-server \
 && chmod 755 /usr/local/bin/redis-server
WORKDIR /data
USER redis

FROM ${BASE} AS etcd
RUN apt-get update && apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/*

# Prometheus as the upstream image runs it: the binary is the entrypoint (compose gives only
# flags), data under the working directory (Debian's build defaults to /var/lib/prometheus),
# wget for the healthcheck.
FROM ${BASE} AS prometheus
RUN apt-get update && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
WORKDIR /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus", "--storage.tsdb.path=/prometheus/data"]
