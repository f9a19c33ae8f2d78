"""Issue 28's properties of a rendered Helm mesh, as functions that return a list of problems
(empty when all is well), so the tests run them on real renders and on broken copies:

- every address a service dials (its settings' `*_address`, the value the chart sets or else the
  setting's default) is a Service the render holds, on that service's gRPC port;
- every path a service writes (its state directory, the gateway's keys and audit log, the model
  manager's registry, artifact store and published models, an engine's model cache) is on a
  writable volume, and the model manager's on a PersistentVolumeClaim;
- a live-config edit reaches the pods without restarting them: no pod annotation carries the
  config's checksum, and the ConfigMap is mounted as a directory (the kubelet never updates a
  subPath mount);
- whenever KEDA scales engines, the series its query asks for is one the scheduler's own code
  exports for the render's live config;
- a gateway that may run more than one process has the shared key store (Redis, from a Secret);
- an Ingress or HTTPRoute sends its traffic to the gateway's HTTP port;
- every chart lints with `--strict` as a fresh clone holds it (no `helm dependency build`).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from pathlib import Path, PurePosixPath

from tests.deploy.checks import HELM_DIR, SERVICE_CHARTS, UMBRELLA, helm
from tests.deploy.values_schema import env_prefix, settings_classes

from llmesh.liveconfig.document import InvalidConfig, parse as parse_live_config
from llmesh.settings import MeshSettings

# The runtime images' WORKDIR (deploy/docker/Dockerfile): a relative path setting starts there.
IMAGE_WORKDIR = PurePosixPath("/var/lib/llmesh")
# What each service writes, by setting (a directory, or a file whose directory it writes); the
# mesh's state_dir for every service. None: the gateway's default under state_dir.
WRITES = {"gateway": {"keys_file": "keys.json", "audit_file": "audit.jsonl"},
          "modelmgr": {"model_dir": None, "store_dir": None, "database_url": None},
          "engine": {"model_dir": None}}
# Services whose state must outlive the pod: a PersistentVolumeClaim.
PERSISTENT = {"modelmgr": ("store_dir", "database_url")}
_LOOPBACK = ("127.", "localhost", "0.0.0.0", "::1", "[::1]")


def _deployments(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d.get("kind") == "Deployment"]


def _service_of(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def _main_container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _secret_env(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", []) if "valueFrom" in e}


def _setting(cls, env: dict[str, str], field: str):
    """What the service reads: the chart's value, else the settings class's default."""
    name = env_prefix(cls) + field.upper()
    if name in env:
        return env[name]
    return cls.model_fields[field].get_default(call_default_factory=True)


def _where(deployment: dict) -> str:
    return f"Deployment/{deployment['metadata']['name']}"


# --- addresses -----------------------------------------------------------------------------

def _services(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}


def _loopback(host: str) -> bool:
    return host.startswith(_LOOPBACK)


def address_problems(docs: list[dict], rendered_only: bool = True) -> list[str]:
    """Each `<target>_address` a service dials names a rendered Service that selects the target's
    pods, on its `grpc` port; with rendered_only False (a service chart alone), a name that is not
    the pod's own loopback. Consul and etcd, when used, are given an address off the pod."""
    services, classes, problems = _services(docs), settings_classes(), []
    for deployment in _deployments(docs):
        service, env = _service_of(deployment), _plain_env(_main_container(deployment))
        cls = classes[service]
        for field in sorted(f for f in cls.model_fields if f.endswith("_address") and f != "advertise_address"):
            value = _setting(cls, env, field)
            if not value:
                continue  # optional and off (the gateway without a cache)
            name = env_prefix(cls) + field.upper()
            said = f"{_where(deployment)}: {name}={value}" + ("" if name in env else " (unset: the default)")
            host, _, port = str(value).rpartition(":")
            target = field.removesuffix("_address")
            if _loopback(host):
                problems.append(f"{said} dials the pod's own loopback, not the {target}")
                continue
            if not rendered_only:
                continue
            svc = services.get(host.split(".")[0])
            if svc is None:
                problems.append(f"{said} dials no Service the chart renders")
                continue
            if (svc["spec"].get("selector") or {}).get("app.kubernetes.io/name") != target:
                problems.append(f"{said}: Service {host} does not select the {target}'s pods")
            grpc = [p["port"] for p in svc["spec"]["ports"] if p.get("name") == "grpc"]
            if not port.isdigit() or int(port) not in grpc:
                problems.append(f"{said}: port {port} is not the grpc port {grpc} of Service {host}")
        problems += _mesh_address_problems(deployment, env)
    return problems


def _mesh_address_problems(deployment: dict, env: dict[str, str]) -> list[str]:
    used = []
    discovery, backend = _setting(MeshSettings, env, "discovery"), _setting(MeshSettings, env, "config_backend")
    if discovery == "consul":
        used.append("consul_address")
    if "etcd" in (discovery, backend):
        used.append("etcd_address")
    problems = []
    for field in used:
        value = str(_setting(MeshSettings, env, field))
        if _loopback(value.split("://")[-1]):
            problems.append(f"{_where(deployment)}: LLMESH_{field.upper()}={value} dials the pod's own loopback")
    return problems


# --- written paths -------------------------------------------------------------------------

def _path_of(value) -> PurePosixPath | None:
    text = str(value)
    if text.startswith("sqlite:"):
        text = text.split(":///", 1)[-1]  # sqlite:///relative, sqlite:////absolute
    elif "://" in text:
        return None  # a database server (PostgreSQL), not a file
    path = PurePosixPath(text)
    return path if path.is_absolute() else IMAGE_WORKDIR / path


def written_paths(deployment: dict) -> dict[str, PurePosixPath]:
    """Setting name -> the directory the service writes for it."""
    container = _main_container(deployment)
    env, service = _plain_env(container), _service_of(deployment)
    state = _path_of(_setting(MeshSettings, env, "state_dir"))
    assert state is not None
    out = {"LLMESH_STATE_DIR": state}
    cls = settings_classes()[service]
    for field, default_name in WRITES.get(service, {}).items():
        name = env_prefix(cls) + field.upper()
        if name in _secret_env(container):
            continue  # from a Secret: a database server's URL
        value = _setting(cls, env, field)
        path = state / default_name if value is None and default_name else _path_of(value) if value else None
        if path is None:
            continue
        out[name] = path.parent if field.endswith(("_file", "_url")) else path
    return out


def _volume_under(deployment: dict, path: PurePosixPath) -> tuple[dict, dict] | None:
    """The (mount, volume) the path lies on: the deepest mount above it."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = [m for m in _main_container(deployment).get("volumeMounts", [])
              if path == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in path.parents]
    if not mounts:
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, volumes.get(mount["name"], {})


def write_path_problems(docs: list[dict]) -> list[str]:
    problems = []
    for deployment in _deployments(docs):
        service = _service_of(deployment)
        for name, path in written_paths(deployment).items():
            said = f"{_where(deployment)}: {name} writes {path}"
            found = _volume_under(deployment, path)
            if found is None:
                problems.append(f"{said}, on no volume (the root filesystem: read-only, or lost with the container)")
                continue
            mount, volume = found
            kind = next((k for k in ("emptyDir", "persistentVolumeClaim", "ephemeral") if k in volume), None)
            if mount.get("readOnly") or mount.get("subPath") or kind is None:
                problems.append(f"{said}, on volume {mount['name']} that is not writable there "
                                f"({sorted(k for k in volume if k != 'name') or 'undefined'})")
            elif any(name == env_prefix(settings_classes()[service]) + f.upper() for f in PERSISTENT.get(service, ())) \
                    and kind != "persistentVolumeClaim":
                problems.append(f"{said}, on volume {mount['name']} ({kind}): it must outlive the pod, on a "
                                "PersistentVolumeClaim (persistence)")
    return problems


# --- live config ---------------------------------------------------------------------------

def live_config_restart_problems(docs: list[dict]) -> list[str]:
    """A ConfigMap edit must not roll the pods: no pod annotation is the checksum of a live config,
    and the live config's directory is the ConfigMap volume itself (not a subPath, which the kubelet
    never updates)."""
    configmaps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    sums = {hashlib.sha256(cm["data"]["llmesh.yaml"].encode()).hexdigest(): name
            for name, cm in configmaps.items() if "llmesh.yaml" in (cm.get("data") or {})}
    problems = []
    for deployment in _deployments(docs):
        annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
        for key, value in annotations.items():
            if str(value) in sums:
                problems.append(f"{_where(deployment)}: pod annotation {key} is the checksum of ConfigMap/"
                                f"{sums[str(value)]}: every live-config edit would restart the pods")
        env = _plain_env(_main_container(deployment))
        config_file = _path_of(_setting(MeshSettings, env, "config_file"))
        assert config_file is not None
        found = _volume_under(deployment, config_file)
        if found is None or "configMap" not in found[1]:
            problems.append(f"{_where(deployment)}: the live config {config_file} is not on a ConfigMap volume")
        elif found[0].get("subPath") or PurePosixPath(found[0]["mountPath"]) != config_file.parent:
            problems.append(f"{_where(deployment)}: the live config is a subPath mount: the kubelet never "
                            "updates it")
    return problems


# --- KEDA ----------------------------------------------------------------------------------

_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"')


def _live_config_of(docs: list[dict], deployment: dict) -> str | None:
    for volume in deployment["spec"]["template"]["spec"].get("volumes", []):
        name = (volume.get("configMap") or {}).get("name")
        cm = next((d for d in docs if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == name), None)
        if cm is not None and "llmesh.yaml" in (cm.get("data") or {}):
            return cm["data"]["llmesh.yaml"]
    return None


def exported_series(live_config: str) -> list[tuple[str, dict[str, str]]]:
    """The scheduler's own metrics after one autoscaler tick on this live config (no engines yet)."""
    from prometheus_client import CollectorRegistry

    from llmesh.scheduler.autoscale import FleetScaler
    from llmesh.scheduler.metrics import SchedulerMetrics
    config = parse_live_config(live_config)
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    FleetScaler(lambda: [], lambda: config.autoscaling, metrics.scaled).tick(time.monotonic())
    return [(s.name, dict(s.labels)) for family in registry.collect() for s in family.samples]


def keda_problems(docs: list[dict]) -> list[str]:
    """Each ScaledObject's Prometheus query selects a series the scheduler exports, given the live
    config the scheduler runs on (its ConfigMap in the render, else the engine's)."""
    deployments = {d["metadata"]["name"]: d for d in _deployments(docs)}
    scheduler = next((d for d in deployments.values() if _service_of(d) == "scheduler"), None)
    problems = []
    for scaled in (d for d in docs if d.get("kind") == "ScaledObject"):
        where = f"ScaledObject/{scaled['metadata']['name']}"
        target = deployments.get(scaled["spec"]["scaleTargetRef"]["name"])
        source = scheduler or target
        text = _live_config_of(docs, source) if source else None
        if text is None:
            problems.append(f"{where}: no live config to check its series against")
            continue
        try:
            series = exported_series(text)
        except InvalidConfig as exc:
            problems.append(f"{where}: the live config is invalid: {exc}")
            continue
        for trigger in scaled["spec"].get("triggers") or []:
            query = (trigger.get("metadata") or {}).get("query", "")
            selectors = _SELECTOR.findall(query)
            if not selectors:
                problems.append(f"{where}: query {query!r} selects no labelled series")
            for metric, matchers in selectors:
                wanted = dict(_MATCHER.findall(matchers))
                if not any(name == metric and wanted.items() <= labels.items() for name, labels in series):
                    have = sorted({f"{n}{{{','.join(f'{k}={v!r}' for k, v in sorted(lb.items()))}}}"
                                   for n, lb in series if n == metric})
                    problems.append(f"{where}: {metric}{wanted} is not a series the scheduler exports with this "
                                    f"live config (it exports {have or 'no ' + metric})")
    return problems


# --- gateway replicas ----------------------------------------------------------------------

def shared_key_store_problems(docs: list[dict]) -> list[str]:
    """A gateway that may run more than one process (replicas, the HPA's maxReplicas, workers)
    reads LLMESH_REDIS_URL from a Secret: one key store for all of them. Every HPA targets a
    rendered Deployment."""
    deployments = {d["metadata"]["name"]: d for d in _deployments(docs)}
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"}
    problems = [f"HorizontalPodAutoscaler/{h['metadata']['name']}: scaleTargetRef names no rendered Deployment"
                for name, h in hpas.items() if name not in deployments]
    for name, deployment in deployments.items():
        if _service_of(deployment) != "gateway":
            continue
        env = _plain_env(_main_container(deployment))
        most = max(deployment["spec"].get("replicas", 1), (hpas.get(name) or {}).get("spec", {}).get("maxReplicas", 1))
        workers = int(env.get("LLMESH_GATEWAY_WORKERS", 1))
        if (most > 1 or workers > 1) and "LLMESH_REDIS_URL" not in _secret_env(_main_container(deployment)):
            problems.append(f"{_where(deployment)}: up to {most} replicas of {workers} workers without "
                            "LLMESH_REDIS_URL from a Secret (each would keep its own API keys)")
    return problems


# --- ingress -------------------------------------------------------------------------------

def ingress_problems(docs: list[dict]) -> list[str]:
    """An Ingress or HTTPRoute sends traffic to a rendered gateway Service's `http` port."""
    services, problems = _services(docs), []

    def http_port_of(name: str) -> set:
        svc = services.get(name)
        if svc is None or (svc["spec"].get("selector") or {}).get("app.kubernetes.io/name") != "gateway":
            return set()
        return {v for p in svc["spec"]["ports"] if p.get("name") == "http" for v in (p["port"], "http")}

    for doc in docs:
        kind, where = doc.get("kind"), f"{doc.get('kind')}/{doc['metadata']['name']}"
        if kind == "Ingress":
            for rule in doc["spec"].get("rules") or []:
                for path in (rule.get("http") or {}).get("paths") or []:
                    backend = path["backend"]["service"]
                    port = backend["port"].get("name") or backend["port"].get("number")
                    if port not in http_port_of(backend["name"]):
                        problems.append(f"{where}: {path['path']} goes to {backend['name']}:{port}, not the "
                                        "gateway's http port")
        elif kind == "HTTPRoute":
            if not doc["spec"].get("parentRefs"):
                problems.append(f"{where}: no parentRefs (attached to no Gateway)")
            for rule in doc["spec"].get("rules") or []:
                for ref in rule.get("backendRefs") or []:
                    if ref.get("port") not in http_port_of(ref.get("name", "")):
                        problems.append(f"{where}: goes to {ref.get('name')}:{ref.get('port')}, not the gateway's "
                                        "http port")
    return problems


def rendered_problems(docs: list[dict], rendered_only: bool = True) -> list[str]:
    return (address_problems(docs, rendered_only) + write_path_problems(docs) + live_config_restart_problems(docs)
            + keda_problems(docs) + ingress_problems(docs) + shared_key_store_problems(docs))


# --- a fresh clone -------------------------------------------------------------------------

def fresh_clone(dest: Path, source: Path = HELM_DIR) -> Path:
    """The charts as git holds them: symlinks kept, no packaged dependency (charts/*.tgz)."""
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns("*.tgz"))
    return dest


def fresh_clone_lint_problems(helm_dir: Path) -> list[str]:
    """`helm lint --strict` of every chart with no `helm dependency build` first."""
    problems = []
    for chart in (*SERVICE_CHARTS, UMBRELLA, "llmesh-common"):
        proc = helm("lint", "--strict", helm_dir / chart)
        if proc.returncode != 0:
            out = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if "walk.go" not in line)
            problems.append(f"{chart}: helm lint --strict: {out.strip()}")
    return problems

