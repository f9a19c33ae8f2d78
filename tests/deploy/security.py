"""The deploy checks of issue 25 (secure by default), as functions that return a list of
problems, run on the real compose file and chart renders and on broken copies:

- compose: no port published off loopback (after ${VAR:-default} interpolation), Consul
  with ACLs (deny default, token persistence) bootstrapped by a one-shot in the file and a
  token per llmesh service, etcd unreachable from outside an internal network, Grafana
  without anonymous access or a default admin password, mesh certificates from a one-shot
  init service and LLMESH_TRUST=tls everywhere, the gateway's require_auth on, no secret as
  a literal environment value;
- Helm: a NetworkPolicy per service admitting only the callers its methods allow,
  LLMESH_TRUST=tls with the certificate files in a mounted Secret (whose certificate names
  `<service>.llmesh.internal` and is signed by the CA beside it, or a cert-manager
  Certificate that does), the gateway's require_auth on, every secret-looking variable
  from a secretKeyRef and never a plain `value:`.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shlex
from pathlib import Path

# Who may open a connection to each service's gRPC port: the callers its methods allow
# (llmesh.rpc.policy; `cli` is an operator's pod). [] = anyone (the gateway's API).
ALLOWED_CALLERS = {
    "gateway": [],
    "engine": ["gateway", "scheduler", "modelmgr"],
    "cache": ["gateway", "modelmgr", "cli"],
    "scheduler": ["gateway", "engine", "modelmgr", "cli"],
    "modelmgr": ["gateway", "engine", "cli"],  # engines fetch deployed models
}
MESH_DOMAIN = "llmesh.internal"

# Names that hold a secret (a password, a token, credentials in a URL); *_FILE names a path.
_SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|API_KEY|CREDENTIALS?|_DSN|DATABASE_URL|REDIS_URL|CONSUL_TOKEN|"
                          r"HTTP_TOKEN|AUTH_TOKEN|ACCESS_TOKEN|OTLP(_TRACES)?_HEADERS)$")
_URL_CREDENTIALS = re.compile(r"://[^/@\s:]*:[^/@\s]+@")
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def secret_looking(name: str, value: str = "") -> bool:
    if str(value).startswith("sqlite:"):  # a file's path: no credentials
        return False
    return (bool(_SECRET_NAME.search(name)) and not name.endswith("_FILE")) or bool(_URL_CREDENTIALS.search(value))


def interpolate(value: str) -> str:
    """Compose's interpolation with nothing set in the environment: ${VAR:-default} and
    ${VAR-default} give the default, ${VAR} and ${VAR:?err} nothing."""
    def sub(m: re.Match) -> str:
        return m.group(3) if m.group(2) in (":-", "-") else ""
    return _INTERPOLATION.sub(sub, str(value))


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _words(command) -> list[str]:
    if not command:
        return []
    return [str(w) for w in command] if isinstance(command, list) else shlex.split(str(command))


def _script(svc: dict) -> str:
    """A service's entrypoint and command as one string (what `sh -c` runs is in there)."""
    return " ".join(_words(svc.get("entrypoint")) + _words(svc.get("command")))


def _depends(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _mounts(svc: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume: a named volume's name or a host path as written."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((str(v.get("source", "")), str(v.get("target", ""))))
        else:
            parts = str(v).split(":")
            out.append((parts[0], parts[1]) if len(parts) > 1 else ("", parts[0]))
    return out


def _mount_of(svc: dict, path: str) -> str | None:
    """The source mounted at the deepest target that contains ``path``."""
    hits = [(t, s) for s, t in _mounts(svc) if path == t or path.startswith(t.rstrip("/") + "/")]
    return max(hits)[1] if hits else None


def _is_llmesh(svc: dict) -> bool:
    return bool(svc.get("build")) or str(svc.get("image", "")).startswith("llmesh/")


def _oneshots(services: dict) -> set[str]:
    return {dep for svc in services.values() for dep, cond in _depends(svc).items()
            if cond == "service_completed_successfully"}


# --- compose -------------------------------------------------------------------------------

def _published(port) -> tuple[str, str]:
    """(host ip, the port as written) of a `ports:` entry; "" = every interface."""
    if isinstance(port, dict):
        return interpolate(str(port.get("host_ip", ""))), str(port)
    text = interpolate(str(port)).split("/")[0]
    if text.startswith("["):
        return text[1:text.index("]")], str(port)
    parts = text.split(":")
    return (parts[0] if len(parts) == 3 else ""), str(port)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def compose_exposure_problems(doc: dict) -> list[str]:
    """Nothing published on 0.0.0.0 (or ::, or no address, which is every interface)."""
    problems = []
    for name, svc in (doc.get("services") or {}).items():
        if svc.get("network_mode") == "host":
            problems.append(f"service {name}: network_mode host puts every port it opens on the host's interfaces")
        for port in svc.get("ports") or []:
            host, written = _published(port)
            if not _loopback(host):
                problems.append(f"service {name}: port {written} is published on {host or 'every interface'}, "
                                "not 127.0.0.1")
    return problems


def _consul_agents(services: dict) -> dict[str, dict]:
    return {n: s for n, s in services.items() if str(s.get("image", "")).startswith("hashicorp/consul")
            and "agent" in _words(s.get("command"))}


def _consul_config(svc: dict, base: Path) -> dict:
    """The agent's JSON config files mounted under /consul/config, merged."""
    config: dict = {}
    for source, target in _mounts(svc):
        if target.startswith("/consul/config") and source.startswith(".") and source.endswith(".json"):
            path = base / source
            if path.is_file():
                config.update(json.loads(path.read_text()))
    return config


def compose_consul_problems(doc: dict, base: Path) -> list[str]:
    """Consul with ACLs on, deny by default, tokens persisted; a one-shot in the file
    bootstraps them; every llmesh service that uses Consul waits for it and gets its token."""
    services = doc.get("services") or {}
    problems = []
    agents = _consul_agents(services)
    if not agents:
        return ["no Consul agent service (hashicorp/consul ... agent)"]
    oneshots = _oneshots(services)
    for name, svc in agents.items():
        if "-dev" in _words(svc.get("command")):
            problems.append(f"service {name}: consul agent -dev (in-memory, no ACLs)")
        acl = _consul_config(svc, base).get("acl") or {}
        if acl.get("enabled") is not True:
            problems.append(f"service {name}: ACLs are not enabled (acl.enabled in a config under /consul/config)")
        if acl.get("default_policy") != "deny":
            problems.append(f"service {name}: acl.default_policy is {acl.get('default_policy', 'allow')!r}, not 'deny'")
        if acl.get("enable_token_persistence") is not True:
            problems.append(f"service {name}: acl.enable_token_persistence is off (the agent token would not survive"
                            " a restart)")
    bootstraps = {n: s for n, s in services.items() if n in oneshots and set(_depends(s)) & set(agents)
                  and _bootstrap_script(s, base)}
    if not bootstraps:
        return problems + ["no one-shot service runs `consul acl bootstrap` and creates the services' tokens"]
    boot_name, boot = next(iter(bootstraps.items()))
    script = _bootstrap_script(boot, base)
    listed = re.search(r'SERVICES="([^"]*)"', script)
    token_names = set(listed.group(1).split()) if listed else set()
    token_volume = _mount_of(boot, "/tokens")
    for name, svc in services.items():
        if not _is_llmesh(svc) or _env(svc).get("LLMESH_DISCOVERY") != "consul" or name in oneshots:
            continue
        if _depends(svc).get(boot_name) != "service_completed_successfully":
            problems.append(f"service {name}: does not wait for {boot_name} to complete")
        read = re.search(r'LLMESH_CONSUL_TOKEN="?\$\$?\(cat ([^)"]+)\)', _script(svc))
        if not read:
            problems.append(f"service {name}: uses Consul without a token (LLMESH_CONSUL_TOKEN from its token file)")
            continue
        path = read.group(1)
        if token_volume is None or _mount_of(svc, path) != token_volume:
            problems.append(f"service {name}: {path} is not in the volume {boot_name} writes the tokens to")
        if Path(path).stem not in token_names:
            problems.append(f"service {name}: {boot_name} makes no token {Path(path).stem!r}")
    return problems


def _bootstrap_script(svc: dict, base: Path) -> str:
    """The ACL bootstrap a one-shot runs: its inline script or the mounted file it runs."""
    text = _script(svc)
    for source, target in _mounts(svc):
        if target in text and (base / source).is_file():
            text += "\n" + (base / source).read_text()
    return text if "consul acl bootstrap" in text and "consul acl token create" in text else ""


def compose_etcd_problems(doc: dict) -> list[str]:
    """etcd without client-certificate auth only on internal networks, with no port published."""
    networks = doc.get("networks") or {}
    problems = []
    for name, svc in (doc.get("services") or {}).items():
        if "etcd" not in str(svc.get("image", "")) or "--client-cert-auth" in _words(svc.get("command")):
            continue
        on = svc.get("networks") or ["default"]
        on = list(on) if isinstance(on, (list, dict)) else [on]
        open_networks = [n for n in on if not (networks.get(n) or {}).get("internal")]
        if open_networks:
            problems.append(f"service {name}: etcd without auth on a non-internal network ({', '.join(open_networks)})")
        if svc.get("ports"):
            problems.append(f"service {name}: etcd without auth publishes a port")
    return problems


def compose_grafana_problems(doc: dict) -> list[str]:
    """No anonymous access and an admin password with no default that works."""
    problems = []
    for name, svc in (doc.get("services") or {}).items():
        if not str(svc.get("image", "")).startswith("grafana/"):
            continue
        env = _env(svc)
        if interpolate(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "true":
            problems.append(f"service {name}: Grafana lets anonymous users in (GF_AUTH_ANONYMOUS_ENABLED)")
        if "GF_SECURITY_ADMIN_PASSWORD__FILE" in env:
            continue
        password = env.get("GF_SECURITY_ADMIN_PASSWORD")
        if password is None:
            problems.append(f"service {name}: Grafana's admin password is the default admin/admin")
        elif interpolate(password):
            problems.append(f"service {name}: GF_SECURITY_ADMIN_PASSWORD has a value that works without being set")
    return problems


def _certs_job(services: dict) -> tuple[str, dict] | None:
    oneshots = _oneshots(services)
    for name, svc in services.items():
        if name in oneshots and re.search(r"\bcerts\b.*--dir", _script(svc)):
            return name, svc
    return None


def compose_trust_problems(doc: dict) -> list[str]:
    """Every llmesh service: LLMESH_TRUST=tls and its own certificate from the one-shot
    certificates job (in its volume, one of the identities it makes); the gateway requires auth."""
    services = doc.get("services") or {}
    job = _certs_job(services)
    if job is None:
        return ["no one-shot service makes the mesh certificates (`llmesh certs --dir ...`)"]
    job_name, job_svc = job
    words = _words(_script(job_svc))
    directory = words[words.index("--dir") + 1]
    volume = _mount_of(job_svc, directory)
    instances = {w.split(":")[-1] for w in words[words.index("--dir") + 2:] if re.fullmatch(r"[a-z]+(:[-a-z0-9]+)?", w)}
    problems = []
    for name, svc in services.items():
        if not _is_llmesh(svc) or name in _oneshots(services):
            continue
        env = _env(svc)
        if env.get("LLMESH_TRUST") != "tls":
            problems.append(f"service {name}: LLMESH_TRUST is {env.get('LLMESH_TRUST', 'local')!r}, not 'tls'")
        if _depends(svc).get(job_name) != "service_completed_successfully":
            problems.append(f"service {name}: does not wait for {job_name} to complete")
        for key in ("CA", "CERT", "KEY"):
            path = env.get(f"LLMESH_TLS_{key}_FILE")
            if not path:
                problems.append(f"service {name}: no LLMESH_TLS_{key}_FILE")
            elif volume is None or _mount_of(svc, path) != volume:
                problems.append(f"service {name}: {path} is not in the volume {job_name} writes")
        cert = Path(env.get("LLMESH_TLS_CERT_FILE", "")).stem
        if cert and cert not in instances:
            problems.append(f"service {name}: {job_name} makes no certificate for {cert!r}")
        if name == "gateway" and interpolate(env.get("LLMESH_GATEWAY_REQUIRE_AUTH", "")).lower() != "true":
            problems.append("service gateway: LLMESH_GATEWAY_REQUIRE_AUTH is not true")
    return problems


def compose_secret_env_problems(doc: dict) -> list[str]:
    """A secret is never a literal in the file (${VAR} from the environment, or a secret file)."""
    problems = []
    for name, svc in (doc.get("services") or {}).items():
        for key, value in _env(svc).items():
            if secret_looking(key, value) and interpolate(value) and not (
                    key.endswith("_URL") and not _URL_CREDENTIALS.search(value)):
                problems.append(f"service {name}: {key} is a secret written into the file")
    return problems


def compose_security_problems(doc: dict, base: Path) -> list[str]:
    return (compose_exposure_problems(doc) + compose_consul_problems(doc, base) + compose_etcd_problems(doc)
            + compose_grafana_problems(doc) + compose_trust_problems(doc) + compose_secret_env_problems(doc))


# --- Helm ----------------------------------------------------------------------------------

def _deployments(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d.get("kind") == "Deployment"]


def _service_of(deployment: dict) -> str:
    return deployment["metadata"]["labels"]["app.kubernetes.io/name"]


def _selects(selector: dict, labels: dict) -> bool:
    match = (selector or {}).get("matchLabels") or {}
    return bool(match) and match.items() <= labels.items()


def network_policy_problems(docs: list[dict]) -> list[str]:
    """Each service's pods: a NetworkPolicy with Ingress, its gRPC port open only to the
    callers it allows (anyone only for the gateway's API ports), metrics only from a selector."""
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    problems = []
    for deployment in _deployments(docs):
        name, service = deployment["metadata"]["name"], _service_of(deployment)
        pod = deployment["spec"]["template"]
        labels = pod["metadata"].get("labels") or {}
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        mine = [p for p in policies if _selects(p["spec"].get("podSelector"), labels)
                and "Ingress" in (p["spec"].get("policyTypes") or [])]
        if not mine:
            problems.append(f"Deployment/{name}: no NetworkPolicy selects its pods")
            continue
        api = {ports.get("grpc"), ports.get("http")} if not ALLOWED_CALLERS.get(service) else set()
        reached = set()
        for policy in mine:
            for rule in policy["spec"].get("ingress") or []:
                rule_ports = {p.get("port") for p in rule.get("ports") or []} or {"every port"}
                reached |= rule_ports
                sources = rule.get("from") or []
                where = f"NetworkPolicy/{policy['metadata']['name']}"
                if not sources:
                    if not rule_ports <= api:
                        problems.append(f"{where}: ports {sorted(map(str, rule_ports))} of {service} are open to "
                                        "every pod and address")
                    continue
                if ports.get("metrics") in rule_ports and rule_ports == {ports.get("metrics")}:
                    continue
                for source in sources:
                    caller = ((source.get("podSelector") or {}).get("matchLabels") or {}).get("app.kubernetes.io/name")
                    if "namespaceSelector" in source or "ipBlock" in source or caller is None:
                        problems.append(f"{where}: {service}'s gRPC port is open beyond the mesh's pods ({source})")
                    elif caller not in ALLOWED_CALLERS.get(service, []):
                        problems.append(f"{where}: {caller} may reach {service}, which does not allow it")
        if ports.get("grpc") not in reached:
            problems.append(f"Deployment/{name}: no NetworkPolicy rule admits its gRPC port")
    return problems


def _container_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def plain_secret_env_problems(docs: list[dict]) -> list[str]:
    """Every secret-looking variable comes from a secretKeyRef, never a `value:`."""
    problems = []
    for deployment in _deployments(docs):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            for name, entry in _container_env(c).items():
                if "value" in entry and secret_looking(name, str(entry["value"])):
                    problems.append(f"Deployment/{deployment['metadata']['name']} container {c['name']}: "
                                    f"{name} is a plain value, not a secretKeyRef")
    return problems


def _certificate_problems(where: str, service: str, data: dict) -> list[str]:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    missing = {"tls.crt", "tls.key", "ca.crt"} - set(data)
    if missing:
        return [f"{where}: no {', '.join(sorted(missing))}"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(data["ca.crt"]))
    problems = []
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if f"{service}.{MESH_DOMAIN}" not in names:
        problems.append(f"{where}: the certificate names {names}, not {service}.{MESH_DOMAIN}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        problems.append(f"{where}: the certificate is not signed by its ca.crt ({type(exc).__name__})")
    return problems


def helm_trust_problems(docs: list[dict]) -> list[str]:
    """LLMESH_TRUST=tls, the three TLS files in one mounted Secret volume whose Secret (or
    cert-manager Certificate), when the render has it, certifies the service; require_auth
    on the gateway."""
    secrets = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Secret"}
    certificates = {d["spec"]["secretName"]: d for d in docs if d.get("kind") == "Certificate"}
    problems = []
    for deployment in _deployments(docs):
        pod, service = deployment["spec"]["template"]["spec"], _service_of(deployment)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            where = f"Deployment/{deployment['metadata']['name']} container {c['name']}"
            env = _container_env(c)
            if (env.get("LLMESH_TRUST") or {}).get("value") != "tls":
                problems.append(f"{where}: LLMESH_TRUST is not tls")
            if service == "gateway" and (env.get("LLMESH_GATEWAY_REQUIRE_AUTH") or {}).get("value") != "true":
                problems.append(f"{where}: LLMESH_GATEWAY_REQUIRE_AUTH is not true")
            sources = set()
            for key in ("CA", "CERT", "KEY"):
                path = (env.get(f"LLMESH_TLS_{key}_FILE") or {}).get("value")
                mount = next((m for m in c.get("volumeMounts", [])
                              if path and m["mountPath"] == path.rpartition("/")[0]), None)
                secret = ((volumes.get(mount["name"]) or {}).get("secret") or {}).get("secretName") if mount else None
                if not secret:
                    problems.append(f"{where}: LLMESH_TLS_{key}_FILE is not in a mounted Secret volume")
                sources.add(secret)
            name = next(iter(sources)) if len(sources) == 1 else None
            if name in secrets:
                problems += _certificate_problems(f"Secret/{name}", service, secrets[name].get("data") or {})
            elif name in certificates and f"{service}.{MESH_DOMAIN}" not in certificates[name]["spec"].get("dnsNames",
                                                                                                          []):
                problems.append(f"Certificate/{certificates[name]['metadata']['name']}: no DNS name "
                                f"{service}.{MESH_DOMAIN}")
    return problems


def helm_security_problems(docs: list[dict]) -> list[str]:
    return network_policy_problems(docs) + helm_trust_problems(docs) + plain_secret_env_problems(docs)
