"""`make compose-smoke`: the compose mesh (deploy/compose/compose.yaml) built and run for real.

Every llmesh image is built from deploy/docker/Dockerfile, the one users build; where no registry
is reachable the build gets a local Debian base image and a wheelhouse served on 127.0.0.1 through
build arguments (PYTHON_IMAGE, PIP_NO_INDEX, PIP_FIND_LINKS). An override file swaps only the
upstream images that cannot be pulled for local stand-ins (Debian's redis-server, etcd and
prometheus packages), runs etcd discovery where no Consul image exists and leaves out Grafana and
Jaeger when they have no image; the smoke prints each swap. Then it checks the running mesh from
the host and prints one pass/fail line per check, `N passed, M failed`, and exits non-zero on any
failure. docs/testing.md and docs/deploy.md describe it.

    python -m tests.compose_smoke [--keep-going] [--no-down]
"""
