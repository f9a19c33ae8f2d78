"""`make deploy-check`: the compose mesh, the Helm charts and the Dockerfile, validated
without Docker or a cluster; and proof that each check fails on a broken copy."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tests.deploy import checks, values_schema

CHARTS = (*checks.SERVICE_CHARTS, checks.UMBRELLA)


def _monitors_values(chart: str, dest: Path) -> Path:
    """Values that turn on every optional object, so their templates are rendered and checked."""
    on = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    values = {name: on for name in checks.SERVICE_CHARTS} if chart == checks.UMBRELLA else on
    path = dest / f"{chart}-monitors.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _variants(chart: str) -> list[str]:
    gpu = checks.HELM_DIR / chart / "values-gpu.yaml"
    return ["default", "monitors"] + (["gpu"] if gpu.is_file() else [])


# --- compose -------------------------------------------------------------------------------

def test_compose_file_matches_the_compose_spec():
    assert checks.compose_schema_problems() == []


def test_compose_services_have_healthchecks_and_set_only_known_settings(compose_doc, allowed_env):
    assert checks.compose_problems(compose_doc, allowed_env, checks.stage_names()) == []
    services = compose_doc["services"]
    # the mesh the issue asks for: platform, the five services, two CPU engines and a GPU profile
    for name in ("consul", "etcd", "prometheus", "grafana", "jaeger", "gateway", "scheduler", "modelmgr",
                 "cache", "engine-1", "engine-2", "engine-gpu-1"):
        assert name in services, name
    assert services["engine-gpu-1"]["profiles"] == ["gpu"]
    devices = services["engine-gpu-1"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    env = services["gateway"]["environment"]
    assert env["LLMESH_DISCOVERY"] == "consul" and env["LLMESH_CONFIG_BACKEND"] == "etcd"


def test_compose_seed_config_is_a_valid_live_config():
    text = (checks.COMPOSE.parent / "llmesh.yaml").read_text()
    assert checks.live_config_problems("seed", text) == []


def _unshared(doc: dict) -> dict:
    """A copy in which no two services share a YAML-anchored mapping."""
    return json.loads(json.dumps(doc))


def test_missing_healthcheck_unknown_setting_and_bad_dependency_fail(compose_doc, allowed_env):
    doc = _unshared(compose_doc)
    del doc["services"]["engine-2"]["healthcheck"]
    doc["services"]["gateway"]["environment"]["LLMESH_GATEWAY_NO_SUCH_SETTING"] = "1"
    doc["services"]["cache"]["environment"]["HOSTNAME_OVERRIDE"] = "x"
    doc["services"]["cache"]["depends_on"]["nowhere"] = {"condition": "service_healthy"}
    doc["services"]["scheduler"]["build"]["target"] = "no-such-stage"
    doc["services"]["modelmgr"]["healthcheck"]["test"] = ["CMD", "python", "-m", "llmesh.rpc.probe", "127.0.0.1:50052"]
    doc["services"]["cache"]["healthcheck"]["test"][-1] = "cache:9091"  # --http: not its metrics port
    del doc["services"]["engine-1"]["environment"]["LLMESH_ENGINE_METRICS_PORT"]  # tls + Consul need it
    doc["services"]["engine-1"]["environment"]["LLMESH_ENGINE_N_THREADS"] = "two"
    doc["services"]["gateway"]["stop_grace_period"] = "30s"  # its grace is 30 s: killed mid-drain
    problems = checks.compose_problems(doc, allowed_env, checks.stage_names())
    assert "service engine-2: no healthcheck" in problems
    assert any("LLMESH_GATEWAY_NO_SUCH_SETTING is not a setting" in p for p in problems)
    assert any("HOSTNAME_OVERRIDE is neither a service setting" in p for p in problems)
    assert "service cache: depends on undefined service nowhere" in problems
    assert any("no-such-stage" in p for p in problems)
    assert "service modelmgr: healthcheck probes port 50052, the service listens on 50053" in problems
    assert ("service cache: healthcheck probes port 9091, the service serves /healthz on 9090 "
            "(LLMESH_CACHE_METRICS_PORT)") in problems
    assert any(p.startswith("service engine-1: tls trust with Consul needs LLMESH_ENGINE_METRICS_PORT")
               for p in problems)
    assert ("service engine-1: healthcheck probes port 9090, the service serves /healthz on no port "
            "(LLMESH_ENGINE_METRICS_PORT)") in problems
    assert any(p.startswith("service engine-1: LLMESH_ENGINE_N_THREADS='two'") for p in problems)
    assert "service gateway: stop_grace_period 30s does not exceed its grace 30s" in problems
    assert len(problems) == 11


def test_a_branch_with_a_broken_entrypoint_or_env_name_fails(compose_doc, allowed_env):
    """What a branch breaks in the compose file fails here, before any image is built (the live
    smoke fails on it too: docs/deploy.md): an entrypoint's module misspelt inside its shell script,
    and a variable renamed so that a rule over several settings fails (a message, not a traceback)."""
    doc = _unshared(compose_doc)
    svc = doc["services"]["scheduler"]
    svc["entrypoint"] = [w.replace("llmesh.scheduler", "llmesh.schedulr") for w in svc["entrypoint"]]
    env = svc["environment"]
    env["LLMESH_TLS_CERT"] = env.pop("LLMESH_TLS_CERT_FILE")
    assert "llmesh.schedulr" in checks.compose_modules(doc)
    [imports] = checks.import_problems(checks.compose_modules(doc))
    assert "llmesh.schedulr" in imports
    problems = checks.compose_problems(doc, allowed_env, checks.stage_names())
    assert any("LLMESH_TLS_CERT is not a setting" in p for p in problems), problems
    assert any(p.startswith("service scheduler: ") and "LLMESH_TLS_KEY_FILE" in p for p in problems), problems


def test_compose_schema_violation_fails(compose_doc, tmp_path):
    doc = _unshared(compose_doc)
    doc["services"]["gateway"]["ports"] = {"http": 8080}  # must be a list
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(doc))
    problems = checks.compose_schema_problems(path)
    assert len(problems) == 1 and "compose-spec" in problems[0]


def test_live_config_check_refuses_a_bad_document():
    assert checks.live_config_problems("x", "default: {max_attempts: 0}\n") != []


# --- Dockerfile ----------------------------------------------------------------------------

def test_dockerfile_sources_stages_users_and_modules(compose_doc, allowed_env):
    problems, modules = checks.dockerfile_problems(allowed_env=allowed_env)
    assert problems == []
    assert {"gateway", "scheduler", "modelmgr", "cache", "engine-cpu", "engine-gpu"} <= checks.stage_names()
    for service in ("gateway", "scheduler", "modelmgr", "cache", "engine"):
        assert f"llmesh.{service}" in modules
    assert "llmesh.rpc.probe" in modules
    # every module an image or the compose file runs imports, as `python -m` loads it
    assert checks.import_problems(modules | checks.compose_modules(compose_doc)) == []


def test_dockerfile_with_missing_or_ignored_source_root_user_or_bad_setting_fails(tmp_path, allowed_env):
    text = checks.DOCKERFILE.read_text()
    text = text.replace("COPY services/ services/", "COPY services/ services/\nCOPY no-such-dir/ x/\nCOPY bench/ b/", 1)
    text = text.replace("LLMESH_CACHE_METRICS_PORT=9090", "LLMESH_CACHE_METRICS_PORT=9090 LLMESH_CACHE_NOPE=1")
    text = text.replace("FROM runtime AS scheduler", "FROM runtime AS scheduler\nUSER root")
    text = text.replace("LLMESH_ENGINE_BACKEND=llamacpp", "LLMESH_ENGINE_BACKEND=llama")
    broken = tmp_path / "Dockerfile"
    broken.write_text(text)
    problems, _ = checks.dockerfile_problems(broken, allowed_env=allowed_env)
    assert any("no-such-dir/ does not exist" in p for p in problems)
    assert any("bench/ is excluded by .dockerignore" in p for p in problems)
    assert any("LLMESH_CACHE_NOPE is not a setting" in p for p in problems)
    assert any("stage scheduler runs its entrypoint as root" in p for p in problems)
    assert any("LLMESH_ENGINE_BACKEND='llama'" in p for p in problems)
    assert len(problems) == 5


def test_entrypoint_that_does_not_import_fails():
    problems = checks.import_problems({"llmesh.no_such_service"})
    assert len(problems) == 1 and "llmesh.no_such_service" in problems[0]


def test_dockerignore_rules():
    patterns = checks._dockerignore_patterns(checks.DOCKERIGNORE)
    assert not checks.dockerignored("libs/llmesh/settings.py", patterns)
    assert not checks.dockerignored("requirements.lock", patterns)
    assert checks.dockerignored("bench/gateway.py", patterns)
    assert checks.dockerignored("libs/llmesh/v1/engine_pb2.py", patterns)
    assert checks.dockerignored("services/engine/__pycache__/app.cpython-311.pyc", patterns)
    assert checks.dockerignored(".venv/bin/python", patterns)


# --- Helm ----------------------------------------------------------------------------------

def test_values_schemas_follow_the_settings_classes():
    assert values_schema.stale() == []
    schema = values_schema.service_schema("engine", values_schema.settings_classes()["engine"])
    settings = schema["properties"]["settings"]["properties"]
    assert "n_ctx" in settings and "vllm_model_path" in settings  # every engine setting has a value
    assert "port" not in settings and "advertise_address" not in settings  # the chart sets these


@pytest.mark.parametrize("chart", CHARTS)
def test_chart_lints_renders_and_validates(chart, helm_dir, allowed_env, tmp_path):
    for variant in _variants(chart):
        values = {"default": [], "monitors": [_monitors_values(chart, tmp_path)],
                  "gpu": [helm_dir / chart / "values-gpu.yaml"]}[variant]
        assert checks.chart_problems(helm_dir / chart, values, allowed_env) == [], variant


def test_gpu_engine_requests_a_gpu_and_keda_follows_the_autoscaler(helm_dir):
    docs, problems = checks.render(helm_dir / "engine", [helm_dir / "engine" / "values-gpu.yaml"])
    assert problems == []
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LLMESH_ENGINE_BACKEND"] == "vllm"
    assert env["LLMESH_ENGINE_ADVERTISE_ADDRESS"] == "$(K8S_POD_IP):50061"
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    # the scheduler's desired replicas for this model, one replica per unit
    assert trigger["query"] == 'max(llmesh_scheduler_replicas{kind="desired",model="qwen2.5-0.5b-instruct"})'
    assert trigger["threshold"] == "1"
    assert "replicas" not in deployment["spec"]
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: each engine pod is an endpoint
    broken = copy.deepcopy(docs)
    next(d for d in broken if d["kind"] == "ScaledObject")["spec"]["scaleTargetRef"]["name"] = "elsewhere"
    assert checks.crd_problems(broken) == ["ScaledObject/llmesh-engine: scaleTargetRef names no rendered Deployment"]


def test_gpu_engine_settings_reach_the_pod_and_a_map_is_json(helm_dir, allowed_env, tmp_path):
    values = tmp_path / "gpu-tuned.yaml"
    values.write_text(yaml.safe_dump({"settings": {"vllm_tensor_parallel_size": 2, "vllm_dtype": "bfloat16",
                                                   "vllm_max_num_seqs": 64, "vllm_quantization": "fp8",
                                                   "vllm_engine_args": {"enforce_eager": True, "seed": 7}},
                                      "resources": {"requests": {"nvidia.com/gpu": 2},
                                                    "limits": {"nvidia.com/gpu": 2}}}))
    gpu = [helm_dir / "engine" / "values-gpu.yaml", values]
    assert checks.chart_problems(helm_dir / "engine", gpu, allowed_env) == []
    docs, _ = checks.render(helm_dir / "engine", gpu)
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LLMESH_ENGINE_VLLM_TENSOR_PARALLEL_SIZE"] == "2" and env["LLMESH_ENGINE_VLLM_DTYPE"] == "bfloat16"
    assert json.loads(env["LLMESH_ENGINE_VLLM_ENGINE_ARGS"]) == {"enforce_eager": True, "seed": 7}
    # the env check reads a map setting as the engine does, so a map that is not JSON fails it
    assert checks.value_problems("x", {"LLMESH_ENGINE_VLLM_ENGINE_ARGS": "map[enforce_eager:true]"}) != []
    assert checks.value_problems("x", {"LLMESH_ENGINE_VLLM_ENGINE_ARGS": '{"enforce_eager": true}'}) == []


def test_umbrella_wires_services_by_release_name(helm_dir):
    docs, problems = checks.render(helm_dir / "llmesh", [], release="prod")
    assert problems == []
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert names == {f"prod-{s}" for s in checks.SERVICE_CHARTS}
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "prod-gateway")
    env = {e["name"]: e.get("value") for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLMESH_GATEWAY_SCHEDULER_ADDRESS"] == "prod-scheduler:50052"
    assert env["LLMESH_GATEWAY_HTTP_PORT"] == "8080"


def test_gateway_workers_value_sets_the_setting_and_is_checked(helm_dir, allowed_env, tmp_path):
    values = tmp_path / "workers.yaml"
    values.write_text(yaml.safe_dump({"workers": 4, "secretEnv": {"LLMESH_REDIS_URL": {"secretName": "redis",
                                                                                       "key": "url"}},
                                      "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}}))
    assert checks.chart_problems(helm_dir / "gateway", [values], allowed_env) == []
    docs, _ = checks.render(helm_dir / "gateway", [values])
    gateway = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLMESH_GATEWAY_WORKERS"]["value"] == "4"
    assert env["LLMESH_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "url"}
    default, _ = checks.render(helm_dir / "gateway", [])
    env = {e["name"]: e.get("value") for e in next(d for d in default if d["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLMESH_GATEWAY_WORKERS"] == "1"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"workers": 0}))
    docs, problems = checks.render(helm_dir / "gateway", [bad])
    assert docs == [] and any("workers" in p for p in problems), problems


def test_external_consul_and_etcd_bind_services_to_the_pod_ip(helm_dir, allowed_env, tmp_path):
    """What a service registers in Consul is its bound address: the pod IP, not 0.0.0.0."""
    values = tmp_path / "external.yaml"
    values.write_text(yaml.safe_dump({"global": {"mesh": {
        "discovery": "consul", "consul_address": "consul.infra:8500",
        "config_backend": "etcd", "etcd_address": "etcd.infra:2379"}}}))
    assert checks.chart_problems(helm_dir / "llmesh", [values], allowed_env) == []
    docs, _ = checks.render(helm_dir / "llmesh", [values])
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        service = deployment["metadata"]["labels"]["app.kubernetes.io/name"].upper()
        assert env[f"LLMESH_{service}_HOST"]["value"] == "$(K8S_POD_IP)"
        assert env["K8S_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["LLMESH_DISCOVERY"]["value"] == "consul"
        assert env["LLMESH_ETCD_ADDRESS"]["value"] == "etcd.infra:2379"


@pytest.mark.parametrize("values, message", [
    ({"port": "fifty"}, "port: Invalid type. Expected: integer, given: string"),
    ({"settings": {"n_ctx": "big"}}, "settings.n_ctx: Invalid type"),
    ({"settings": {"n_threads_typo": 2}}, "Additional property n_threads_typo is not allowed"),
    ({"mesh": {"discovery": "zookeeper"}}, "mesh.discovery"),
    ({"mesh": {"service_secret_file": "/x"}}, "Additional property service_secret_file is not allowed"),
    ({"mesh": {"trust": "local"}}, "Additional property trust is not allowed"),  # always tls
    ({"mesh": {"redis_url": "redis://:pw@redis:6379/0"}}, "Additional property redis_url is not allowed"),
    ({"mesh": {"consul_token": "t"}}, "Additional property consul_token is not allowed"),
    ({"secretEnv": {"LLMESH_ENGINE_MODEL": {"secretName": "s", "key": "k"}}}, "secretEnv"),
    ({"secretEnv": {"LLMESH_REDIS_URL": {"secretName": "s"}}}, "key is required"),
    ({"meshCA": {"name": "Not_A_Name"}}, "meshCA.name"),
])
def test_values_schema_rejects_a_wrong_value(values, message, helm_dir, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    docs, problems = checks.render(helm_dir / "engine", [path])
    assert docs == []
    assert any(message in p for p in problems), problems


def test_broken_template_fails(scratch_charts, allowed_env):
    template = scratch_charts / "gateway" / "templates" / "service.yaml"
    template.write_text(template.read_text() + "\n{{ .Values.port | nosuchfunction }}\n")
    problems = checks.chart_problems(scratch_charts / "gateway", [], allowed_env)
    assert any("helm lint --strict" in p for p in problems)
    assert any("helm template" in p and "nosuchfunction" in p for p in problems)


def test_manifest_invalid_for_kubernetes_fails(scratch_charts, allowed_env):
    lib = scratch_charts / "llmesh-common" / "templates" / "_deployment.tpl"
    lib.write_text(lib.read_text().replace("periodSeconds: 5", "periodSeconds: soon", 1))
    problems = checks.chart_problems(scratch_charts / "scheduler", [], allowed_env)
    assert problems and all("not valid for Kubernetes" in p and "periodSeconds" in p for p in problems)


def test_chart_env_value_probe_and_grace_checks_fail_when_broken(scratch_charts, allowed_env):
    lib = scratch_charts / "llmesh-common" / "templates" / "_deployment.tpl"
    text = lib.read_text()
    text = text.replace("{{- include \"llmesh.serviceEnv\" . | nindent 12 }}",
                        "{{- include \"llmesh.serviceEnv\" . | nindent 12 }}\n"
                        "            - name: LLMESH_SCHEDULER_NOT_A_SETTING\n              value: \"1\"")
    text = text.replace("terminationGracePeriodSeconds: "
                        "{{ add .Values.preStopSleepSeconds (ceil .Values.graceSeconds) 5 }}",
                        "terminationGracePeriodSeconds: 3")
    text = text.replace("""          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics""", """          livenessProbe:
            tcpSocket:
              port: {{ .Values.port }}""")
    text = text.replace("""          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics""", """          readinessProbe:
            httpGet:
              path: /healthz
              port: grpc""")  # the mTLS gRPC port: the kubelet cannot pass its handshake
    lib.write_text(text)
    helpers = scratch_charts / "llmesh-common" / "templates" / "_helpers.tpl"
    helpers.write_text(helpers.read_text().replace("value: {{ .Values.metricsPort | quote }}", 'value: "nine"'))
    problems = checks.chart_problems(scratch_charts / "scheduler", [], allowed_env)
    assert any("LLMESH_SCHEDULER_NOT_A_SETTING is not a setting" in p for p in problems)
    assert any("LLMESH_SCHEDULER_METRICS_PORT='nine'" in p for p in problems)
    assert any("terminationGracePeriodSeconds 3 < preStop" in p for p in problems)
    assert any("livenessProbe is not an httpGet of /healthz or /readyz on the metrics port" in p for p in problems)
    assert any("readinessProbe is not an httpGet of /healthz or /readyz on the metrics port" in p for p in problems)
    assert len(problems) == 5


# --- the mesh certificates: tests/deploy/test_deploy_security.py --------------------------
