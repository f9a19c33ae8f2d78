"""``llmesh up --secure``: the one-machine mesh under production trust.

On first start the mesh's PKI is made under the state directory (``<state_dir>/pki``:
a CA and one certificate per process: gateway, scheduler, modelmgr, cache, engine-<i>,
and ``cli`` for the CLI verbs and the supervisor itself); later starts reuse it. Every
child gets LLMESH_TRUST and its own LLMESH_TLS_* files.

While a secure mesh runs, ``<state_dir>/trust.json`` names its trust mode and the cli
certificate, so ``llmesh status``, ``models``, ``cache``... reach it without flags;
plain ``llmesh up`` removes a stale one. Variables set by hand (LLMESH_TRUST and
LLMESH_TLS_*) win over the file."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from llmesh.rpc.identity import Identity, Trust
from llmesh.rpc.pki import PkiError, ensure_pki, identity_files
from llmesh.settings import MeshSettings

if TYPE_CHECKING:
    from llmesh.cli.up import MeshSpec

PKI_DIR = "pki"
MARKER = "trust.json"
CLI = "cli"
TRUST_ENV = ("LLMESH_TRUST", "LLMESH_TLS_CA_FILE", "LLMESH_TLS_CERT_FILE", "LLMESH_TLS_KEY_FILE")


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The state directory the mesh's services use (LLMESH_STATE_DIR, else MeshSettings' default)."""
    env = os.environ if env is None else env
    return Path(env["LLMESH_STATE_DIR"]) if env.get("LLMESH_STATE_DIR") else MeshSettings.model_fields[
        "state_dir"].default


def pki_dir(state: Path) -> Path:
    return state / PKI_DIR


def service_of(instance: str) -> str:
    """engine-3 -> engine; the other processes are named after their service."""
    return "engine" if instance.startswith("engine-") else instance


def make_pki(directory: Path, instances: Iterable[str]) -> None:
    """The CA and a certificate for each instance that lacks one (what exists is reused)."""
    ensure_pki(directory, [(service_of(i), i) for i in instances])


def tls_files(directory: Path, instance: str) -> dict[str, str]:
    """LLMESH_TLS_* for ``instance``'s certificate in ``directory`` (as pki.ensure_pki names them)."""
    files = identity_files(directory, instance)
    return {"LLMESH_TLS_CA_FILE": str(files.ca_file), "LLMESH_TLS_CERT_FILE": str(files.cert_file),
            "LLMESH_TLS_KEY_FILE": str(files.key_file)}


def child_env(trust: Trust, directory: Path | None, instance: str) -> dict[str, str]:
    """The trust variables of one child: LLMESH_TRUST and, unless local, its own certificate."""
    if trust == "local" or directory is None:
        return {"LLMESH_TRUST": "local"}
    return {"LLMESH_TRUST": trust, **tls_files(directory, instance)}


def write_marker(state: Path, trust: Trust, directory: Path) -> Path:
    """Tell the CLI verbs how to reach the running mesh (the cli certificate)."""
    path = state / MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"LLMESH_TRUST": trust, **tls_files(directory, CLI)}))
    tmp.replace(path)
    return path


def clear_marker(state: Path) -> None:
    (state / MARKER).unlink(missing_ok=True)


def cli_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The trust variables a CLI verb runs with: those set by hand, else a running secure
    mesh's (its marker file in the state directory), else none (local)."""
    env = os.environ if env is None else env
    if env.get("LLMESH_TRUST"):
        return {k: env[k] for k in TRUST_ENV if env.get(k)}
    try:
        found = json.loads((state_dir(env) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return {k: str(found[k]) for k in TRUST_ENV if isinstance(found, dict) and found.get(k)}


def cli_settings(env: Mapping[str, str] | None = None) -> MeshSettings:
    """MeshSettings of a CLI verb (see cli_env): LLMESH_* from the environment, the trust
    fields from a running secure mesh when none are set by hand."""
    found = cli_env(env)
    overrides = {k.removeprefix("LLMESH_").lower(): v for k, v in found.items()}
    return MeshSettings(**overrides)  # type: ignore[arg-type]  # pydantic parses the strings


def parse_identity(text: str) -> tuple[str, str]:
    """'engine' -> (engine, engine): one certificate shared by every replica; 'engine:engine-0' ->
    (engine, engine-0): one instance's own."""
    service, _, instance = text.partition(":")
    if not service or (_ and not instance):
        raise ValueError(f"bad identity {text!r}; write SERVICE or SERVICE:INSTANCE")
    return service, instance or service


DEFAULT_IDENTITIES = ("gateway", "scheduler", "modelmgr", "cache", "engine", "cli")


def cmd_certs(directory: Path, identities: list[str], out: TextIO) -> int:
    """``llmesh certs``: the CA (made once) and the certificates named, under ``directory``;
    what exists is kept. Prints each identity's files."""
    try:
        wanted = [parse_identity(i) for i in identities or DEFAULT_IDENTITIES]
        made = ensure_pki(directory, wanted)
    except (ValueError, PkiError, OSError) as exc:
        print(f"llmesh certs: {exc}", file=sys.stderr)
        return 2
    for instance, files in made.items():
        print(f"{instance}: LLMESH_TLS_CA_FILE={files.ca_file} LLMESH_TLS_CERT_FILE={files.cert_file} "
              f"LLMESH_TLS_KEY_FILE={files.key_file}", file=out)
    return 0


def instances(spec: MeshSpec) -> list[str]:
    """Every process of the mesh that needs a certificate, the supervisor's own (cli) included."""
    return ["scheduler", "modelmgr", "cache", *(f"engine-{i}" for i in range(len(spec.engines))), "gateway", CLI]


def prepare(spec: MeshSpec, state: Path) -> Identity | None:
    """Before ``llmesh up`` starts its children: a secure mesh's certificates and its marker
    for the CLI verbs (a local mesh removes a stale marker). The supervisor's own identity
    (the cli certificate's) for its health checks and the launcher; None when local."""
    if spec.trust == "local" or spec.pki_dir is None:
        clear_marker(state)
        return None
    make_pki(spec.pki_dir, instances(spec))
    write_marker(state, spec.trust, spec.pki_dir)
    return cli_identity({"LLMESH_TRUST": spec.trust, **tls_files(spec.pki_dir, CLI)})


def cli_identity(env: Mapping[str, str] | None = None) -> Identity:
    """The identity a CLI verb calls the mesh with (cli_settings): IdentityError or ValueError when
    the trust variables or files are not usable."""
    from llmesh.platform import service_identity

    return service_identity(CLI, cli_settings(env))
