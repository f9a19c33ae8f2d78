"""Issue 25, deployments secure by default: the compose file and the chart renders pass the
checks of tests/deploy/security.py, and each check fails on a copy broken on purpose."""

from __future__ import annotations

import base64
import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.deploy import checks, security

SERVICES = checks.SERVICE_CHARTS


# --- compose -------------------------------------------------------------------------------

@pytest.fixture
def compose_copy(compose_doc, tmp_path) -> tuple[dict, Path]:
    """An unshared copy of the compose document and of its folder (the Consul files)."""
    base = tmp_path / "compose"
    shutil.copytree(checks.COMPOSE.parent, base)
    return json.loads(json.dumps(compose_doc)), base


def test_compose_is_secure_by_default(compose_doc):
    assert security.compose_security_problems(compose_doc, checks.COMPOSE.parent) == []
    services = compose_doc["services"]
    assert services["gateway"]["ports"] == ["${GATEWAY_PUBLISH_ADDRESS:-127.0.0.1}:${GATEWAY_HTTP_PORT:-8080}:8080",
                                            "${GATEWAY_PUBLISH_ADDRESS:-127.0.0.1}:${GATEWAY_GRPC_PORT:-50051}:50051"]
    for name in ("consul", "prometheus", "grafana", "jaeger"):
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    assert "ports" not in services["etcd"] and "ports" not in services["redis"]
    assert compose_doc["networks"]["mesh"]["internal"] is True


def _set(path: str, value) -> Callable[[dict, Path], None]:
    def apply(doc: dict, base: Path) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return apply


def _acl_allow(doc: dict, base: Path) -> None:
    path = base / "consul" / "acl.json"
    config = json.loads(path.read_text())
    config["acl"]["default_policy"] = "allow"
    del config["acl"]["enable_token_persistence"]
    path.write_text(json.dumps(config))


def _no_token(doc: dict, base: Path) -> None:
    doc["services"]["cache"]["entrypoint"] = ["python", "-m", "llmesh.cache"]


def _token_not_made(doc: dict, base: Path) -> None:
    script = base / "consul" / "acl-bootstrap.sh"
    script.write_text(script.read_text().replace('SERVICES="gateway scheduler modelmgr cache engine"',
                                                 'SERVICES="gateway scheduler modelmgr cache"'))


@pytest.mark.parametrize("break_it, expected", [
    (_set("services.consul.ports", ["8500:8500"]), "service consul: port 8500:8500 is published on every interface"),
    (_set("services.jaeger.ports", ["0.0.0.0:16686:16686"]), "service jaeger: port 0.0.0.0:16686:16686 is published"),
    (_set("services.redis.ports", [{"target": 6379, "published": 6379}]), "service redis: port"),
    (_set("services.gateway.ports", ["${GATEWAY_PUBLISH_ADDRESS}:8080:8080"]), "service gateway: port"),
    (_set("services.prometheus.network_mode", "host"), "service prometheus: network_mode host"),
    (_set("services.consul.command", ["agent", "-dev", "-client=0.0.0.0"]), "service consul: consul agent -dev"),
    (_acl_allow, "acl.default_policy is 'allow'"),
    (_acl_allow, "acl.enable_token_persistence is off"),
    (_set("services.consul-acl", None), "no one-shot service runs `consul acl bootstrap`"),
    (_no_token, "service cache: uses Consul without a token"),
    (_token_not_made, "service engine-1: consul-acl makes no token 'engine'"),
    (_set("services.scheduler.depends_on.consul-acl", None), "service scheduler: does not wait for consul-acl"),
    (_set("services.etcd.networks", ["default", "mesh"]), "service etcd: etcd without auth on a non-internal"),
    (_set("networks.mesh.internal", None), "service etcd: etcd without auth on a non-internal network (mesh)"),
    (_set("services.grafana.environment.GF_AUTH_ANONYMOUS_ENABLED", "true"), "Grafana lets anonymous users in"),
    (_set("services.grafana.environment.GF_SECURITY_ADMIN_PASSWORD__FILE", None), "default admin/admin"),
    (_set("services.grafana.environment", {"GF_SECURITY_ADMIN_PASSWORD": "${GF_PW:-admin}"}),
     "GF_SECURITY_ADMIN_PASSWORD has a value that works without being set"),
    (_set("services.modelmgr.environment.LLMESH_TRUST", "local"), "service modelmgr: LLMESH_TRUST is 'local'"),
    (_set("services.engine-2.environment.LLMESH_TLS_KEY_FILE", None), "service engine-2: no LLMESH_TLS_KEY_FILE"),
    (_set("services.cache.environment.LLMESH_TLS_CERT_FILE", "/etc/cache.pem"),
     "service cache: /etc/cache.pem is not in the volume mesh-certs writes"),
    (_set("services.cache.environment.LLMESH_TLS_CERT_FILE", "/certs/cache-9.pem"),
     "service cache: mesh-certs makes no certificate for 'cache-9'"),
    (_set("services.mesh-certs", None), "no one-shot service makes the mesh certificates"),
    (_set("services.gateway.environment.LLMESH_GATEWAY_REQUIRE_AUTH", "false"),
     "service gateway: LLMESH_GATEWAY_REQUIRE_AUTH is not true"),
    (_set("services.gateway.environment.LLMESH_CONSUL_TOKEN", "3f1c-literal"),
     "service gateway: LLMESH_CONSUL_TOKEN is a secret written into the file"),
    (_set("services.cache.environment.LLMESH_CACHE_REDIS_URL", "redis://:hunter2@redis:6379/1"),
     "service cache: LLMESH_CACHE_REDIS_URL is a secret written into the file"),
])
def test_each_compose_check_fails_on_a_broken_copy(compose_copy, break_it, expected):
    doc, base = compose_copy
    assert security.compose_security_problems(doc, base) == []  # the copy passes before it is broken
    break_it(doc, base)
    problems = security.compose_security_problems(doc, base)
    assert any(expected in p for p in problems), problems


# --- Helm ----------------------------------------------------------------------------------

_values, _by_kind = checks.values_files, checks.by_kind  # shared with the other Helm tests


def _cert(secret: dict, key: str = "tls.crt") -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


def test_umbrella_is_secure_by_default(umbrella):
    assert security.helm_security_problems(umbrella) == []
    assert set(_by_kind(umbrella, "NetworkPolicy")) == {f"prod-{s}" for s in SERVICES}
    secrets = _by_kind(umbrella, "Secret")
    assert set(secrets) == {"llmesh-mesh-ca", "prod-cli-mesh-tls", *(f"prod-{s}-mesh-tls" for s in SERVICES)}
    assert secrets["llmesh-mesh-ca"]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    ca = _cert(secrets["llmesh-mesh-ca"])
    for service in (*SERVICES, "cli"):
        secret = secrets[f"prod-{service}-mesh-tls"]
        cert = _cert(secret)
        cert.verify_directly_issued_by(ca)  # one CA for the whole mesh
        assert _cert(secret, "ca.crt") == ca
        assert cert.subject.rfc4514_string() == f"CN={service}"
        assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName) == [f"{service}.llmesh.internal"]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)  # mutual TLS
    for deployment in _by_kind(umbrella, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["LLMESH_TRUST"]["value"] == "tls"
        service = deployment["metadata"]["labels"]["app.kubernetes.io/name"]
        volume = next(v for v in pod["volumes"] if v["name"] == "mesh-tls")
        assert volume["secret"]["secretName"] == f"prod-{service}-mesh-tls"


def test_network_policies_admit_only_the_allowed_callers(umbrella):
    policies = _by_kind(umbrella, "NetworkPolicy")
    engine = policies["prod-engine"]["spec"]
    callers = [s["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for s in engine["ingress"][0]["from"]]
    assert engine["ingress"][0]["ports"] == [{"port": 50061, "protocol": "TCP"}]
    assert callers == ["gateway", "scheduler", "modelmgr"]
    gateway = policies["prod-gateway"]["spec"]["ingress"]
    assert gateway[0] == {"ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}]}
    assert gateway[1]["ports"] == [{"port": 9090, "protocol": "TCP"}] and gateway[1]["from"]


def _deployment(docs: list[dict], name: str) -> dict:
    return _by_kind(docs, "Deployment")[name]


def _env_of(docs: list[dict], name: str) -> list[dict]:
    return _deployment(docs, name)["spec"]["template"]["spec"]["containers"][0]["env"]


def _drop_policy(docs, _):
    docs.remove(_by_kind(docs, "NetworkPolicy")["prod-cache"])


def _open_engine(docs, _):
    del _by_kind(docs, "NetworkPolicy")["prod-engine"]["spec"]["ingress"][0]["from"]


def _cli_to_engine(docs, _):
    rule = _by_kind(docs, "NetworkPolicy")["prod-engine"]["spec"]["ingress"][0]
    rule["from"].append({"podSelector": {"matchLabels": {"app.kubernetes.io/name": "cli"}}})


def _namespace_to_scheduler(docs, _):
    rule = _by_kind(docs, "NetworkPolicy")["prod-scheduler"]["spec"]["ingress"][0]
    rule["from"].append({"namespaceSelector": {}})


def _open_metrics(docs, _):
    del _by_kind(docs, "NetworkPolicy")["prod-modelmgr"]["spec"]["ingress"][1]["from"]


def _env_value(deployment: str, name: str, value: str):
    def apply(docs, _):
        env = _env_of(docs, deployment)
        env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]
    return apply


def _swap_cert(docs, _):
    secrets = _by_kind(docs, "Secret")
    secrets["prod-engine-mesh-tls"]["data"]["tls.crt"] = secrets["prod-gateway-mesh-tls"]["data"]["tls.crt"]


def _foreign_ca(other):
    def apply(docs, _):
        _by_kind(docs, "Secret")["prod-cache-mesh-tls"]["data"]["ca.crt"] = other
    return apply


def _unmount_tls(docs, _):
    container = _deployment(docs, "prod-scheduler")["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "mesh-tls"]


HELM_BREAKS = [
    (_drop_policy, "Deployment/prod-cache: no NetworkPolicy selects its pods"),
    (_open_engine, "NetworkPolicy/prod-engine: ports ['50061'] of engine are open to every pod and address"),
    (_cli_to_engine, "NetworkPolicy/prod-engine: cli may reach engine, which does not allow it"),
    (_namespace_to_scheduler, "NetworkPolicy/prod-scheduler: scheduler's gRPC port is open beyond the mesh's pods"),
    (_open_metrics, "NetworkPolicy/prod-modelmgr: ports ['9090'] of modelmgr are open to every pod and address"),
    (_env_value("prod-engine", "LLMESH_TRUST", "local"),
     "Deployment/prod-engine container engine: LLMESH_TRUST is not tls"),
    (_env_value("prod-gateway", "LLMESH_GATEWAY_REQUIRE_AUTH", "false"), "LLMESH_GATEWAY_REQUIRE_AUTH is not true"),
    (_env_value("prod-gateway", "LLMESH_REDIS_URL", "redis://redis:6379/0"),
     "container gateway: LLMESH_REDIS_URL is a plain value, not a secretKeyRef"),
    (_env_value("prod-modelmgr", "LLMESH_MODELMGR_DATABASE_URL", "postgresql://u:pw@db/registry"),
     "container modelmgr: LLMESH_MODELMGR_DATABASE_URL is a plain value"),
    (_env_value("prod-cache", "LLMESH_CONSUL_TOKEN", "0d6e"), "container cache: LLMESH_CONSUL_TOKEN is a plain value"),
    (_swap_cert, "Secret/prod-engine-mesh-tls: the certificate names ['gateway.llmesh.internal'], not engine"),
    (_unmount_tls, "container scheduler: LLMESH_TLS_CERT_FILE is not in a mounted Secret volume"),
]


@pytest.mark.parametrize("break_it, expected", HELM_BREAKS)
def test_each_helm_check_fails_on_a_broken_copy(umbrella, break_it, expected):
    docs = copy.deepcopy(umbrella)
    break_it(docs, None)
    problems = security.helm_security_problems(docs)
    assert any(expected in p for p in problems), problems


def test_a_certificate_from_another_ca_fails(umbrella, helm_dir):
    other, _ = checks.render(helm_dir / "cache", [], release="elsewhere")  # its own, freshly generated CA
    docs = copy.deepcopy(umbrella)
    _foreign_ca(_by_kind(other, "Secret")["llmesh-mesh-ca"]["data"]["tls.crt"])(docs, None)
    problems = security.helm_security_problems(docs)
    assert "Secret/prod-cache-mesh-tls: the certificate is not signed by its ca.crt (InvalidSignature)" in problems


def test_two_gateway_replicas_without_a_shared_key_store_fail_to_render(helm_dir, allowed_env, tmp_path):
    docs, problems = checks.render(helm_dir / "llmesh", _values(tmp_path, {"gateway": {"replicaCount": 2}}))
    assert docs == []
    assert any("gateway: 2 replicas and 1 workers per pod need a shared key store" in p
               and "secretEnv.LLMESH_REDIS_URL" in p for p in problems), problems
    docs, problems = checks.render(helm_dir / "gateway", _values(tmp_path, {"workers": 2}, "workers.yaml"))
    assert docs == [] and any("need a shared key store" in p for p in problems), problems
    shared = {"global": {"secretEnv": {"LLMESH_REDIS_URL": {"secretName": "llmesh-redis", "key": "url"}}},
              "gateway": {"replicaCount": 2}}
    values = _values(tmp_path, shared, "shared.yaml")
    assert checks.chart_problems(helm_dir / "llmesh", values, allowed_env) == []
    docs, _ = checks.render(helm_dir / "llmesh", values)
    assert _deployment(docs, "llmesh-gateway")["spec"]["replicas"] == 2
    for deployment in _by_kind(docs, "Deployment"):
        redis = next(e for e in _env_of(docs, deployment) if e["name"] == "LLMESH_REDIS_URL")
        assert redis == {"name": "LLMESH_REDIS_URL",
                         "valueFrom": {"secretKeyRef": {"name": "llmesh-redis", "key": "url"}}}


def test_cert_manager_makes_a_certificate_per_service(helm_dir, allowed_env, tmp_path):
    values = _values(tmp_path, {"global": {"certManager": {"enabled": True, "issuerRef": {
        "name": "llmesh-ca", "kind": "ClusterIssuer"}}}})
    assert checks.chart_problems(helm_dir / "llmesh", values, allowed_env) == []
    docs, _ = checks.render(helm_dir / "llmesh", values, release="prod")
    assert _by_kind(docs, "Secret") == {}  # cert-manager writes them
    certificates = _by_kind(docs, "Certificate")
    assert set(certificates) == {"prod-cli-mesh-tls", *(f"prod-{s}-mesh-tls" for s in SERVICES)}
    for service in SERVICES:
        spec = certificates[f"prod-{service}-mesh-tls"]["spec"]
        assert spec["dnsNames"] == [f"{service}.llmesh.internal"] and spec["commonName"] == service
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {"name": "llmesh-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        pod = _deployment(docs, f"prod-{service}")["spec"]["template"]["spec"]
        assert next(v for v in pod["volumes"] if v["name"] == "mesh-tls")["secret"]["secretName"] == spec["secretName"]
    assert security.helm_security_problems(docs) == []
    broken = copy.deepcopy(docs)
    _by_kind(broken, "Certificate")["prod-cache-mesh-tls"]["spec"]["dnsNames"] = ["cache.example.com"]
    assert security.helm_security_problems(broken) == ["Certificate/prod-cache-mesh-tls: no DNS name "
                                                       "cache.llmesh.internal"]
    docs, problems = checks.render(helm_dir / "llmesh", _values(tmp_path, {"global": {"certManager": {
        "enabled": True}}}, "no-issuer.yaml"))
    assert docs == [] and any("certManager.issuerRef.name" in p for p in problems), problems


def test_a_service_chart_alone_makes_its_ca_and_certificate(helm_dir, tmp_path):
    docs, problems = checks.render(helm_dir / "scheduler", [], release="llmesh-scheduler")
    assert problems == [] and security.helm_security_problems(docs) == []
    secrets = _by_kind(docs, "Secret")
    assert set(secrets) == {"llmesh-mesh-ca", "llmesh-scheduler-mesh-tls"}
    _cert(secrets["llmesh-scheduler-mesh-tls"]).verify_directly_issued_by(_cert(secrets["llmesh-mesh-ca"]))
    docs, problems = checks.render(helm_dir / "engine", _values(tmp_path, {"meshTLS": {"create": False}}))
    assert problems == [] and _by_kind(docs, "Secret") == {}  # brought by the operator (or the umbrella)


def test_network_policies_can_be_turned_off_but_then_the_check_fails(helm_dir, tmp_path):
    docs, problems = checks.render(helm_dir / "cache", _values(tmp_path, {"networkPolicy": {"enabled": False}}))
    assert problems == [] and _by_kind(docs, "NetworkPolicy") == {}
    assert security.network_policy_problems(docs) == ["Deployment/llmesh-cache: no NetworkPolicy selects its pods"]


# --- the chart's certificates work with the mesh's mutual TLS ---------------------------

async def test_the_generated_certificates_serve_mutual_tls_between_allowed_services(umbrella):
    """The umbrella's generated certificates (RSA, from sprig) in a real grpc.aio server under
    LLMESH_TRUST=tls: the gateway's certificate calls an engine method and is seen as the
    gateway; the cache's is refused by the method's allow-list."""
    import grpc

    from llmesh.rpc.channels import mesh_channel
    from llmesh.rpc.identity import Credentials, Identity, caller
    from llmesh.rpc.server import GrpcServer, ServiceBinding

    secrets = _by_kind(umbrella, "Secret")

    def identity(service: str) -> Identity:
        data = {k: base64.b64decode(v) for k, v in secrets[f"prod-{service}-mesh-tls"]["data"].items()}
        return Identity(service, "tls", Credentials(data["ca.crt"], data["tls.crt"], data["tls.key"]))

    async def handler(request, context):  # who the server saw
        return f"{caller.get().service}/{caller.get().instance}".encode()

    def bind(servicer, server) -> None:
        raw = lambda b: b  # noqa: E731
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "llmesh.v1.Engine", {"Tokenize": grpc.unary_unary_rpc_method_handler(handler, raw, raw)})])

    server = GrpcServer("127.0.0.1:0", [ServiceBinding("llmesh.v1.Engine", None, bind)], identity=identity("engine"))
    await server.start()
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        async with mesh_channel(server.bound_address, "engine", identity("gateway")) as channel:
            seen = await channel.unary_unary("/llmesh.v1.Engine/Tokenize", **raw)(b"x", timeout=10)
        assert seen == b"gateway/gateway"  # one certificate for the gateway's replicas: CN = the service
        async with mesh_channel(server.bound_address, "engine", identity("cache")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/llmesh.v1.Engine/Tokenize", **raw)(b"x", timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)
