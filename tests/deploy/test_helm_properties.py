"""Issue 28, the Helm part: a rendered umbrella whose services reach each other and keep their
state, live-config edits without restarts, KEDA on a series that exists, the standard pod knobs,
ingress, and `helm lint --strict` on a fresh clone. Each property is checked on real renders
(tests/deploy/properties.py) and shown to fail on a broken copy."""

from __future__ import annotations

import copy
import hashlib
import os
import subprocess
import sys

import pytest
import yaml

from tests.deploy import checks, properties

SERVICES = checks.SERVICE_CHARTS


_values, _by_kind = checks.values_files, checks.by_kind  # shared with the other Helm tests


def _pod(docs: list[dict], name: str) -> dict:
    return _by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]


def _env(docs: list[dict], name: str) -> dict[str, dict]:
    return {e["name"]: e for e in _pod(docs, name)["containers"][0]["env"]}


def _set_env(docs: list[dict], deployment: str, name: str, value: str | None) -> None:
    env = _pod(docs, deployment)["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != name] + ([{"name": name, "value": value}] if value is not None else [])


# --- the umbrella holds together ----------------------------------------------------------

def test_the_umbrella_holds_together(umbrella):
    assert properties.rendered_problems(umbrella) == []
    # the model manager dials the scheduler's Service (it used to dial its own 127.0.0.1:50052)
    assert _env(umbrella, "prod-modelmgr")["LLMESH_MODELMGR_SCHEDULER_ADDRESS"]["value"] == "prod-scheduler:50052"
    # its registry, artifact store and published models on a claim kept across upgrades, one pod at a time
    paths = properties.written_paths(_by_kind(umbrella, "Deployment")["prod-modelmgr"])
    assert {str(p) for p in paths.values()} == {"/var/lib/llmesh/state", "/var/lib/llmesh/state/models",
                                                "/var/lib/llmesh/state/modelstore"}
    claim = _by_kind(umbrella, "PersistentVolumeClaim")["prod-modelmgr-state"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    state = next(v for v in _pod(umbrella, "prod-modelmgr")["volumes"] if v["name"] == "state")
    assert state == {"name": "state", "persistentVolumeClaim": {"claimName": "prod-modelmgr-state"}}
    assert _by_kind(umbrella, "Deployment")["prod-modelmgr"]["spec"]["strategy"] == {"type": "Recreate"}
    # the engines' model cache: an emptyDir, filled with the image's model before the engine starts
    engine = _pod(umbrella, "prod-engine")
    assert next(v for v in engine["volumes"] if v["name"] == "state") == {"name": "state", "emptyDir": {}}
    assert engine["initContainers"][0]["name"] == "seed-models"
    assert _env(umbrella, "prod-engine")["LLMESH_ENGINE_MODEL_DIR"]["value"] == "/var/lib/llmesh/state/models"


def _break_address(docs):
    _set_env(docs, "prod-modelmgr", "LLMESH_MODELMGR_SCHEDULER_ADDRESS", None)  # the default: loopback
    _set_env(docs, "prod-gateway", "LLMESH_GATEWAY_CACHE_ADDRESS", "prod-caches:50054")
    _set_env(docs, "prod-gateway", "LLMESH_GATEWAY_MODELMGR_ADDRESS", "prod-scheduler:50052")
    _set_env(docs, "prod-engine", "LLMESH_ENGINE_SCHEDULER_ADDRESS", "prod-scheduler:9090")


def test_an_address_that_reaches_no_service_fails(umbrella):
    docs = copy.deepcopy(umbrella)
    _break_address(docs)
    assert properties.address_problems(docs) == [
        "Deployment/prod-engine: LLMESH_ENGINE_SCHEDULER_ADDRESS=prod-scheduler:9090: port 9090 is not the grpc "
        "port [50052] of Service prod-scheduler",
        "Deployment/prod-gateway: LLMESH_GATEWAY_CACHE_ADDRESS=prod-caches:50054 dials no Service the chart renders",
        "Deployment/prod-gateway: LLMESH_GATEWAY_MODELMGR_ADDRESS=prod-scheduler:52052: Service prod-scheduler "
        "does not select the modelmgr's pods".replace("52052", "50052"),
        "Deployment/prod-modelmgr: LLMESH_MODELMGR_SCHEDULER_ADDRESS=127.0.0.1:50052 (unset: the default) dials "
        "the pod's own loopback, not the scheduler",
    ]


def test_a_value_that_drops_an_address_fails_the_chart(helm_dir, allowed_env, tmp_path):
    """The bug of issue 28, through values: the model manager left on its default address."""
    values = _values(tmp_path, {"modelmgr": {"settings": {"scheduler_address": None}}})
    problems = checks.chart_problems(helm_dir / "llmesh", values, allowed_env)
    assert problems == ["Deployment/llmesh-modelmgr: LLMESH_MODELMGR_SCHEDULER_ADDRESS=127.0.0.1:50052 (unset: the "
                        "default) dials the pod's own loopback, not the scheduler"]


def test_external_consul_and_etcd_left_on_loopback_fail(umbrella):
    docs = copy.deepcopy(umbrella)
    _set_env(docs, "prod-cache", "LLMESH_CONFIG_BACKEND", "etcd")
    assert properties.address_problems(docs) == [
        "Deployment/prod-cache: LLMESH_ETCD_ADDRESS=127.0.0.1:2379 dials the pod's own loopback"]


def test_a_written_path_off_a_writable_volume_fails(umbrella, helm_dir, tmp_path):
    docs = copy.deepcopy(umbrella)
    _set_env(docs, "prod-engine", "LLMESH_ENGINE_MODEL_DIR", "/opt/models")
    _set_env(docs, "prod-gateway", "LLMESH_GATEWAY_AUDIT_FILE", "/etc/llmesh/audit.jsonl")  # the ConfigMap
    mounts = _pod(docs, "prod-scheduler")["containers"][0]["volumeMounts"]
    next(m for m in mounts if m["name"] == "state")["readOnly"] = True
    problems = properties.write_path_problems(docs)
    assert problems == [
        "Deployment/prod-engine: LLMESH_ENGINE_MODEL_DIR writes /opt/models, on no volume (the root filesystem: "
        "read-only, or lost with the container)",
        "Deployment/prod-gateway: LLMESH_GATEWAY_AUDIT_FILE writes /etc/llmesh, on volume live-config that is not "
        "writable there (['configMap'])",
        "Deployment/prod-scheduler: LLMESH_STATE_DIR writes /var/lib/llmesh/state, on volume state that is not "
        "writable there (['emptyDir'])",
    ]
    # the model manager's registry and store on an emptyDir: lost with the pod
    docs, problems = checks.render(helm_dir / "llmesh", _values(tmp_path, {"modelmgr": {
        "persistence": {"enabled": False}}}), release="prod")
    assert problems == []
    assert properties.write_path_problems(docs) == [
        "Deployment/prod-modelmgr: LLMESH_MODELMGR_STORE_DIR writes /var/lib/llmesh/state/modelstore, on volume "
        "state (emptyDir): it must outlive the pod, on a PersistentVolumeClaim (persistence)",
        "Deployment/prod-modelmgr: LLMESH_MODELMGR_DATABASE_URL writes /var/lib/llmesh/state, on volume state "
        "(emptyDir): it must outlive the pod, on a PersistentVolumeClaim (persistence)"]


def test_the_registry_on_postgresql_comes_from_a_secret(helm_dir, allowed_env, tmp_path):
    values = _values(tmp_path, {"modelmgr": {"secretEnv": {"LLMESH_MODELMGR_DATABASE_URL": {
        "secretName": "llmesh-registry-db", "key": "url"}}, "persistence": {"existingClaim": "models-pvc"}}})
    assert checks.chart_problems(helm_dir / "llmesh", values, allowed_env) == []
    docs, _ = checks.render(helm_dir / "llmesh", values, release="prod")
    env = _env(docs, "prod-modelmgr")
    assert env["LLMESH_MODELMGR_DATABASE_URL"] == {"name": "LLMESH_MODELMGR_DATABASE_URL", "valueFrom": {
        "secretKeyRef": {"name": "llmesh-registry-db", "key": "url"}}}
    assert [e["name"] for e in _pod(docs, "prod-modelmgr")["containers"][0]["env"]].count(
        "LLMESH_MODELMGR_DATABASE_URL") == 1
    # the artifact store stays on the (existing) claim; the chart makes none
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    assert {"name": "state", "persistentVolumeClaim": {"claimName": "models-pvc"}} in _pod(docs, "prod-modelmgr")[
        "volumes"]


def test_one_claim_for_many_pods_fails_to_render_and_per_pod_claims_work(helm_dir, allowed_env, tmp_path):
    docs, problems = checks.render(helm_dir / "modelmgr", _values(tmp_path, {"replicaCount": 2}))
    assert docs == [] and any("modelmgr: persistence (one PersistentVolumeClaim, llmesh-modelmgr-state) holds the "
                              "state of one pod, and 2 replicas" in p for p in problems), problems
    values = _values(tmp_path, {"persistence": {"enabled": True, "size": "50Gi", "storageClass": "fast-nvme"},
                                "replicaCount": 3}, "engine.yaml")
    assert checks.chart_problems(helm_dir / "engine", values, allowed_env) == []
    docs, _ = checks.render(helm_dir / "engine", values)
    state = next(v for v in _pod(docs, "llmesh-engine")["volumes"] if v["name"] == "state")
    spec = state["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert spec == {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast-nvme",
                    "resources": {"requests": {"storage": "50Gi"}}}
    assert "strategy" not in _by_kind(docs, "Deployment")["llmesh-engine"]["spec"]


def test_the_seed_container_copies_the_image_models_once_and_whole(umbrella, tmp_path):
    """The init container's own command, run here on a directory laid out like the image's."""
    seed = _pod(umbrella, "prod-engine")["initContainers"][0]
    assert seed["command"][:2] == ["python3", "-c"] and seed["command"][-1] == "/var/lib/llmesh/state/models"
    assert seed["volumeMounts"] == [{"name": "state", "mountPath": "/var/lib/llmesh/state"}]
    image = tmp_path / "image" / "smollm2-135m-instruct"
    image.mkdir(parents=True)
    (image / "model.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    (image / "model.json").write_text("{}")
    os.utime(image / "model.gguf", ns=(1_000_000_000, 1_000_000_000))
    state = tmp_path / "state" / "models"

    def run():
        return subprocess.run([sys.executable, "-c", seed["command"][2], str(tmp_path / "image"), str(state)],
                              capture_output=True, text=True, timeout=60, check=True).stdout

    assert run().count("seeded") == 2
    copied = state / "smollm2-135m-instruct" / "model.gguf"
    assert copied.read_bytes() == (image / "model.gguf").read_bytes()
    assert copied.stat().st_mtime_ns == 1_000_000_000  # the checksum sidecar's stamp stays valid
    (state / "smollm2-135m-instruct" / "model.json").write_text('{"kept": true}')
    assert run() == ""  # nothing copied over what is there
    assert (state / "smollm2-135m-instruct" / "model.json").read_text() == '{"kept": true}'
    assert not list(state.rglob("*.seeding"))


# --- live config -------------------------------------------------------------------------

def test_a_live_config_edit_restarts_no_pod(umbrella):
    assert properties.live_config_restart_problems(umbrella) == []
    for deployment in _by_kind(umbrella, "Deployment").values():
        assert not any(k.startswith("checksum/") for k in
                       (deployment["spec"]["template"]["metadata"].get("annotations") or {}))
    docs = copy.deepcopy(umbrella)
    text = _by_kind(docs, "ConfigMap")["prod-engine-config"]["data"]["llmesh.yaml"]
    _by_kind(docs, "Deployment")["prod-engine"]["spec"]["template"]["metadata"]["annotations"] = {
        "checksum/config": hashlib.sha256(text.encode()).hexdigest()}
    mount = next(m for m in _pod(docs, "prod-cache")["containers"][0]["volumeMounts"] if m["name"] == "live-config")
    mount.update(mountPath="/etc/llmesh/llmesh.yaml", subPath="llmesh.yaml")
    problems = properties.live_config_restart_problems(docs)
    assert len(problems) == 2, problems
    assert problems[0] == ("Deployment/prod-cache: the live config is a subPath mount: the kubelet never "
                           "updates it")
    assert problems[1].startswith("Deployment/prod-engine: pod annotation checksum/config is the checksum of "
                                  "ConfigMap/prod-")


# --- KEDA ----------------------------------------------------------------------------------

def test_keda_scales_on_a_series_the_scheduler_exports(helm_dir):
    docs, problems = checks.render(helm_dir / "llmesh", [helm_dir / "llmesh" / "values-gpu.yaml"], release="prod")
    assert problems == []
    assert properties.keda_problems(docs) == []
    scheduler_config = _by_kind(docs, "ConfigMap")["prod-scheduler-config"]["data"]["llmesh.yaml"]
    assert ("llmesh_scheduler_replicas", {"model": "qwen2.5-0.5b-instruct", "kind": "desired"}) in \
        properties.exported_series(scheduler_config)
    broken = copy.deepcopy(docs)
    trigger = _by_kind(broken, "ScaledObject")["prod-engine"]["spec"]["triggers"][0]["metadata"]
    trigger["query"] = 'max(llmesh_scheduler_replicas{kind="desired",model="qwen2.5-7b"})'
    assert properties.keda_problems(broken) == [
        "ScaledObject/prod-engine: llmesh_scheduler_replicas{'kind': 'desired', 'model': 'qwen2.5-7b'} is not a "
        "series the scheduler exports with this live config (it exports "
        "[\"llmesh_scheduler_replicas{kind='desired',model='qwen2.5-0.5b-instruct'}\"])"]
    trigger["query"] = 'sum(llmesh_engine_queue{model="qwen2.5-0.5b-instruct"})'
    assert properties.keda_problems(broken)[0].startswith(
        "ScaledObject/prod-engine: llmesh_engine_queue{'model': 'qwen2.5-0.5b-instruct'} is not a series")


def test_keda_without_the_model_in_the_live_config_fails_to_render(helm_dir, tmp_path):
    values = _values(tmp_path, {"global": {"liveConfig": "default: {max_attempts: 2}\n"}})
    docs, problems = checks.render(helm_dir / "llmesh", [helm_dir / "llmesh" / "values-gpu.yaml", *values])
    assert docs == []
    assert any('autoscaling.enabled scales on llmesh_scheduler_replicas{kind="desired",model="qwen2.5-0.5b-'
               'instruct"}, which the scheduler exports only for a model its live config lists: add '
               "autoscaling.models.qwen2.5-0.5b-instruct to liveConfig" in p for p in problems), problems
    # the engine chart alone, told to serve another model, must list that one
    other = _values(tmp_path, {"settings": {"model": "llama-3-8b"}}, "other.yaml")
    docs, problems = checks.render(helm_dir / "engine", [helm_dir / "engine" / "values-gpu.yaml", *other])
    assert docs == [] and any("add autoscaling.models.llama-3-8b" in p for p in problems), problems


# --- the standard knobs ------------------------------------------------------------------

KNOBS = {
    "podLabels": {"team": "ml-platform"},
    "podAnnotations": {"example.com/owner": "ml"},
    "serviceAccount": {"create": True, "name": "llmesh-gw", "annotations": {"iam.example.com/role": "gw"}},
    "podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch"},
    "securityContext": {"runAsUser": 10002, "readOnlyRootFilesystem": False},  # a false wins too
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llmesh", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
            "matchLabels": {"app.kubernetes.io/name": "gateway"}}}}]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "priorityClassName": "llmesh-high",
    "runtimeClassName": "gvisor",
    "extraEnv": [{"name": "TZ", "value": "UTC"},
                 {"name": "OTEL_EXPORTER_OTLP_HEADERS", "valueFrom": {"secretKeyRef": {"name": "otel", "key": "h"}}}],
    "extraVolumes": [{"name": "extra", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
}


def test_every_standard_knob_reaches_the_pod_spec(helm_dir, allowed_env, tmp_path):
    values = _values(tmp_path, KNOBS)
    assert checks.chart_problems(helm_dir / "gateway", values, allowed_env | {"TZ"}) == []
    docs, _ = checks.render(helm_dir / "gateway", values)
    template = _by_kind(docs, "Deployment")["llmesh-gateway"]["spec"]["template"]
    pod, container = template["spec"], template["spec"]["containers"][0]
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "gateway"  # the selector still matches
    assert template["metadata"]["annotations"] == KNOBS["podAnnotations"]
    account = _by_kind(docs, "ServiceAccount")["llmesh-gw"]
    assert account["metadata"]["annotations"] == {"iam.example.com/role": "gw"}
    assert pod["serviceAccountName"] == "llmesh-gw" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert pod["securityContext"]["runAsNonRoot"] is True  # the defaults stay under an addition
    assert container["securityContext"]["runAsUser"] == 10002
    assert container["securityContext"]["readOnlyRootFilesystem"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for knob in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName"):
        assert pod[knob] == KNOBS[knob], knob
    spread = pod["topologySpreadConstraints"][0]
    assert spread["labelSelector"] == {"matchLabels": {"app.kubernetes.io/name": "gateway",
                                                       "app.kubernetes.io/instance": "llmesh"}}
    env = {e["name"]: e for e in container["env"]}
    assert env["TZ"] == {"name": "TZ", "value": "UTC"} and "valueFrom" in env["OTEL_EXPORTER_OTLP_HEADERS"]
    assert {"name": "extra", "emptyDir": {}} in pod["volumes"]
    assert {"name": "extra", "mountPath": "/extra"} in container["volumeMounts"]
    # an existing account, made elsewhere
    docs, _ = checks.render(helm_dir / "gateway", _values(tmp_path, {"serviceAccount": {"create": False}}, "sa.yaml"))
    assert "ServiceAccount" not in {d["kind"] for d in docs}
    assert _pod(docs, "llmesh-gateway")["serviceAccountName"] == "default"


@pytest.mark.parametrize("chart", (*SERVICES, "llmesh"))
def test_set_pod_labels_renders(chart, helm_dir):
    flag = "podLabels.team=x" if chart != "llmesh" else "global.podLabels.team=x"
    proc = checks.helm("template", "llmesh", helm_dir / chart, "--set", flag)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments and all(d["spec"]["template"]["metadata"]["labels"]["team"] == "x" for d in deployments)


@pytest.mark.parametrize("values, message", [
    ({"extraEnv": [{"name": "LLMESH_GATEWAY_REQUIRE_AUTH", "value": "false"}]}, "extraEnv.0.name"),
    ({"extraEnv": [{"value": "x"}]}, "name is required"),
    ({"persistence": {"size": "big"}}, "persistence.size"),
    ({"serviceAccount": {"create": "yes"}}, "serviceAccount.create"),
    ({"podLabels": {"team": 3}}, "podLabels.team"),
    ({"settings": {"not_a_setting": 1}}, "Additional property not_a_setting is not allowed"),
    ({"ingress": {"enabled": True, "hosts": [{"host": "x", "paths": [{"path": "nope"}]}]}}, "ingress.hosts.0"),
])
def test_the_schema_stays_strict(values, message, helm_dir, tmp_path):
    docs, problems = checks.render(helm_dir / "gateway", _values(tmp_path, values))
    assert docs == [] and any(message in p for p in problems), problems


# --- gateway replicas ----------------------------------------------------------------------

def test_a_gateway_hpa_above_one_replica_needs_redis(helm_dir, allowed_env, tmp_path):
    hpa = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}
    docs, problems = checks.render(helm_dir / "gateway", _values(tmp_path, hpa))
    assert docs == [] and any("gateway: 5 replicas (autoscaling.maxReplicas) and 1 workers per pod need a shared "
                              "key store" in p for p in problems), problems
    redis = {**hpa, "secretEnv": {"LLMESH_REDIS_URL": {"secretName": "redis", "key": "url"}}}
    values = _values(tmp_path, redis, "redis.yaml")
    assert checks.chart_problems(helm_dir / "gateway", values, allowed_env) == []  # the HPA is valid Kubernetes
    docs, _ = checks.render(helm_dir / "gateway", values)
    scaler = _by_kind(docs, "HorizontalPodAutoscaler")["llmesh-gateway"]["spec"]
    assert scaler["scaleTargetRef"]["name"] == "llmesh-gateway" and scaler["maxReplicas"] == 5
    assert "replicas" not in _by_kind(docs, "Deployment")["llmesh-gateway"]["spec"]  # the HPA's to set
    assert properties.shared_key_store_problems(docs) == []
    broken = copy.deepcopy(docs)
    env = _pod(broken, "llmesh-gateway")["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "LLMESH_REDIS_URL"]
    _by_kind(broken, "HorizontalPodAutoscaler")["llmesh-gateway"]["spec"]["scaleTargetRef"]["name"] = "gone"
    assert properties.shared_key_store_problems(broken) == [
        "HorizontalPodAutoscaler/llmesh-gateway: scaleTargetRef names no rendered Deployment"]
    _by_kind(broken, "HorizontalPodAutoscaler")["llmesh-gateway"]["spec"]["scaleTargetRef"]["name"] = "llmesh-gateway"
    assert properties.shared_key_store_problems(broken) == [
        "Deployment/llmesh-gateway: up to 5 replicas of 1 workers without LLMESH_REDIS_URL from a Secret (each "
        "would keep its own API keys)"]


# --- ingress -------------------------------------------------------------------------------

def test_ingress_and_httproute_reach_the_gateways_http_port(helm_dir, allowed_env, tmp_path):
    docs, problems = checks.render(helm_dir / "llmesh", [], release="prod")
    assert not {"Ingress", "HTTPRoute"} & {d["kind"] for d in docs}  # off by default
    values = _values(tmp_path, {"gateway": {
        "ingress": {"enabled": True, "className": "nginx",
                    "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                    "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
                    "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "edge", "namespace": "infra"}],
                      "hostnames": ["llm.example.com"], "timeouts": {"request": "600s"}}}})
    assert checks.chart_problems(helm_dir / "llmesh", values, allowed_env) == []  # the Ingress is valid Kubernetes
    docs, _ = checks.render(helm_dir / "llmesh", values, release="prod")
    ingress = _by_kind(docs, "Ingress")["prod-gateway"]
    path = ingress["spec"]["rules"][0]["http"]["paths"][0]
    assert path["backend"] == {"service": {"name": "prod-gateway", "port": {"name": "http"}}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    route = _by_kind(docs, "HTTPRoute")["prod-gateway"]
    assert route["spec"]["parentRefs"] == [{"name": "edge", "namespace": "infra"}]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "prod-gateway", "port": 8080}]
    assert route["spec"]["rules"][0]["timeouts"] == {"request": "600s"}
    broken = copy.deepcopy(docs)
    _by_kind(broken, "HTTPRoute")["prod-gateway"]["spec"]["rules"][0]["backendRefs"][0]["port"] = 50051
    _by_kind(broken, "Ingress")["prod-gateway"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"][
        "name"] = "prod-engine"
    _by_kind(broken, "HTTPRoute")["prod-gateway"]["spec"]["parentRefs"] = []
    assert properties.ingress_problems(broken) == [
        "Ingress/prod-gateway: /v1 goes to prod-engine:http, not the gateway's http port",
        "HTTPRoute/prod-gateway: no parentRefs (attached to no Gateway)",
        "HTTPRoute/prod-gateway: goes to prod-gateway:50051, not the gateway's http port"]
    docs, problems = checks.render(helm_dir / "gateway", _values(tmp_path, {"httpRoute": {"enabled": True}}, "r.yaml"))
    assert docs == [] and any("httpRoute.parentRefs" in p for p in problems), problems


# --- a fresh clone -------------------------------------------------------------------------

def test_every_chart_lints_strict_on_a_fresh_clone(tmp_path):
    clone = properties.fresh_clone(tmp_path / "helm")
    assert not list(clone.rglob("*.tgz"))
    assert properties.fresh_clone_lint_problems(clone) == []
    (clone / "gateway" / "charts" / "llmesh-common").unlink()  # as before: nothing in charts/
    problems = properties.fresh_clone_lint_problems(clone)
    assert len(problems) == 1 and problems[0].startswith("gateway: helm lint --strict")
    assert "missing these dependencies: llmesh-common" in problems[0]
