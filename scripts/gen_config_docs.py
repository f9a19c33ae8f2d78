"""docs/configuration.md, generated from the settings classes (environment variables)
and the live-config schema (libs/llmesh/liveconfig/schema.py).

    .venv/bin/python scripts/gen_config_docs.py                                  # print it
    .venv/bin/python scripts/gen_config_docs.py --write docs/configuration.md    # make docs
    .venv/bin/python scripts/gen_config_docs.py --check docs/configuration.md    # make docs-check

Names, types, constraints and defaults come from the pydantic classes; descriptions
from each field's ``Field(description=...)``, else from DESCRIPTIONS below (a short
note for fields that have none, taken from the README's prose). A DESCRIPTIONS key
that matches no field is an error, so the notes cannot outlive their settings."""

from __future__ import annotations

import argparse
import difflib
import enum
import importlib
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import annotated_types
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = "docs/configuration.md"
STALE = f"{OUTPUT} is stale: run make docs"

# (title, import path) of every pydantic-settings class a process reads.
SETTINGS: tuple[tuple[str, str | type], ...] = (
    ("Every service", "llmesh.settings.MeshSettings"),
    ("gateway", "llmesh.gateway.config.GatewaySettings"),
    ("engine", "llmesh.engine.config.EngineSettings"),
    ("scheduler", "llmesh.scheduler.config.SchedulerSettings"),
    ("modelmgr", "llmesh.modelmgr.config.ModelMgrSettings"),
    ("cache", "llmesh.cache.config.CacheSettings"),
)
LIVE_ROOT = "llmesh.liveconfig.schema.MeshConfig"

# Notes for fields without a description: "Class.field" (the class that declares or
# redeclares it) or "field" (any class).
DESCRIPTIONS: dict[str, str] = {
    # ServiceSettings, every service
    "host": "address the service's gRPC server binds (0.0.0.0 or :: need an advertise address)",
    "port": "gRPC port",
    "log_level": "level of the JSON log lines on stderr",
    "event_loop": "the asyncio event loop the process runs on",
    # MeshSettings
    "MeshSettings.discovery": "`static`: addresses from settings; `etcd`: each service holds a lease-bound key "
                              "(gone LLMESH_REGISTRY_TTL_S after it dies); "
                              "`consul`: registered with a gRPC health check",
    "MeshSettings.etcd_address": "where etcd is (discovery and live config)",
    "MeshSettings.consul_address": "where the Consul agent is: `host:port`, `http://...` or `https://...`",
    "MeshSettings.discovery_prefix": "etcd key prefix services register under",
    "MeshSettings.config_backend": "where the live config comes from: `file` (LLMESH_CONFIG_FILE, watched), "
                                   "`etcd` (LLMESH_CONFIG_PREFIX, watched), `none`",
    "MeshSettings.config_file": "the live config's YAML file (`config_backend: file`)",
    "MeshSettings.config_prefix": "etcd key prefix of the live config (`config_backend: etcd`)",
    # gateway
    "GatewaySettings.port": "gRPC port of `llmesh.v1.Gateway`",
    "GatewaySettings.http_host": "address the OpenAI-compatible HTTP front binds",
    "GatewaySettings.http_port": "port of the OpenAI-compatible HTTP front",
    "GatewaySettings.scheduler_address": "the scheduler, whose endpoint table the gateway watches",
    "GatewaySettings.modelmgr_address": "the model manager, whose registry's models the gateway accepts; "
                                        "unset: only models engines serve",
    "GatewaySettings.cache_address": "the cache service; empty: no response cache",
    "GatewaySettings.catalog_refresh_s": "how often the model catalog is read from the model manager",
    "GatewaySettings.require_auth": "credentials always required, never local mode; it is also off whenever a "
                                    "listener is off loopback, Redis or a JWKS is set (decided at start, never "
                                    "from the key store: an emptied store never opens the door)",
    "GatewaySettings.jwks_file": "JWT signing keys (JWKS) from a file; set: JWT bearer tokens are accepted",
    "GatewaySettings.jwks_url": "JWT signing keys (JWKS) from a URL",
    "GatewaySettings.jwt_issuer": "the `iss` a JWT must carry; required with a JWKS",
    "GatewaySettings.jwt_audience": "the `aud` a JWT must carry; required with a JWKS",
    "GatewaySettings.jwt_tenant_claim": "the JWT claim naming the tenant",
    "GatewaySettings.jwt_groups_claim": "the JWT claim listing the caller's groups",
    # engine
    "EngineSettings.backend": "`llamacpp` (CPU), `vllm` (GPU, the `vllm` extra) or `sim` (timing model, no weights) "
                              "generate text; `minilm` serves embeddings from a sentence-transformers BERT folder "
                              "(all-minilm-l6-v2), `llamacpp_embed` from a GGUF on llama.cpp "
                              "(LLMESH_ENGINE_EMBED_POOLING), and `vllm` for a pooling model "
                              "(LLMESH_ENGINE_VLLM_RUNNER)",
    "EngineSettings.model": "the model this engine serves (its name in the model store)",
    "EngineSettings.model_dir": "the model store the engine loads from",
    "EngineSettings.endpoint_id": "this engine's name in the scheduler's endpoint table",
    "EngineSettings.scheduler_address": "the scheduler the engine reports to; unset: it reports to none",
    "EngineSettings.report_interval_s": "how often load is reported to the scheduler",
    "EngineSettings.default_temperature": "temperature of a request that leaves it unset (SmolLM2's recommendation)",
    "EngineSettings.default_top_p": "top_p of a request that leaves it unset",
    "EngineSettings.max_running": "sequences decoded together (llamacpp: KV slots of n_ctx tokens each)",
    "EngineSettings.max_waiting": "requests queued in priority lanes; past it a newcomer is refused (429) or "
                                  "sheds a lower class",
    "EngineSettings.n_threads": "llama.cpp threads",
    "EngineSettings.sim_context_length": "the context length a sim engine reports",
    "EngineSettings.sim_prefill_ms_per_token": "sim: prefill time per uncached prompt token",
    "EngineSettings.sim_output_tokens": "sim: answer length (max_tokens cuts it shorter)",
    # modelmgr
    "ModelMgrSettings.scheduler_address": "the scheduler, for placement and engine addresses",
    "ModelMgrSettings.drain_timeout_s": "how long an old version's replicas get to drain after a promotion",
    "ModelMgrSettings.eval_min_exact_match": "least exact-match rate on the golden set to pass the eval gate",
    "ModelMgrSettings.eval_max_tokens": "max_tokens of each golden-set generation",
    # cache
    "CacheSettings.backend": "`memory` (one process) or `redis` (shared by replicas, kept across restarts)",
    "CacheSettings.redis_url": "the cache's Redis (`backend: redis`)",
    "CacheSettings.max_entries_per_tenant": "least-recently-used cap per tenant",
    "CacheSettings.embed_model_dir": "all-MiniLM-L6-v2 for the semantic mode (`make model` extracts it)",
    # live config
    "GenerationDefaults.temperature": "temperature of a request that leaves it unset",
    "GenerationDefaults.top_p": "top_p of a request that leaves it unset",
    "GenerationDefaults.max_tokens": "max_tokens of a request that leaves it unset",
    "ModelPolicy.generation": "generation defaults",
    "SplitTarget.model": "a model (or version) the alias sends traffic to",
    "SplitTarget.weight": "its share, relative to the other targets' weights",
    "TrafficSplit.targets": "the models behind the alias; sticky per request `user`",
    "RateLimit.requests_per_minute": "sliding 60-second window, exact across gateway replicas with Redis",
    "RateLimit.tokens_per_minute": "input + reserved output tokens per sliding minute",
    "RateLimit.max_concurrency": "requests in flight at once",
    "Budget.period": "UTC day or month",
    "Guards.pii": "mask PII in the prompt before it leaves the gateway",
    "Guards.injection": "prompt-injection screen: `block` (400, code `prompt_injection`), "
                        "`flag` (the score goes to the audit record) or `off`",
    "Grant.models": "models and aliases allowed (403 for others; `/v1/models` lists only these); unset: all",
    "Grant.priority": "the engine queue's priority class of the requests",
    "TenantPolicy.budget": "spending per period",
    "TenantPolicy.guards": "prompt and answer guards",
    "CacheConfig.enabled": "look up and store answers",
    "CacheConfig.ttl_s": "entry lifetime",
    "CacheRule.enabled": "override of `cache.enabled`",
    "CacheRule.ttl_s": "override of `cache.ttl_s`",
    "CacheRule.semantic_threshold": "override of `cache.semantic_threshold`",
    "CacheRule.mode": "override of `cache.mode`",
    "CacheRule.cache_sampled": "override of `cache.cache_sampled`",
    "CircuitBreaker.enabled": "breakers on",
    "CircuitBreaker.failure_threshold": "failures in a row that open a breaker",
    "CircuitBreaker.reset_after_s": "open this long, then one probe (half-open)",
    "CircuitBreaker.window_s": "the window error rate and latency are judged over",
    "CircuitBreaker.min_requests": "attempts the window needs before rate and latency count",
    "CircuitBreaker.error_rate": "failed share above which a breaker opens",
    "CircuitBreaker.latency_p99_s": "p99 time to first token above which a breaker opens",
    "RetryBudget.ratio": "what each request adds to the retry bank",
    "RetryBudget.burst": "the most the bank holds (besides ratio x the last 10 s of requests)",
    "Provider.api_key_env": "environment variable holding the API key; one the gateway allows "
                            "([`LLMESH_GATEWAY_PROVIDER_KEY_ENVS`](#llmesh_gateway_provider_key_envs))",
    "Provider.api_key_file": "file holding the API key, inside the gateway's "
                             "[`LLMESH_GATEWAY_PROVIDER_KEY_DIR`](#llmesh_gateway_provider_key_dir) (relative: to it)",
    "Autoscale.max_replicas": "upper bound of the desired replica count",
    "Cascade.cheap": "model that answers first",
    "Cascade.strong": "model asked when the cheap answer is not confident enough",
    "MeshConfig.default": "policy of a model without its own entry",
    "MeshConfig.models": "per model: routing, retries, fallbacks, generation defaults, system prompt",
    "MeshConfig.splits": "traffic splits: an alias spread over models by weight (A/B, canary)",
    "MeshConfig.cache": "the response cache",
    "MeshConfig.circuit_breaker": "per-endpoint circuit breakers (gateway)",
    "MeshConfig.retry_budget": "what retries and fallback hops may add",
    "MeshConfig.autoscaling": "the scheduler's autoscaler",
}

# Defaults computed at start (default_factory), shown as a note instead of a value.
FACTORY_DEFAULTS: dict[str, str] = {
    "EngineSettings.endpoint_id": "`<hostname>-engine`",
}

# Dict keys in live-config paths: what a key names.
KEY_NAMES = {"models": "model", "tenants": "tenant", "rate_limits": "tenant", "groups": "group", "prices": "model",
             "providers": "provider", "splits": "alias", "shadows": "name", "cascades": "alias"}

PREAMBLE = """\
# Configuration reference

<!-- Generated by scripts/gen_config_docs.py from the settings classes and the live-config schema.
     Do not edit by hand: change the classes, then run `make docs`. `make test` runs `make docs-check`,
     which fails when this file is stale. -->

llmesh is configured in two places:

- **Environment variables**, read once when a process starts, by typed settings classes
  (pydantic-settings): where a service listens, where its peers and stores are, sizes and time
  limits. Each service reads its own `LLMESH_<SERVICE>_*` variables and the mesh-wide `LLMESH_*`
  ones; an invalid value stops the process at start with a message naming it. `llmesh up` sets the
  ports, addresses and model directories of the processes it starts (and `LLMESH_TRUST=local`
  unless another trust is set).
- **The live config**: one YAML document (`llmesh.yaml`, or etcd under `LLMESH_CONFIG_PREFIX`)
  that every service watches and applies within a second, with no restart. It is validated as a
  whole: an invalid document is rejected, the last good one stays, and the log line
  `config rejected` and `llmesh_config_rejected_total` say so (see
  [operations](operations.md#a-rejected-config)). `llmesh config validate -f FILE` checks one.

Types: `path` is a file system path; "optional" means the value may be unset (no default value).
Constraints are pydantic's (`≥ 0` and so on); an out-of-range value is refused.
"""

OTHER_ENV = """\
### Read outside the settings classes

| variable | read by | meaning |
| --- | --- | --- |
| <a id="llmesh_api_key"></a>`LLMESH_API_KEY` | `llmesh chat`, `examples/python/chat.py`, the TypeScript example | the API key sent as `authorization: Bearer ...` |
| `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` | every service | set: traces are exported over OTLP/gRPC (tracing is off without one) |
| `OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none` | every service | tracing off even with an endpoint |
| `OTEL_SERVICE_NAME` | every service | the traces' `service.name` (default `llmesh-<service>`) |
| `OTEL_TRACES_SAMPLER` and the other standard `OTEL_*` variables | the OpenTelemetry SDK | sampling and exporter options, e.g. `parentbased_traceidratio` |
| `CONSUL_HTTP_TOKEN` | Consul discovery | ACL token when `LLMESH_CONSUL_TOKEN` is unset |
| `HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY` | the gateway's provider client | proxies for external providers, read once at start |
| the provider's `api_key_env` | the gateway, per call | a provider's API key ([`providers`](#provider)); only a name in [`LLMESH_GATEWAY_PROVIDER_KEY_ENVS`](#llmesh_gateway_provider_key_envs) |
"""  # noqa: E501 - a Markdown table: one row a line


@dataclass(frozen=True)
class Row:
    name: str  # the variable, or the key in the live config
    anchor: str | None
    type: str
    default: str
    description: str


def load(path: str | type) -> type:
    """A class from its import path (or the class itself)."""
    if isinstance(path, type):
        return path
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _declared_by(cls: type[BaseModel], name: str) -> str:
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return klass.__name__
    return cls.__name__


def _note(cls: type[BaseModel], name: str, used: set[str]) -> str:
    for key in (f"{_declared_by(cls, name)}.{name}", name):
        if key in DESCRIPTIONS:
            used.add(key)
            return DESCRIPTIONS[key]
    return ""


def type_name(annotation) -> str:
    """A type as a reader of the docs writes it; models link to their section."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{_literal(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        text = " or ".join(type_name(a) for a in kept)
        return f"{text}, optional" if len(kept) < len(args) else text
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        if args and typing.get_origin(args[0]) is typing.Literal:
            return f"map from {type_name(args[0])} to {type_name(args[1])}"
        return f"map of {type_name(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _literal(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value.value if isinstance(value, enum.Enum) else value)


_BOUNDS = ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "≤"),
           (annotated_types.Lt, "lt", "<"), (annotated_types.MinLen, "min_length", "length ≥"),
           (annotated_types.MaxLen, "max_length", "length ≤"))


def constraints(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {_literal(getattr(item, attr))}")
    return ", ".join(found)


def default_text(cls: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.default_factory is not None:
        return FACTORY_DEFAULTS.get(f"{_declared_by(cls, name)}.{name}", "computed at start")
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return f"see [{type(value).__name__}](#{type(value).__name__.lower()})"
    if isinstance(value, Path):
        if value.is_absolute():
            try:
                value = value.relative_to(ROOT)
            except ValueError:
                return f"`{value.name}` in the package"
        return f"`{value.as_posix()}`"
    if isinstance(value, (bool, enum.Enum)):
        return f"`{_literal(value)}`"
    if isinstance(value, (dict, list, tuple)) and not value:
        return "`{}`" if isinstance(value, dict) else "`[]`"
    return f"`{value}`"


def env_names(cls, name: str, field: FieldInfo) -> list[str]:
    """The variables pydantic-settings reads a field from: the prefix and the name, or its aliases."""
    alias = field.validation_alias or field.alias
    if isinstance(alias, str):
        return [alias.upper()]
    if isinstance(alias, AliasChoices):
        return [c.upper() for c in alias.choices if isinstance(c, str)]
    return [f"{cls.model_config.get('env_prefix', '')}{name}".upper()]


def _row(cls: type[BaseModel], name: str, field: FieldInfo, label: str, anchor: str | None,
         used: set[str]) -> Row:
    kind = type_name(field.annotation)
    bounds = constraints(field)
    return Row(label, anchor, f"{kind}, {bounds}" if bounds else kind, default_text(cls, name, field),
               field.description or _note(cls, name, used))


def settings_rows(cls, used: set[str]) -> list[Row]:
    rows = []
    for name, field in cls.model_fields.items():
        env = env_names(cls, name, field)
        rows.append(_row(cls, name, field, ", ".join(f"`{e}`" for e in env), env[0].lower(), used))
    return rows


def live_sections(root: type[BaseModel]) -> Iterator[tuple[type[BaseModel], list[str]]]:
    """Each model of the live config with the paths where it occurs, depth first in field order."""
    paths: dict[type[BaseModel], list[str]] = {}
    order: list[type[BaseModel]] = []

    def visit(cls: type[BaseModel], path: str) -> None:
        if cls not in paths:
            paths[cls] = []
            order.append(cls)
        paths[cls].append(path)
        for name, field in cls.model_fields.items():
            for child, suffix in _nested(name, field.annotation):
                visit(child, f"{path}.{name}{suffix}".lstrip("."))

    visit(root, "")
    for cls in order:
        yield cls, paths[cls]


def _nested(name: str, annotation) -> Iterator[tuple[type[BaseModel], str]]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
    elif origin is dict:
        for child, suffix in _nested(name, args[1]):
            yield child, f".<{KEY_NAMES.get(name, 'name')}>{suffix}"
    elif origin in (list, tuple):
        for child, suffix in _nested(name, args[0]):
            yield child, f"[]{suffix}"
    elif origin in (typing.Union, types.UnionType):
        for a in args:
            yield from _nested(name, a)


def table(rows: Sequence[Row], first: str) -> list[str]:
    out = [f"| {first} | type | default | description |", "| --- | --- | --- | --- |"]
    for r in rows:
        anchor = f'<a id="{r.anchor}"></a>' if r.anchor else ""
        out.append(f"| {anchor}{r.name} | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.description)} |")
    return out


def _doc(cls: type) -> str:
    text = cls.__doc__ or ""
    inherited = any(text == (base.__doc__ or "") for base in cls.__mro__[1:])
    return "" if inherited or not text else " ".join(text.split()).replace("``", "`")


def render(settings: Sequence[tuple[str, type]], live_root: type[BaseModel], used: set[str] | None = None) -> str:
    """The reference for these classes; the DESCRIPTIONS keys it drew on are added to ``used``."""
    used = set() if used is None else used
    out = [PREAMBLE, "## Environment variables", ""]
    for title, cls in settings:
        prefix = cls.model_config.get("env_prefix", "")
        out += [f"### {title}: `{prefix}*`", "",
                f"`{cls.__module__}.{cls.__qualname__}`" + (f": {_doc(cls)}" if _doc(cls) else ""), ""]
        out += table(settings_rows(cls, used), "variable") + [""]
    out += [OTHER_ENV, "## Live config", "",
            "Each section below is one model of `llmesh.liveconfig.schema`; *where* gives its paths in the "
            "document (`<model>`, `<tenant>`, ... stand for the names you choose). Unknown keys are refused.", ""]
    for cls, paths in live_sections(live_root):
        where = ", ".join(f"`{p}`" for p in paths) if any(paths) else "the document's top level"
        out += [f"### {cls.__name__}", "", f"Where: {where}."]
        if _doc(cls):
            out += ["", _doc(cls)]
        rows = [_row(cls, name, field, f"`{name}`", None, used) for name, field in cls.model_fields.items()]
        out += [""] + table(rows, "key") + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def reference() -> str:
    """The document for the classes as they are now."""
    used: set[str] = set()
    text = render([(title, load(path)) for title, path in SETTINGS], load(LIVE_ROOT), used)
    unused = sorted(set(DESCRIPTIONS) - used)
    if unused:
        raise SystemExit(f"gen_config_docs: DESCRIPTIONS entries that match no field (remove them): {unused}")
    return text


def stale(path: Path, text: str) -> list[str]:
    """The unified diff between ``path`` and ``text``; empty when they match."""
    current = path.read_text() if path.is_file() else ""
    return list(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                     str(path), "generated"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, metavar="FILE", help="write the reference to FILE")
    mode.add_argument("--check", type=Path, metavar="FILE", help="exit 1 with a diff when FILE is stale")
    args = parser.parse_args(argv)
    text = reference()
    if args.write:
        args.write.write_text(text)
    elif args.check:
        diff = stale(args.check, text)
        if diff:
            sys.stderr.writelines(diff)
            print(STALE, file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
