"""values.schema.json of each llmesh chart, derived from the services' pydantic settings.

A chart's `settings` map holds the service's own settings (LLMESH_<SERVICE>_*) by field
name and its `mesh` map the mesh-wide ones (LLMESH_*): their schema is the settings
classes' own JSON schema, so a setting a service reads has a chart value, a name it
doesn't read is refused, and a wrong type fails `helm lint`. The rest of the values are
described here. deploy-check fails when a committed schema differs from this;
regenerate with

    .venv/bin/python -m tests.deploy.values_schema --write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic_settings import BaseSettings

from llmesh.settings import MeshSettings, ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / "deploy" / "helm"
UMBRELLA = "llmesh"

# Settings the charts set themselves (from port, metricsPort, httpPort, graceSeconds, the pod):
# where a pod is reached is the pod's IP, never a value.
COMMON_MANAGED = {"host", "port", "metrics_port", "grace_s", "advertise_address"}
MANAGED = {"gateway": {"http_host", "http_port", "workers", "require_auth"}, "engine": {"endpoint_id"}}
# the mounted ConfigMap, the pod's state volume, the mesh's trust (always tls) and the mounted
# mesh certificate (CA, certificate, key: meshTLS / certManager)
MESH_MANAGED = {"config_file", "state_dir", "trust", "tls_ca_file", "tls_cert_file", "tls_key_file"}
# Secrets: only through secretEnv (a Secret's key), never as a plain value in `settings`/`mesh`.
SECRET_SETTINGS = {"mesh": {"redis_url", "consul_token"}, "cache": {"redis_url"}, "modelmgr": {"database_url"}}
# Charts whose image carries models to copy onto the state volume (seedModels).
SEEDED = {"engine", "modelmgr"}

_KEEP = {"type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
         "maxLength", "description", "anyOf", "const"}


def settings_classes() -> dict[str, type[ServiceSettings]]:
    """Each service's settings class, found by import (services/<name>/config.py)."""
    import importlib
    classes = {}
    for config in sorted((ROOT / "services").glob("*/config.py")):
        module = importlib.import_module(f"llmesh.{config.parent.name}.config")
        found = [v for v in vars(module).values()
                 if isinstance(v, type) and issubclass(v, ServiceSettings) and v is not ServiceSettings]
        if len(found) != 1:
            raise RuntimeError(f"{config}: expected one ServiceSettings subclass, found {found}")
        classes[config.parent.name] = found[0]
    return classes


def env_prefix(cls: type[BaseSettings]) -> str:
    return cls.model_config.get("env_prefix", "")


def _clean(node: dict) -> dict:
    out = {k: v for k, v in node.items() if k in _KEEP}
    if "anyOf" in out:
        out["anyOf"] = [_clean(n) for n in out["anyOf"]]
    return out


def settings_schema(cls: type[BaseSettings], managed: set[str]) -> dict:
    props = cls.model_json_schema()["properties"]
    return {"type": "object", "additionalProperties": False,
            "properties": {name: _clean(node) for name, node in sorted(props.items()) if name not in managed}}


def _port() -> dict:
    return {"type": "integer", "minimum": 1, "maximum": 65535}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    node = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        node["required"] = required
    return node


def _monitor() -> dict:
    return _obj({"enabled": {"type": "boolean"}, "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                 "labels": {"type": "object", "additionalProperties": {"type": "string"}}})


_K8S_NAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}


def secret_env_names() -> list[str]:
    """The env names of the secret settings (SECRET_SETTINGS), the keys secretEnv accepts."""
    classes = {"mesh": MeshSettings, **settings_classes()}
    return sorted(env_prefix(classes[owner]) + field.upper()
                  for owner, fields in SECRET_SETTINGS.items() for field in fields)


def _secret_env() -> dict:
    ref = _obj({"secretName": _K8S_NAME, "key": {"type": "string", "minLength": 1,
                                                  "pattern": "^[-._a-zA-Z0-9]+$"}}, ["secretName", "key"])
    return {"type": "object", "propertyNames": {"enum": secret_env_names()}, "additionalProperties": ref,
            "description": "secret settings by env name, each {secretName, key} of a Secret"}


def _cert_manager() -> dict:
    return _obj({"enabled": {"type": "boolean"},
                 "issuerRef": _obj({"name": {"type": "string"}, "kind": {"type": "string"},
                                    "group": {"type": "string"}}),
                 "duration": {"type": "string"}, "renewBefore": {"type": "string"}})


def _mesh_tls() -> dict:
    return _obj({"create": {"type": "boolean", "description": "generate the certificate Secret (no cert-manager)"}})


def _mesh_ca() -> dict:
    return _obj({"name": {**_K8S_NAME, "description": "the mesh CA's Secret (generated certificates)"}})


def _network_policy() -> dict:
    return _obj({"enabled": {"type": "boolean"}, "metricsFrom": {"type": "array", "items": {"type": "object"}},
                 "extraIngress": {"type": "array", "items": {"type": "object"}}})


_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITY = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([EPTGMK]i?|[mk])?$"}


def _service_account() -> dict:
    return _obj({"create": {"type": "boolean"}, "name": {"type": "string"}, "annotations": _LABELS,
                 "automount": {"type": "boolean", "description": "mount an API token (llmesh calls no Kubernetes "
                                                                 "API)"}})


def _extra_env() -> dict:
    entry = _obj({"name": {"type": "string", "minLength": 1, "pattern": "^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                           "not": {"pattern": "^LLMESH_"}},
                  "value": {"type": "string"}, "valueFrom": {"type": "object"}}, ["name"])
    return {"type": "array", "items": entry,
            "description": "more environment variables; LLMESH_* settings go in settings, mesh or secretEnv"}


def _persistence() -> dict:
    return _obj({
        "enabled": {"type": "boolean", "description": "a PersistentVolumeClaim for the state volume (else emptyDir)"},
        "perPod": {"type": "boolean", "description": "a claim per pod, made and deleted with it"},
        "existingClaim": {"type": "string"},
        "size": _QUANTITY,
        "storageClass": {"type": "string"},
        "accessModes": {"type": "array", "minItems": 1, "items": {
            "enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany", "ReadOnlyMany"]}},
        "sizeLimit": {"anyOf": [_QUANTITY, {"const": ""}]}})


def _ingress() -> dict:
    path = _obj({"path": {"type": "string", "pattern": "^/"},
                 "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]}}, ["path"])
    return _obj({"enabled": {"type": "boolean"}, "className": {"type": "string"}, "annotations": _LABELS,
                 "hosts": {"type": "array", "items": _obj({"host": {"type": "string"},
                                                           "paths": {"type": "array", "items": path}})},
                 "tls": {"type": "array", "items": _obj({"secretName": {"type": "string"},
                                                         "hosts": {"type": "array", "items": {"type": "string"}}})}})


def _http_route() -> dict:
    return _obj({"enabled": {"type": "boolean"},
                 "parentRefs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                 "hostnames": {"type": "array", "items": {"type": "string"}},
                 "pathPrefix": {"type": "string", "pattern": "^/"},
                 "timeouts": _obj({"request": {"type": "string"}, "backendRequest": {"type": "string"}}),
                 "annotations": _LABELS})


def service_schema(service: str, cls: type[ServiceSettings]) -> dict:
    props = {
        "global": {"type": "object"},
        "llmesh-common": {"type": "object", "description": "values of the library chart (none used)"},
        "enabled": {"type": "boolean", "description": "the umbrella chart's switch for this service"},
        "image": _obj({"repository": {"type": "string", "minLength": 1}, "tag": {"type": "string"},
                       "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}, ["repository"]),
        "imagePullSecrets": {"type": "array", "items": _obj({"name": {"type": "string"}}, ["name"])},
        "fullnameOverride": {"type": "string"},
        "replicaCount": {"type": "integer", "minimum": 0},
        "port": _port(),
        "metricsPort": _port(),
        "graceSeconds": {"type": "number", "minimum": 0},
        "preStopSleepSeconds": {"type": "integer", "minimum": 0},
        "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                         "headless": {"type": "boolean"}}),
        "settings": settings_schema(cls, COMMON_MANAGED | MANAGED.get(service, set())
                                    | SECRET_SETTINGS.get(service, set())),
        "mesh": settings_schema(MeshSettings, MESH_MANAGED | SECRET_SETTINGS["mesh"]),
        "liveConfig": {"type": "string"},
        "existingSecret": {"type": "string"},
        "secretEnv": _secret_env(),
        "certManager": _cert_manager(),
        "meshTLS": _mesh_tls(),
        "meshCA": _mesh_ca(),
        "networkPolicy": _network_policy(),
        "tracing": _obj({"otlpEndpoint": {"type": "string"}}),
        "resources": _obj({"requests": {"type": "object"}, "limits": {"type": "object"}}),
        "podDisruptionBudget": _obj({"enabled": {"type": "boolean"},
                                     "minAvailable": {"type": ["integer", "string"]},
                                     "maxUnavailable": {"type": ["integer", "string"]}}),
        "metrics": _obj({"serviceMonitor": _monitor(), "podMonitor": _monitor()}),
        "startupProbe": {"type": ["object", "null"]},
        "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "readOnlyRootFilesystem": {"type": "boolean"},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": {"type": "object"}},
        "affinity": {"type": "object"},
        "extraVolumes": {"type": "array", "items": {"type": "object"}},
        "extraVolumeMounts": {"type": "array", "items": {"type": "object"}},
        "podLabels": _LABELS,
        "serviceAccount": _service_account(),
        "podSecurityContext": {"type": "object"},
        "securityContext": {"type": "object"},
        "topologySpreadConstraints": {"type": "array", "items": {"type": "object"}},
        "priorityClassName": {"type": "string"},
        "runtimeClassName": {"type": "string"},
        "extraEnv": _extra_env(),
        "persistence": _persistence(),
    }
    if service in SEEDED:
        props["seedModels"] = {"type": "string", "description": "models in the image copied to the state "
                                                                "volume's models/ at start; '' none"}
    if service == "gateway":
        props["autoscaling"] = _obj({"enabled": {"type": "boolean"}, "minReplicas": {"type": "integer", "minimum": 1},
                                     "maxReplicas": {"type": "integer", "minimum": 1},
                                     "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1,
                                                                        "maximum": 100}})
        props["ingress"] = _ingress()
        props["httpRoute"] = _http_route()
        props["httpPort"] = _port()
        props["workers"] = {"type": "integer", "minimum": 1, "maximum": 256,
                            "description": "worker processes sharing the ports (LLMESH_GATEWAY_WORKERS); "
                                           "more than 1 needs Redis; request about one CPU each"}
    if service == "engine":
        props["autoscaling"] = _obj({"enabled": {"type": "boolean"}, "keda": _obj({
            "prometheusAddress": {"type": "string", "minLength": 1},
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 1},
            "threshold": {"type": "number", "exclusiveMinimum": 0},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "query": {"type": "string"}})})
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": f"llmesh {service} chart values",
            "type": "object", "additionalProperties": False, "properties": props,
            "required": ["image", "port", "metricsPort", "settings", "mesh", "meshTLS", "networkPolicy"]}


def umbrella_schema(services: list[str]) -> dict:
    glob = _obj({
        "image": _obj({"tag": {"type": "string"}}),
        "mesh": settings_schema(MeshSettings, MESH_MANAGED | SECRET_SETTINGS["mesh"]),
        "liveConfig": {"type": "string"},
        "tracing": _obj({"otlpEndpoint": {"type": "string"}}),
        "existingSecret": {"type": "string"},
        "secretEnv": _secret_env(),
        "certManager": _cert_manager(),
        "meshTLS": _mesh_tls(),
        "meshCA": _mesh_ca(),
        "networkPolicy": _network_policy(),
        "podLabels": _LABELS,
    })
    props = {"global": glob,
             "llmesh-common": {"type": "object", "description": "values of the library chart (none used)"}}
    props.update({name: {"type": "object", "properties": {"enabled": {"type": "boolean"}}} for name in services})
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "llmesh umbrella chart values",
            "type": "object", "additionalProperties": False, "properties": props}


def expected() -> dict[Path, dict]:
    classes = settings_classes()
    out = {HELM / name / "values.schema.json": service_schema(name, cls) for name, cls in classes.items()}
    out[HELM / UMBRELLA / "values.schema.json"] = umbrella_schema(sorted(classes))
    return out


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2) + "\n"


def stale() -> list[Path]:
    """Committed schemas that differ from what the settings classes say now."""
    return [path for path, schema in expected().items()
            if not path.is_file() or path.read_text() != render(schema)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the committed schemas")
    args = parser.parse_args()
    if args.write:
        for path, schema in expected().items():
            path.write_text(render(schema))
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    bad = stale()
    for path in bad:
        print(f"{path.relative_to(ROOT)} is stale: run python -m tests.deploy.values_schema --write")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
