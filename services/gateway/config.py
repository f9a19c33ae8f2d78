"""Gateway settings, from LLMESH_GATEWAY_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from llmesh.settings import DEFAULT_PORTS, ServiceSettings, default_address


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LLMESH_GATEWAY_", extra="ignore", frozen=True)

    port: int = DEFAULT_PORTS["gateway"]
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=DEFAULT_PORTS["gateway_http"], ge=0, le=65535)
    workers: int = Field(default=1, ge=1, le=256, description="worker processes sharing the HTTP and gRPC ports "
                         "(SO_REUSEPORT) under one supervisor; more than 1 needs LLMESH_REDIS_URL and fixed ports")
    scheduler_address: str = default_address("scheduler")
    modelmgr_address: str | None = default_address("modelmgr")
    cache_address: str | None = default_address("cache")
    # A semantic lookup embeds the question: MiniLM on a CPU took 6-11 ms alone, and the cache service's
    # semantic lookups 10-50 ms in the compose mesh; 20 ms turned a share of its hits into misses. With
    # two busy processes on the cache's 2 cores, 99.6-100 % of semantic lookups took <= 50 ms, 38-45 % <= 20.
    cache_budget_s: float = Field(default=0.05, gt=0, description="longest a cache lookup may take; then it is a "
                                  "miss (llmesh_cache_late_lookups_total counts what those lookups found)")
    request_timeout_s: float = Field(default=600.0, gt=0, description="longest a request may take")
    catalog_refresh_s: float = Field(default=10.0, gt=0)
    queue_full_retry_after_s: float = Field(default=1.0, gt=0, description="Retry-After sent with the 429 when every "
                                            "engine that could serve a request has a full queue")
    lost_engine_hold_s: float = Field(default=30.0, ge=0, description="a request whose engine went away under it "
                                      "before its first token waits this long (within its deadline) for that engine "
                                      "to come back and is tried there once more; past it, elsewhere (it may be "
                                      "what killed the engine: it never goes to another one meanwhile)")
    body_timeout_s: float = Field(default=30.0, gt=0, description="a client slower than this to send its request "
                                  "body gets 408 and its connection closed")

    # Governance. Local mode (no credentials needed until the first API key) only with both listeners
    # on loopback, no Redis, no JWT and require_auth unset; decided at start, never from the key store.
    require_auth: bool = False
    keys_file: Path | None = Field(default=None, description="API keys without Redis; default <state_dir>/keys.json")
    jwks_file: Path | None = None
    jwks_url: str | None = None
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    jwt_tenant_claim: str = "tenant"
    jwt_groups_claim: str = "groups"
    jwks_refetch_s: float = Field(default=30.0, gt=0, description="a token whose kid the JWKS lacks reads the "
                                  "JWKS again at most this often (the keys are read again every 300 s anyway)")
    # External providers: the live config names a provider's key; only these sources may be read.
    provider_key_dir: Path | None = Field(default=None, description="the only directory a provider's "
                                          "api_key_file is read from (a relative one: inside it; symlinks and "
                                          "'..' resolved); default <state_dir>/provider-keys")
    provider_key_envs: str = Field(default="", pattern=r"^[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*$|^$",
                                   description="comma-separated environment variables a provider's api_key_env "
                                   "may name (e.g. OPENAI_API_KEY); empty: none")
    model_dir: Path | None = Field(default=None, description="where to read models' tokenizers for admission")
    reserve_tokens: int = Field(default=512, ge=1, description="output tokens reserved when max_tokens is unset")
    audit: bool = Field(default=True, description="one hash-chained record per request")
    audit_file: Path | None = Field(default=None,
                                    description="default <state_dir>/audit.jsonl; one per gateway process "
                                                "(worker i of several writes <stem>.worker<i><suffix>)")
    audit_fsync: bool = Field(default=False, description="fsync every written batch")
    audit_required: bool = Field(default=False, description="fail closed: while the audit log cannot be written "
                                 "(a write failed), refuse every request with 503 audit_unavailable before it "
                                 "reaches an engine; off: serve it, and count the record not written "
                                 "(llmesh_audit_write_failures_total)")
    # The guards (PII masking, the prompt-injection screen) on a large prompt run in worker processes.
    guard_workers: int = Field(default=2, ge=0, le=64, description="worker processes for the guards' work on "
                               "large prompts (a small one is screened inline) and for parsing large request "
                               "bodies; 0: all inline, on the event loop")
    body_offload_bytes: int = Field(default=256 * 1024, ge=0, description="an HTTP request body larger than this "
                                    "is parsed in the guard workers, off the event loop (a smaller one inline)")
    guard_deadline_s: float = Field(default=5.0, gt=0, description="longest the guards may work on one prompt; "
                                    "then the request is refused (400 guard_timeout)")
    guard_queue: int = Field(default=16, ge=1, description="large prompts waiting for a guard worker; more get 429 "
                             "(guards_busy)")
    injection_scan_chars: int = Field(default=128 * 1024, ge=1, description="characters of a message the "
                                      "prompt-injection screen reads; past them it decides on what it read and the "
                                      "request's record says injection_truncated")
    ledger_share_s: float = Field(default=0.05, ge=0, le=5, description="with Redis: how often each gateway "
                                  "process publishes its in-flight load per engine and reads the other processes' "
                                  "(workers and replicas), so every one routes on all of it (0: on its own share "
                                  "and the engines' reports only; at least 0.01 otherwise)")
    loop_watch_ms: float = Field(default=0, ge=0, description="log a warning each time the event loop wakes this "
                                 "much late, with the CPU its thread and the process spent meanwhile (0: off)")
    injection_scan_total_chars: int = Field(default=512 * 1024, ge=1, description="characters of a request the "
                                            "prompt-injection screen reads")
    # The Batch API (/v1/files, /v1/batches): kept in Redis with LLMESH_REDIS_URL, else in batch_dir.
    batch_dir: Path | None = Field(default=None, description="batch files and state without Redis (one gateway "
                                   "process); default <state_dir>/batches")
    batch_max_file_bytes: int = Field(default=50 << 20, ge=1024, le=512 << 20, description="largest batch input "
                                      "file; a larger upload is refused (400) once it passes this many bytes")
    batch_max_lines: int = Field(default=50_000, ge=1, le=1_000_000, description="requests in one batch file")
    batch_max_files: int = Field(default=1000, ge=1, description="files a tenant keeps (inputs and outputs)")
    batch_in_flight: int = Field(default=8, ge=1, le=1024, description="batch lines one gateway process runs "
                                 "at once at most")
    batch_busy_in_flight: int = Field(default=1, ge=1, le=1024, description="batch lines one gateway process "
                                      "runs at once however busy the engines are")
    batch_headroom: float = Field(default=0.25, ge=0, le=1, description="share of the engines' slots batch "
                                  "lines leave free for interactive requests")
    batch_claim_idle_s: float = Field(default=300.0, gt=0, description="with Redis: a batch line taken by a "
                                      "worker and not done this long (the worker died) is run by another")
    batch_retention_s: int = Field(default=30 * 86400, ge=60, description="with Redis: batch files and state "
                                   "expire this long after their last change")

    @field_validator("ledger_share_s")
    @classmethod
    def _ledger_share_not_a_busy_loop(cls, v: float) -> float:
        if 0 < v < 0.01:
            raise ValueError("ledger_share_s is 0 (off) or at least 0.01")
        return v

    @model_validator(mode="after")
    def _workers_share_fixed_ports(self) -> GatewaySettings:
        if self.workers > 1 and 0 in (self.port, self.http_port):
            raise ValueError("workers > 1 share fixed ports: set LLMESH_GATEWAY_PORT and LLMESH_GATEWAY_HTTP_PORT "
                             "(0, any free port, would give each worker its own)")
        return self

    @model_validator(mode="after")
    def _jwt_checks_issuer_and_audience(self) -> GatewaySettings:
        if (self.jwks_file or self.jwks_url) and not (self.jwt_issuer and self.jwt_audience):
            raise ValueError("JWT (LLMESH_GATEWAY_JWKS_FILE or LLMESH_GATEWAY_JWKS_URL) needs the issuer and "
                             "audience its tokens must carry: set LLMESH_GATEWAY_JWT_ISSUER and "
                             "LLMESH_GATEWAY_JWT_AUDIENCE")
        return self

    @model_validator(mode="after")
    def _required_audit_is_on(self) -> GatewaySettings:
        if self.audit_required and not self.audit:
            raise ValueError("audit_required needs the audit log: set LLMESH_GATEWAY_AUDIT=true")
        return self
