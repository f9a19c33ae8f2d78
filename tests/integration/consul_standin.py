"""A Consul agent STAND-IN: no Consul binary can be installed on these machines, so
the Consul adapter is tested against this small real HTTP server on 127.0.0.1. It
implements only the part of the agent's HTTP API that py-consul 1.8.0 calls for us
(register, deregister, agent services, health service with blocking queries, leader
status), the gRPC and HTTP checks the mesh registers, and the documented behaviours the
adapter relies on; each is cited below.
It is NOT Consul and never makes a feature count as done on its own: the real-agent
test (tests/integration/test_discovery_consul.py) runs wherever `consul` is on PATH.

Run it as a process so tests can kill and restart it (an agent restart):
    python -m tests.integration.consul_standin --port 8500 [--acl-token T]
        [--acl-service-token SERVICE=TOKEN ...] [--acl-default-policy deny|allow]
        [--tls-cert C --tls-key K [--tls-ca CA]]
ACLs (class Acl) are on when a token is given: --acl-token is a management token,
--acl-service-token one with the policy the compose mesh's consul-acl bootstrap gives each
service (deploy/compose/consul/acl-bootstrap.sh).
Stand-in only controls (not Consul API), for the failure cases:
    PUT /standin/leader?present=0|1     lose / regain the cluster leader
    PUT /standin/index?value=N          move the index back to N (changes count on from there)
    PUT /standin/index?pin=N            answer every query with X-Consul-Index N (pin= unpins)
    GET /standin/stats                  {"health_queries": n} answered so far
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import random
import re
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

NODE = {"ID": "00000000-0000-0000-0000-000000000001", "Node": "standin", "Address": "127.0.0.1",
        "Datacenter": "dc1", "TaggedAddresses": {"lan": "127.0.0.1", "wan": "127.0.0.1"}, "Meta": {}}

# https://developer.hashicorp.com/consul/api-docs/features/blocking : "If not set, the
# wait time defaults to 5 minutes", "limited to 10 minutes", and "a small random amount
# of additional wait time is added ... This adds up to wait / 16 additional time".
DEFAULT_WAIT_S, MAX_WAIT_S = 300.0, 600.0

# https://developer.hashicorp.com/consul/api-docs/agent/check (DeregisterCriticalServiceAfter):
# "The minimum timeout is 1 minute, and the process that reaps critical services runs
# every 30 seconds". Also the default check Timeout is 10 s (same page, Timeout).
MIN_DEREGISTER_S, REAP_EVERY_S, DEFAULT_CHECK_TIMEOUT_S = 60.0, 30.0, 10.0

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

DURATION = re.compile(r"([\d.]+)(ns|us|µs|ms|s|m|h)")
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(duration: str | int | float | None, default: float) -> float:
    if duration is None or duration == "":
        return default
    if isinstance(duration, (int, float)):  # Go's JSON decodes a bare number as nanoseconds
        return duration / 1e9
    return sum(float(n) * UNITS[u] for n, u in DURATION.findall(duration))


def lower_keys(d: dict) -> dict:
    # Consul decodes request bodies case-insensitively (agent/http_decode: mapstructure
    # with lower-cased keys); py-consul sends "name", "id", but "DeregisterCriticalServiceAfter".
    return {k.lower(): v for k, v in d.items()}


class Check:
    def __init__(self, check_id: str, service_id: str, definition: dict, state: State):
        self.check_id = check_id
        self.service_id = service_id
        self.grpc_target = definition.get("grpc", "")
        self.http_url = definition.get("http", "")
        self.interval = max(seconds(definition.get("interval"), 10.0), 0.05)
        self.timeout = seconds(definition.get("timeout"), DEFAULT_CHECK_TIMEOUT_S)
        after = definition.get("deregistercriticalserviceafter")
        self.deregister_after = max(seconds(after, 0), MIN_DEREGISTER_S) if after else None
        # https://developer.hashicorp.com/consul/api-docs/agent/check (Status): a new
        # check starts "critical" unless the definition says otherwise.
        self.status = definition.get("status") or "critical"
        self.critical_since = time.monotonic()
        self.definition = definition
        self._state = state
        self._stop = threading.Event()
        if self.grpc_target or self.http_url:
            threading.Thread(target=self._run, daemon=True, name=f"check-{check_id}").start()

    def stop(self) -> None:
        self._stop.set()

    def probe(self) -> str:
        return self._probe_http() if self.http_url else self._probe_grpc()

    def _probe_http(self) -> str:
        # https://developer.hashicorp.com/consul/docs/services/usage/checks (HTTP checks): a GET
        # of the URL every interval (GET unless the definition names a Method); "any 2xx code is
        # considered passing, a 429 Too Many Requests is a warning, and anything else is a
        # failure" (critical), as is no answer within the timeout.
        request = urllib.request.Request(self.http_url, method=self.definition.get("method") or "GET",
                                         headers={"User-Agent": "Consul Health Check"})
        try:  # straight to the URL, as the agent dials it (no proxy from the environment)
            with NO_PROXY.open(request, timeout=self.timeout) as resp:
                code = resp.status
        except urllib.error.HTTPError as exc:  # urllib raises for 4xx/5xx (and unfollowed 3xx)
            code = exc.code
        except (OSError, ValueError):  # refused, reset, timed out, a URL it cannot use
            return "critical"
        if 200 <= code < 300:
            return "passing"
        return "warning" if code == 429 else "critical"

    def _probe_grpc(self) -> str:
        # https://developer.hashicorp.com/consul/docs/services/usage/checks (gRPC checks):
        # the target is "host:port" or "host:port/service"; the check calls
        # grpc.health.v1.Health/Check for that service name and passes on SERVING only.
        address, _, service = self.grpc_target.partition("/")
        try:
            with grpc.insecure_channel(address) as channel:
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
            return "passing" if resp.status == health_pb2.HealthCheckResponse.SERVING else "critical"
        except grpc.RpcError:
            return "critical"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            status = self.probe()
            if not self._stop.is_set():
                self._state.set_status(self, status)

    def json(self) -> dict:
        kind, target = ("http", {"HTTP": self.http_url}) if self.http_url else ("grpc", {"GRPC": self.grpc_target})
        return {"Node": NODE["Node"], "CheckID": self.check_id, "Name": f"Service '{self.service_id}' check",
                "Status": self.status, "ServiceID": self.service_id, "Type": kind,
                "Definition": {**target, "Interval": f"{self.interval:g}s",
                               "Timeout": f"{self.timeout:g}s",
                               "DeregisterCriticalServiceAfter": f"{self.deregister_after or 0:g}s"}}


class Acl:
    """Consul's ACL check, reduced to the tokens the mesh uses.

    https://developer.hashicorp.com/consul/docs/security/acl : with ACLs enabled every request
    is authorized by the rules of the token it presents, in the X-Consul-Token header or the
    `token` query parameter (api-docs/api-structure#authentication); a request without a token
    is made with the anonymous token. `default_policy` (agent config acl.default_policy) decides
    whatever no rule grants: "deny" refuses it, "allow" lets it through. A management token
    may do everything. A service token here has the rules the compose bootstrap writes:
    `service "<name>" { policy = "write" }` (register and deregister that service only),
    `service_prefix "" { policy = "read" }` and `node_prefix "" { policy = "read" }` (read
    every service's health). A token the agent does not know acts as the anonymous token
    (real Consul answers 403 "ACL not found"; both refuse)."""

    def __init__(self, management: str | None, service_tokens: dict[str, str] | None = None,
                 default_policy: str = "deny"):
        self.management = management
        self.services = dict(service_tokens or {})  # token -> the service it may write
        self.allow_by_default = default_policy == "allow"

    def may_write(self, token: str, service: str) -> bool:
        if token and token == self.management:
            return True
        if token in self.services:
            return self.services[token] == service
        return self.allow_by_default

    def may_read(self, token: str) -> bool:
        known = bool(token) and (token == self.management or token in self.services)
        return known or self.allow_by_default


class State:
    """The agent's registrations and the catalog's index, in memory: like
    `consul agent -dev` (the -dev flag: "all data is in-memory",
    developer.hashicorp.com/consul/docs/agent/config/cli-flags#_dev), or an agent whose data
    dir is lost with its container, a restarted stand-in has lost every registration."""

    def __init__(self, acl: Acl | None):
        self.lock = threading.Condition()
        self.services: dict[str, dict] = {}
        self.checks: dict[str, Check] = {}
        # A fresh agent starts its raft index low; a restarted one goes backwards.
        self.index = 1
        self.forced_index: int | None = None
        self.leader = True
        self.acl = acl
        self.health_queries = 0
        threading.Thread(target=self._reap, daemon=True, name="reaper").start()

    def bump(self) -> None:
        # One index for the services and checks tables: any registration or check change
        # wakes every blocking health query, changed or not ("the return of a blocking
        # request is no guarantee of a change", api-docs/features/blocking).
        self.index += 1
        self.lock.notify_all()

    def set_status(self, check: Check, status: str) -> None:
        with self.lock:
            if self.checks.get(check.check_id) is not check or check.status == status:
                return
            check.status = status
            if status == "critical":
                check.critical_since = time.monotonic()
            self.bump()

    def _reap(self) -> None:
        while True:
            time.sleep(REAP_EVERY_S)
            with self.lock:
                now = time.monotonic()
                for check in list(self.checks.values()):
                    if (check.deregister_after is not None and check.status == "critical"
                            and now - check.critical_since >= check.deregister_after):
                        self.remove(check.service_id)

    def remove(self, service_id: str) -> bool:
        if self.services.pop(service_id, None) is None:
            return False
        for cid in [c for c, chk in self.checks.items() if chk.service_id == service_id]:
            self.checks.pop(cid).stop()
        self.bump()
        return True

    def visible_index(self) -> int:
        return self.forced_index if self.forced_index is not None else self.index

    def health(self, name: str, passing: bool) -> list[dict]:
        out = []
        for sid, svc in self.services.items():
            if svc["Service"] != name:
                continue
            checks = [c for c in self.checks.values() if c.service_id == sid]
            # ?passing: "Specifies that the server should return only nodes with all
            # checks in the passing state" (api-docs/health#list-service-instances-for-service).
            if passing and any(c.status != "passing" for c in checks):
                continue
            serf = {"Node": NODE["Node"], "CheckID": "serfHealth", "Name": "Serf Health Status",
                    "Status": "passing", "ServiceID": ""}
            out.append({"Node": NODE, "Service": svc, "Checks": [serf, *(c.json() for c in checks)]})
        return out


class Handler(BaseHTTPRequestHandler):
    state: State  # set on the subclass built per server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: tests read answers, not access logs
        return

    def _send(self, code: int, body: object = None, headers: dict | None = None, text: str | None = None):
        data = (text if text is not None else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _token(self, query: dict) -> str:
        # https://developer.hashicorp.com/consul/api-docs/api-structure#authentication:
        # the token comes in X-Consul-Token (or ?token=); none is the anonymous token.
        return self.headers.get("X-Consul-Token") or query.get("token", [""])[0]

    def _may_write(self, query: dict, service: str) -> bool:
        return self.state.acl is None or self.state.acl.may_write(self._token(query), service)

    def _may_read(self, query: dict) -> bool:
        return self.state.acl is None or self.state.acl.may_read(self._token(query))

    def _denied(self) -> None:
        # Writes without permission fail with 403 "Permission denied" (acl.ErrPermissionDenied,
        # agent/agent_endpoint.go vetServiceRegister/vetServiceUpdate).
        self._send(403, text="Permission denied")

    def do_PUT(self):  # http.server's naming
        url = urlparse(self.path)
        query = parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        st = self.state
        if url.path == "/standin/leader":
            with st.lock:
                st.leader = query.get("present", ["1"])[0] == "1"
            return self._send(200, True)
        if url.path == "/standin/index":
            with st.lock:
                if "value" in query:  # the raft index moves back (a server restored from an older snapshot)
                    st.index = int(query["value"][0])
                if "pin" in query:  # every answer carries this index (the X-Consul-Index 0 bug)
                    pin = query["pin"][0]
                    st.forced_index = int(pin) if pin else None
                st.lock.notify_all()
            return self._send(200, True)
        if url.path == "/v1/agent/service/register":
            return self._register(raw, query)
        if url.path.startswith("/v1/agent/service/deregister/"):
            sid = url.path.rsplit("/", 1)[1]
            with st.lock:
                # service:write on the registered service's name (agent.go vetServiceUpdate)
                name = (st.services.get(sid) or {}).get("Service", sid)
                if not self._may_write(query, name):
                    return self._denied()
                found = st.remove(sid)
            # Newer agents answer 404 "Unknown service ID" for an unknown id (agent.go RemoveService).
            return self._send(200, None) if found else self._send(404, text=f'Unknown service ID "{sid}"')
        self._send(404, text="not implemented by the stand-in")

    def _register(self, raw: bytes, query: dict):
        st = self.state
        try:
            body = lower_keys(json.loads(raw or b"{}"))
        except ValueError as exc:
            return self._send(400, text=f"Request decode failed: {exc}")
        name = body.get("name", "")
        # agent/agent_endpoint.go AgentRegisterService: "Missing service name" (400), and
        # `if ipaddr.IsAny(args.Address)` -> 400 "Invalid service address" (0.0.0.0, ::, [::]).
        if not name:
            return self._send(400, text="Missing service name")
        address = body.get("address", "") or ""
        try:
            if address and ipaddress.ip_address(address.strip("[]")).is_unspecified:
                return self._send(400, text="Invalid service address")
        except ValueError:
            pass  # a host name: allowed
        if not self._may_write(query, name):  # service:write on its name (agent.go vetServiceRegister)
            return self._denied()
        sid = body.get("id") or name
        checks = [lower_keys(c) for c in body.get("checks") or ([] if not body.get("check") else [body["check"]])]
        with st.lock:
            st.remove(sid)  # registering an existing ID replaces it and its checks
            st.services[sid] = {"ID": sid, "Service": name, "Tags": body.get("tags") or [],
                                "Address": address, "Port": int(body.get("port") or 0),
                                "Meta": body.get("meta") or {}}
            for i, definition in enumerate(checks, start=1):
                # agent.go: one check is "service:<id>", several "service:<id>:<n>".
                cid = definition.get("checkid") or (f"service:{sid}" if len(checks) == 1 else f"service:{sid}:{i}")
                st.checks[cid] = Check(cid, sid, definition, st)
            st.bump()
        self._send(200, None)

    def do_GET(self):
        url = urlparse(self.path)
        query = parse_qs(url.query)
        st = self.state
        if url.path == "/v1/status/leader":
            with st.lock:
                return self._send(200, "127.0.0.1:8300" if st.leader else "")
        if url.path == "/standin/stats":
            with st.lock:
                return self._send(200, {"health_queries": st.health_queries})
        if url.path == "/v1/agent/services":
            with st.lock:
                services = dict(st.services) if self._may_read(query) else {}
            return self._send(200, services)
        if url.path.startswith("/v1/health/service/"):
            return self._health(url.path.rsplit("/", 1)[1], query)
        self._send(404, text="not implemented by the stand-in")

    def _health(self, name: str, query: dict):
        st = self.state
        passing = "passing" in query
        with st.lock:
            st.health_queries += 1
            if not st.leader:
                # Reads go to the servers; with none elected they fail with 500 and
                # structs.ErrNoLeader's text "No cluster leader" (agent/structs/errors.go).
                return self._send(500, text="No cluster leader")
            index = int(query.get("index", ["0"])[0])
            if index > 0:
                # Blocking query (api-docs/features/blocking): hang until the index moves
                # past the client's, or the wait (+ up to wait/16 jitter) runs out; then
                # answer with the current data either way. index=0 does not block
                # (agent/blockingquery: a MinQueryIndex of 0 runs the query once).
                wait = min(seconds(query.get("wait", [""])[0], DEFAULT_WAIT_S), MAX_WAIT_S)
                deadline = time.monotonic() + wait + random.uniform(0, wait / 16)
                while st.visible_index() <= index and st.leader:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    st.lock.wait(left)
            entries = st.health(name, passing)
            headers = {"X-Consul-Index": str(st.visible_index()), "X-Consul-KnownLeader": "true",
                       "X-Consul-LastContact": "0"}
            if not self._may_read(query):
                # ACLs filter reads instead of refusing them: the answer is empty and
                # says so (api-docs/api-structure#results-filtered-by-acls).
                entries = []
                headers["X-Consul-Results-Filtered-By-ACLs"] = "true"
        self._send(200, entries, headers)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that went away mid blocking query (a watch cancelled on shutdown) is normal.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def serve(port: int, acl: Acl | None, cert: str | None, key: str | None, ca: str | None) -> None:
    handler = type("StandinHandler", (Handler,), {"state": State(acl)})
    server = Server(("127.0.0.1", port), handler)
    if cert:
        # https://developer.hashicorp.com/consul/docs/security/encryption (HTTPS API): with
        # verify_incoming the agent requires a client certificate signed by its CA.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"consul stand-in listening on 127.0.0.1:{port}", flush=True)
    server.serve_forever(poll_interval=0.1)


class ConsulStandin:
    """The stand-in as a child process on a fixed free port: ``kill`` then ``start``
    again is an agent restart that lost its state (and whose index went backwards)."""

    def __init__(self, port: int | None = None, acl_token: str | None = None,
                 tls: tuple[str, str, str | None] | None = None, service_tokens: dict[str, str] | None = None):
        from llmesh.testing import free_ports  # only when used from tests
        self.port = port or free_ports(1)[0]
        self.acl_token = acl_token
        self.service_tokens = dict(service_tokens or {})  # service -> its token
        self.tls = tls
        self.proc = None

    @property
    def address(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        import subprocess
        from llmesh.testing import port_open, wait_until
        argv = [sys.executable, "-m", "tests.integration.consul_standin", "--port", str(self.port)]
        if self.acl_token:
            argv += ["--acl-token", self.acl_token]
        for service, token in self.service_tokens.items():
            argv += ["--acl-service-token", f"{service}={token}"]
        if self.tls:
            cert, key, ca = self.tls
            argv += ["--tls-cert", cert, "--tls-key", key] + (["--tls-ca", ca] if ca else [])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        if not wait_until(lambda: port_open(self.port) or self.proc.poll() is not None, timeout_s):
            raise RuntimeError("consul stand-in did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"consul stand-in exited with {self.proc.returncode}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        from llmesh.testing import terminate
        terminate(self.proc, signal.SIGTERM, 5.0)

    def control(self, path: str) -> None:
        """A stand-in-only switch (``/standin/leader?present=0``, ``/standin/index?value=0``)."""
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method="PUT")
        urllib.request.urlopen(req, timeout=5).read()

    def get(self, path: str, token: str | None = None) -> tuple[int, dict, object]:
        import urllib.error
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"X-Consul-Token": token} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--acl-token", help="ACLs on; this token may do everything (a management token)")
    p.add_argument("--acl-service-token", action="append", default=[], metavar="SERVICE=TOKEN",
                   help="ACLs on; TOKEN may register SERVICE and read every service")
    p.add_argument("--acl-default-policy", choices=("deny", "allow"), default="deny")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca", help="require client certificates signed by this CA")
    a = p.parse_args(argv)
    services = {token: service for service, _, token in (t.partition("=") for t in a.acl_service_token)}
    acl = Acl(a.acl_token, services, a.acl_default_policy) if a.acl_token or services else None
    serve(a.port, acl, a.tls_cert, a.tls_key, a.tls_ca)


if __name__ == "__main__":
    main(sys.argv[1:])
