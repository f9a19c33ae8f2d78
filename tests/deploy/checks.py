"""What `make deploy-check` checks, as functions that return a list of problems (empty
when all is well), so the tests can run them on the real files and on broken copies.

No Docker engine or cluster runs here: the compose file is checked against the
compose-spec schema and the services' settings, the charts with a real `helm` (lint,
template) and the Kubernetes API schemas (kubernetes-validate), the Dockerfile by
reading it (COPY sources, stages, users, the modules its commands run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from tests.deploy.security import helm_security_problems
from tests.deploy.values_schema import ROOT, env_prefix, settings_classes

from llmesh.liveconfig.document import InvalidConfig, parse as parse_live_config
from llmesh.settings import MeshSettings

COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HELM_DIR = ROOT / "deploy" / "helm"
SERVICE_CHARTS = ("scheduler", "modelmgr", "cache", "engine", "gateway")
UMBRELLA = "llmesh"
# The oldest Kubernetes the charts support (gRPC probes are GA since 1.27) and the newest known.
KUBERNETES_VERSIONS = ("1.29.0", None)
# Custom resources: no schema ships for them here; checked by crd_problems instead.
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PodMonitor"), ("cert-manager.io/v1", "Certificate"),
             ("gateway.networking.k8s.io/v1", "HTTPRoute")}


# --- settings ------------------------------------------------------------------------------

def settings_env_names() -> set[str]:
    """Every environment variable a service reads through its pydantic settings."""
    names: set[str] = set()
    for cls in (MeshSettings, *settings_classes().values()):
        names |= {env_prefix(cls) + field.upper() for field in cls.model_fields}
    return names


def otel_env_names() -> set[str]:
    """The standard OTEL_* variables, as the OpenTelemetry SDK and API name them."""
    import opentelemetry.environment_variables as api
    import opentelemetry.sdk.environment_variables as sdk
    return {v for mod in (api, sdk) for k, v in vars(mod).items() if k.startswith("OTEL_") and isinstance(v, str)}


def env_problems(where: str, env: dict[str, str], allowed: set[str]) -> list[str]:
    """LLMESH_* and OTEL_* names must be ones the services read; any other name is only
    allowed as a helper that another entry expands ($(NAME), Kubernetes)."""
    problems = []
    for name in env:
        if name in allowed:
            continue
        if name.startswith(("LLMESH_", "OTEL_")):
            problems.append(f"{where}: {name} is not a setting any service defines")
        elif not any(f"$({name})" in str(value) for value in env.values()):
            problems.append(f"{where}: {name} is neither a service setting nor used by another variable")
    return problems


_INTERPOLATION = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}")


def value_problems(where: str, env: dict[str, str]) -> list[str]:
    """Each settings class validates the values given for its fields, as the service would
    at start (compose ${VAR:-default} counts as its default)."""
    from pydantic import ValidationError
    problems = []
    for cls in (MeshSettings, *settings_classes().values()):
        prefix = env_prefix(cls)
        given: dict[str, object] = {
            name[len(prefix):].lower(): _INTERPOLATION.sub(lambda m: m.group(1) or "", str(value))
            for name, value in env.items()
            if name.startswith(prefix) and name[len(prefix):].lower() in cls.model_fields}
        if not given:
            continue
        for name, value in given.items():  # a map or list setting is JSON, as pydantic-settings reads it
            if typing.get_origin(cls.model_fields[name].annotation) in (dict, list):
                try:
                    given[name] = json.loads(str(value))
                except ValueError:
                    pass  # refused below as the string it is
        try:
            cls.model_validate(given)
        except ValidationError as exc:
            problems += [_value_problem(where, prefix, e, given) for e in exc.errors()]
    return problems


def _value_problem(where: str, prefix: str, error: typing.Any, given: dict[str, object]) -> str:
    """One validation error: the variable and its value, or (a rule over several settings, with no
    field of its own, such as a certificate without its key) the settings given."""
    if not error["loc"]:
        return f"{where}: {', '.join(sorted(prefix + n.upper() for n in given))}: {error['msg']}"
    return f"{where}: {prefix}{'_'.join(map(str, error['loc'])).upper()}={given.get(error['loc'][0])!r}: {error['msg']}"


def live_config_problems(where: str, text: str) -> list[str]:
    try:
        parse_live_config(text)
    except InvalidConfig as exc:
        return [f"{where}: invalid live config: {exc}"]
    return []


# --- compose -------------------------------------------------------------------------------

def compose_schema_problems(path: Path = COMPOSE) -> list[str]:
    """The compose file against the compose-spec JSON schema (check-jsonschema's vendored copy)."""
    cli = Path(sys.executable).with_name("check-jsonschema")
    proc = subprocess.run([str(cli), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)
    return [] if proc.returncode == 0 else [f"{path.name}: compose-spec: {(proc.stdout + proc.stderr).strip()}"]


def _env_map(env) -> dict[str, str]:
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in (env or {}).items()}


def _depends(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def is_llmesh_service(service: dict) -> bool:
    build = service.get("build")
    return bool(build) or str(service.get("image", "")).startswith("llmesh/")


def _probe_target(test) -> tuple[str, int] | None:
    """What `python -m llmesh.rpc.probe` asks, if that is the healthcheck: ("http", port) for
    `--http HOST:PORT` or a URL (the metrics port's /healthz), ("grpc", port) for HOST:PORT."""
    words = test if isinstance(test, list) else shlex.split(str(test or ""))
    if "llmesh.rpc.probe" not in words:
        return None
    args = words[words.index("llmesh.rpc.probe") + 1:]
    targets = [a for a in args if not a.startswith("-")]
    if not targets:
        return None
    url = urlsplit(targets[0] if "://" in targets[0] else f"//{targets[0]}")
    return ("http" if "--http" in args or "://" in targets[0] else "grpc"), int(url.port or 0)


def _service_settings(svc: dict):
    """The settings class of an llmesh container (the build target's first word) and its env prefix."""
    cls = settings_classes().get(((svc.get("build") or {}).get("target") or "").split("-")[0])
    return (cls, env_prefix(cls)) if cls is not None else (None, "")


def service_grpc_port(svc: dict) -> int | None:
    """The gRPC port an llmesh container listens on: its LLMESH_<SERVICE>_PORT, else the
    settings class's default. The service is the build target's first word."""
    cls, prefix = _service_settings(svc)
    if cls is None:
        return None
    env = _env_map(svc.get("environment"))
    return int(env.get(f"{prefix}PORT") or cls.model_fields["port"].default)


def _healthcheck_problems(name: str, svc: dict, env: dict[str, str]) -> list[str]:
    """The probe asks the port it names: the gRPC port, or (--http) the metrics port serving
    /healthz. In tls trust with Consul, Consul checks that /healthz, so the metrics port is set."""
    cls, prefix = _service_settings(svc)
    if cls is None:
        return []
    problems = []
    metrics = env.get(f"{prefix}METRICS_PORT")
    if env.get("LLMESH_TRUST") == "tls" and env.get("LLMESH_DISCOVERY") == "consul" and not metrics:
        problems.append(f"service {name}: tls trust with Consul needs {prefix}METRICS_PORT (Consul's check "
                        "asks its /healthz)")
    probe = _probe_target((svc.get("healthcheck") or {}).get("test"))
    if probe is not None and probe[0] == "grpc" and probe[1] != service_grpc_port(svc):
        problems.append(f"service {name}: healthcheck probes port {probe[1]}, the service listens on "
                        f"{service_grpc_port(svc)}")
    elif probe is not None and probe[0] == "http" and str(probe[1]) != metrics:
        problems.append(f"service {name}: healthcheck probes port {probe[1]}, the service serves /healthz on "
                        f"{metrics or 'no port'} ({prefix}METRICS_PORT)")
    return problems


def _seconds(duration: str) -> float:
    """A compose duration (10s, 1m30s, 500ms) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"([0-9.]+)(ms|us|h|m|s)", str(duration))
    return sum(float(n) * units[u] for n, u in parts)


def _stop_grace_problems(name: str, svc: dict, env: dict[str, str]) -> list[str]:
    """Docker's SIGKILL (stop_grace_period, 10s by default) must come after the drain."""
    target = ((svc.get("build") or {}).get("target") or "").split("-")[0]
    cls = settings_classes().get(target)
    if cls is None:
        return []
    grace = float(env.get(f"{env_prefix(cls)}GRACE_S") or cls.model_fields["grace_s"].default)
    stop = _seconds(svc.get("stop_grace_period", "10s"))
    return [] if stop > grace else [f"service {name}: stop_grace_period {stop:g}s does not exceed its grace {grace:g}s"]


def compose_problems(doc: dict, allowed_env: set[str], stages: set[str]) -> list[str]:
    """Healthchecks, dependencies and the environment of each service of a compose file."""
    problems = []
    services = doc.get("services") or {}
    # A one-shot job (others wait for it to complete) needs no healthcheck.
    oneshots = {dep for svc in services.values() for dep, cond in _depends(svc).items()
                if cond == "service_completed_successfully"}
    for name, svc in services.items():
        check = svc.get("healthcheck")
        if name not in oneshots and (not check or check.get("disable") or not check.get("test")):
            problems.append(f"service {name}: no healthcheck")
        for dep, cond in _depends(svc).items():
            if dep not in services:
                problems.append(f"service {name}: depends on undefined service {dep}")
            elif cond == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"service {name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
        if is_llmesh_service(svc):
            env = _env_map(svc.get("environment"))
            problems += env_problems(f"service {name}", env, allowed_env) + value_problems(f"service {name}", env)
            target = (svc.get("build") or {}).get("target")
            if svc.get("build") and target not in stages:
                problems.append(f"service {name}: build target {target!r} is not a Dockerfile stage")
            if name not in oneshots:
                problems += _stop_grace_problems(name, svc, env) + _healthcheck_problems(name, svc, env)
    return problems


def compose_modules(doc: dict) -> set[str]:
    """Python modules that the compose file's llmesh commands run (`python -m X`)."""
    modules: set[str] = set()
    for svc in (doc.get("services") or {}).values():
        if is_llmesh_service(svc):
            for key in ("entrypoint", "command"):
                modules |= python_modules(svc.get(key))
            modules |= python_modules((svc.get("healthcheck") or {}).get("test"))
    return modules


# --- Dockerfile ----------------------------------------------------------------------------

def python_modules(command) -> set[str]:
    """`python -m X` / `python3 -m X` in an exec-form list or a shell string, also where a list
    hands a script to a shell (``["/bin/sh", "-c", "... exec python -m X"]``)."""
    if not command:
        return set()
    words: list[str] = []
    for item in command if isinstance(command, list) else [command]:
        words += shlex.split(str(item)) if re.search(r"\s", str(item)) else [str(item)]
    return {words[i + 1] for i, w in enumerate(words[:-1])
            if w == "-m" and i > 0 and re.fullmatch(r"(.*/)?python[0-9.]*", words[i - 1])}


def _dockerignore_patterns(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = rel.strip("/").split("/")
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _stages(path: Path) -> list[dict]:
    """The Dockerfile's stages in order: name, base, and their instructions."""
    from dockerfile_parse import DockerfileParser
    parser = DockerfileParser(path=str(path), cache_content=True)
    stages: list[dict] = []
    for item in parser.structure:
        if item["instruction"] == "FROM":
            words = item["value"].split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            stages.append({"name": name, "base": words[0], "lines": []})
        elif stages:
            stages[-1]["lines"].append(item)
        # ARGs before the first FROM belong to no stage
    return stages


def stage_names(path: Path = DOCKERFILE) -> set[str]:
    return {s["name"] for s in _stages(path) if s["name"]}


def _exec_form(value: str):
    value = value.strip()
    if value.startswith("["):
        return json.loads(value)
    return value


def dockerfile_problems(path: Path = DOCKERFILE, context: Path = ROOT,
                        allowed_env: set[str] | None = None) -> tuple[list[str], set[str]]:
    """COPY sources exist in the build context and are not .dockerignored; COPY --from
    names an earlier stage; every stage with an entrypoint (its own or inherited) runs as
    a non-root user; LLMESH_* variables are settings with valid values. Returns the
    problems and the Python modules the image runs."""
    problems: list[str] = []
    modules: set[str] = set()
    patterns = _dockerignore_patterns(context / ".dockerignore")
    stages = _stages(path)
    seen: dict[str, dict] = {}
    for stage in stages:
        parent = seen.get(stage["base"])
        user = parent["user"] if parent else "root"
        entry = parent["entrypoint"] if parent else None
        for item in stage["lines"]:
            ins, value, line = item["instruction"], item["value"], item["startline"] + 1
            where = f"{path.name}:{line}"
            if ins in ("COPY", "ADD"):
                words = shlex.split(value) if not value.strip().startswith("[") else json.loads(value)
                flags = {w.split("=", 1)[0]: w.split("=", 1)[-1] for w in words if w.startswith("--")}
                args = [w for w in words if not w.startswith("--")]
                if "--from" in flags:
                    if flags["--from"] not in seen:
                        problems.append(f"{where}: COPY --from={flags['--from']} is not an earlier stage")
                    continue
                for src in args[:-1]:
                    rel = src.strip("/").rstrip("/") or "."
                    matches = list(context.glob(rel)) if any(c in rel for c in "*?[") else [context / rel]
                    if not any(m.exists() for m in matches):
                        problems.append(f"{where}: COPY source {src} does not exist in the build context")
                    elif dockerignored(rel, patterns):
                        problems.append(f"{where}: COPY source {src} is excluded by .dockerignore")
            elif ins == "USER":
                user = value.split(":")[0].strip()
            elif ins == "ENTRYPOINT":
                entry = _exec_form(value)
                modules |= python_modules(entry)
            elif ins in ("CMD", "RUN"):
                modules |= python_modules(_exec_form(value) if ins == "CMD" else value)
            elif ins == "HEALTHCHECK":
                modules |= python_modules(_exec_form(value.split("CMD", 1)[-1]))
            elif ins == "ENV" and allowed_env is not None:
                env = dict(w.split("=", 1) for w in shlex.split(value) if "=" in w)
                problems += [p for p in env_problems(where, env, allowed_env) if "LLMESH_" in p]
                problems += value_problems(where, env)
        if stage["name"]:
            seen[stage["name"]] = {"user": user, "entrypoint": entry}
        if entry and user in ("root", "0"):
            problems.append(f"{path.name}: stage {stage['name']} runs its entrypoint as root")
    return problems, modules


def import_problems(modules: Iterable[str]) -> list[str]:
    """Each module a container runs imports, as `python -m` would load it."""
    problems = []
    for module in sorted(modules):
        if not module.startswith("llmesh"):
            continue
        code = ("import importlib, importlib.util, sys; m = sys.argv[1]; spec = importlib.util.find_spec(m); "
                "sys.exit(f'no module {m}') if spec is None else None; "
                "importlib.import_module(m + '.__main__' if spec.submodule_search_locations else m)")
        proc = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            problems.append(f"module {module} does not import: {proc.stderr.strip().splitlines()[-1:]}")
    return problems


# --- Helm ----------------------------------------------------------------------------------

def helm_binary() -> Path:
    path = Path(os.environ.get("HELM") or ROOT / ".tools" / "helm")
    if not path.is_file():
        raise FileNotFoundError(f"no helm at {path}: run 'make deploy-check' (it fetches helm into .tools/)")
    return path


def helm(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm_binary()), *map(str, args)], capture_output=True, text=True, timeout=120)


def values_files(tmp_path: Path, values: dict, name: str = "values.yaml") -> list[Path]:
    """``values`` written as a values file in ``tmp_path``: render's ``values`` argument."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return [path]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    """The rendered objects of one kind, by name."""
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def render(chart: Path, values: list[Path], release: str = "llmesh") -> tuple[list[dict], list[str]]:
    flags = [a for v in values for a in ("-f", str(v))]
    lint = helm("lint", "--strict", chart, *flags)
    problems = [] if lint.returncode == 0 else [f"{chart.name}: helm lint --strict: {lint.stdout + lint.stderr}"]
    tpl = helm("template", release, chart, *flags)
    if tpl.returncode != 0:
        return [], problems + [f"{chart.name}: helm template: {tpl.stderr.strip()}"]
    docs = [d for d in yaml.safe_load_all(tpl.stdout) if d]
    return docs, problems


def kubernetes_problems(docs: list[dict]) -> list[str]:
    import kubernetes_validate
    problems = []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in CRD_KINDS:
            continue
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        for version in KUBERNETES_VERSIONS:
            version = version or kubernetes_validate.latest_version()
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{name}: not valid for Kubernetes {version}: {exc.message} at "
                                f"{'.'.join(map(str, exc.path))}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{name}: no Kubernetes {version} schema: {exc}")
    return problems


def _pods(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d.get("kind") == "Deployment"]


HEALTH_PATHS = {"/healthz", "/readyz"}


def probe_port(probe: dict | None) -> int | str | None:
    """The port (number or name) of a kubelet httpGet probe of /healthz or /readyz, the plaintext
    health of the metrics port (llmesh.metrics_http); None for any other probe. The gRPC ports
    need a mesh client certificate, which neither the kubelet's gRPC nor its TCP probe has, and an
    exec probe starts a Python process per probe."""
    get = (probe or {}).get("httpGet") or {}
    if get.get("path") not in HEALTH_PATHS or get.get("scheme", "HTTP") != "HTTP":
        return None
    port: int | str | None = get.get("port")
    return port


def workload_problems(docs: list[dict], allowed_env: set[str]) -> list[str]:
    """Each llmesh container: settings-only env, httpGet probes of /healthz on its metrics port, a
    preStop drain that fits in the termination grace period, and a valid live config."""
    problems = []
    for name, pod in _pods(docs):
        spec = pod["spec"]
        for c in spec["containers"]:
            where = f"Deployment/{name} container {c['name']}"
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            problems += env_problems(where, env, allowed_env) + value_problems(where, env)
            metrics = {p for m in c.get("ports", []) if m.get("name") == "metrics"
                       for p in ("metrics", m["containerPort"])}
            if not metrics:
                problems.append(f"{where}: no 'metrics' container port (its probes ask /healthz there)")
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe == "startupProbe" and not c.get(probe):
                    continue
                if probe_port(c.get(probe)) not in metrics:
                    problems.append(f"{where}: {probe} is not an httpGet of /healthz or /readyz on the metrics port")
            sleep = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command", [])
            grace = [float(v) for k, v in env.items() if k.endswith("_GRACE_S")]
            if len(sleep) != 2 or not grace:
                problems.append(f"{where}: needs a preStop sleep and a *_GRACE_S setting")
            elif spec.get("terminationGracePeriodSeconds", 30) < float(sleep[1]) + grace[0]:
                problems.append(f"{where}: terminationGracePeriodSeconds "
                                f"{spec.get('terminationGracePeriodSeconds', 30)} "
                                f"< preStop {sleep[1]}s + grace {grace[0]}s")
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and "llmesh.yaml" in (doc.get("data") or {}):
            problems += live_config_problems(f"ConfigMap/{doc['metadata']['name']}", doc["data"]["llmesh.yaml"])
    return problems


def crd_problems(docs: list[dict]) -> list[str]:
    """KEDA and Prometheus Operator objects point at what the chart renders."""
    problems = []
    deployments = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
    for doc in docs:
        kind, name, spec = doc.get("kind"), doc["metadata"]["name"], doc.get("spec") or {}
        if kind == "ScaledObject":
            target = deployments.get((spec.get("scaleTargetRef") or {}).get("name"))
            if target is None:
                problems.append(f"ScaledObject/{name}: scaleTargetRef names no rendered Deployment")
            elif "replicas" in target["spec"]:
                problems.append(f"ScaledObject/{name}: its Deployment also sets replicas (they would fight)")
            if not 0 <= spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100):
                problems.append(f"ScaledObject/{name}: minReplicaCount > maxReplicaCount")
            for trigger in spec.get("triggers") or [{}]:
                meta = trigger.get("metadata") or {}
                if trigger.get("type") != "prometheus" or not all(meta.get(k) for k in
                                                                  ("serverAddress", "query", "threshold")):
                    problems.append(f"ScaledObject/{name}: a prometheus trigger needs serverAddress, query, threshold")
        elif kind in ("ServiceMonitor", "PodMonitor"):
            labels = (spec.get("selector") or {}).get("matchLabels") or {}
            if kind == "ServiceMonitor":
                hits = [s for s in services.values()
                        if labels.items() <= (s["metadata"].get("labels") or {}).items()
                        and "metrics" in {p.get("name") for p in s["spec"]["ports"]}]
                endpoints = spec.get("endpoints") or []
            else:
                hits = [d for d in deployments.values()
                        if labels.items() <= (d["spec"]["template"]["metadata"].get("labels") or {}).items()]
                endpoints = spec.get("podMetricsEndpoints") or []
            if not labels or not hits:
                problems.append(f"{kind}/{name}: its selector matches nothing the chart renders")
            if not endpoints or any(e.get("port") != "metrics" for e in endpoints):
                problems.append(f"{kind}/{name}: must scrape the 'metrics' port")
    return problems


def chart_problems(chart: Path, values: list[Path], allowed_env: set[str]) -> list[str]:
    from tests.deploy.properties import rendered_problems  # it uses this module's helm
    docs, problems = render(chart, values)
    if docs:
        problems += (kubernetes_problems(docs) + workload_problems(docs, allowed_env) + crd_problems(docs)
                     + helm_security_problems(docs) + rendered_problems(docs, rendered_only=chart.name == UMBRELLA))
        if not any(d.get("kind") == "Deployment" for d in docs):
            problems.append(f"{chart.name}: renders no Deployment")
    return problems
