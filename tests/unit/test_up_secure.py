"""``llmesh up --secure``'s plan: a certificate per child under the state directory, the
trust variables each child gets, gateway auth on; plain ``llmesh up`` stays local; the
CLI verbs find a running secure mesh's cli certificate; ``llmesh certs``."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from llmesh.cli import secure
from llmesh.cli.layout import Layout
from llmesh.cli.main import build_parser
from llmesh.cli.up import MeshSpec, plan
from llmesh.rpc.pki import read_principal

TRUST_VARS = ("LLMESH_TLS_CA_FILE", "LLMESH_TLS_CERT_FILE", "LLMESH_TLS_KEY_FILE")


def _spec(tmp_path: Path, trust: str = "local") -> MeshSpec:
    return MeshSpec(layout=Layout(base_port=20000, http_port=20009), engines=["sim", "sim"],
                    model_dir=tmp_path / "models", log_dir=tmp_path / "logs", trust=trust,  # type: ignore[arg-type]
                    pki_dir=tmp_path / "state" / "pki" if trust != "local" else None)


def test_plain_up_is_local_and_carries_no_certificate(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMESH_TRUST", "tls")  # an operator's shell: plain `llmesh up` stays local anyway
    monkeypatch.setenv("LLMESH_TLS_CERT_FILE", "/elsewhere.pem")
    children = plan(_spec(tmp_path))
    for child in children:
        assert child.env["LLMESH_TRUST"] == "local"
        assert not any(k in child.env for k in TRUST_VARS)
    gateway = next(c for c in children if c.name == "gateway")
    assert "LLMESH_GATEWAY_REQUIRE_AUTH" not in gateway.env


@pytest.mark.parametrize("trust", ["tls", "token"])
def test_a_secure_mesh_gives_each_child_its_own_certificate(tmp_path, trust):
    spec = _spec(tmp_path, trust)
    identity = secure.prepare(spec, tmp_path / "state")
    assert identity is not None and (identity.service, identity.trust) == ("cli", trust)
    children = plan(spec)
    assert [c.name for c in children] == ["scheduler", "modelmgr", "cache", "engine-0", "engine-1", "gateway"]
    certs = set()
    for child in children:
        assert child.env["LLMESH_TRUST"] == trust
        cert = Path(child.env["LLMESH_TLS_CERT_FILE"])
        principal = read_principal(cert.read_bytes())
        assert (principal.service, principal.instance) == (secure.service_of(child.name), child.name)
        assert Path(child.env["LLMESH_TLS_KEY_FILE"]).stat().st_mode & 0o077 == 0
        assert Path(child.env["LLMESH_TLS_CA_FILE"]) == spec.pki_dir / "ca.pem"
        certs.add(cert)
    assert len(certs) == len(children)
    gateway = next(c for c in children if c.name == "gateway")
    assert gateway.env["LLMESH_GATEWAY_REQUIRE_AUTH"] == "true"
    # the CLI verbs find the cli certificate while the mesh runs
    found = secure.cli_env({"LLMESH_STATE_DIR": str(tmp_path / "state")})
    assert found["LLMESH_TRUST"] == trust
    assert read_principal(Path(found["LLMESH_TLS_CERT_FILE"]).read_bytes()).service == "cli"


def test_a_second_start_reuses_the_certificates(tmp_path):
    spec = _spec(tmp_path, "tls")
    secure.prepare(spec, tmp_path / "state")
    before = {p.name: p.read_bytes() for p in spec.pki_dir.iterdir()}
    secure.prepare(spec, tmp_path / "state")
    assert {p.name: p.read_bytes() for p in spec.pki_dir.iterdir()} == before


def test_an_engine_the_autoscaler_adds_gets_a_certificate(tmp_path):
    from llmesh.cli.up import engine_child

    spec = _spec(tmp_path, "tls")
    secure.prepare(spec, tmp_path / "state")
    child = engine_child(spec, 7, "sim", "sim-small")
    assert read_principal(Path(child.env["LLMESH_TLS_CERT_FILE"]).read_bytes()).instance == "engine-7"


def test_plain_up_removes_a_stale_marker_and_hand_set_trust_wins(tmp_path):
    state = tmp_path / "state"
    secure.write_marker(state, "tls", state / "pki")
    assert secure.cli_env({"LLMESH_STATE_DIR": str(state), "LLMESH_TRUST": "token",
                           "LLMESH_TLS_CERT_FILE": "/mine.pem"}) == {"LLMESH_TRUST": "token",
                                                                    "LLMESH_TLS_CERT_FILE": "/mine.pem"}
    assert secure.prepare(_spec(tmp_path), state) is None  # a plain `llmesh up`
    assert secure.cli_env({"LLMESH_STATE_DIR": str(state)}) == {}


def test_trust_needs_secure():
    args = build_parser().parse_args(["up", "--trust", "token", "--engines", "sim"])
    from llmesh.cli.main import _up_options
    with pytest.raises(ValueError, match="--secure"):
        _up_options(args)


def test_certs_writes_shared_and_per_instance_certificates(tmp_path):
    out = io.StringIO()
    assert secure.cmd_certs(tmp_path, ["gateway", "engine", "engine:engine-3", "cli"], out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["gateway", "engine", "engine-3", "cli"]
    shared = read_principal((tmp_path / "engine.pem").read_bytes())
    assert shared.shared and shared.service == "engine"
    assert read_principal((tmp_path / "engine-3.pem").read_bytes()).instance == "engine-3"
    assert secure.cmd_certs(tmp_path, ["nosuch"], io.StringIO()) == 2
    assert secure.cmd_certs(tmp_path, ["engine:"], io.StringIO()) == 2


def test_certs_defaults_to_one_certificate_per_service(tmp_path, capsys):
    args = build_parser().parse_args(["certs", "--dir", str(tmp_path)])
    assert args.func(args) == 0
    assert sorted(p.name for p in tmp_path.glob("*.pem") if not p.name.endswith("-key.pem")) == sorted(
        [f"{s}.pem" for s in secure.DEFAULT_IDENTITIES] + ["ca.pem"])
    assert "LLMESH_TLS_CERT_FILE=" in capsys.readouterr().out
