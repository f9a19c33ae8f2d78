"""Which secrets an external provider may be sent, whatever the live config says. The config
names a provider's key (``api_key_file``, ``api_key_env``) and where it goes (``base_url``);
whoever writes the config is not trusted with the gateway's other secrets, so:

- a key file is read only from the gateway's key directory (``provider_key_dir``): the path
  (relative: to that directory) is resolved, symlinks and ``..`` included, and must stay inside
  it, and never inside a directory that holds one of the mesh's own secret files (its TLS key
  and CA, the service secret): a CA key next to the CA certificate is refused too;
- a key variable only from the gateway's allow-list (``provider_key_envs``);
- ``base_url`` as the schema allows (https; plain http only to a loopback host).

A live config that breaks these is refused when it is applied (``check``, a LiveConfig check:
the last good config stays, the refusal is logged and counted). Every call checks again before
anything is sent (``api_key``): a file in the directory may have become a symlink elsewhere
since the config was applied."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llmesh.errors import Unavailable
from llmesh.liveconfig.document import InvalidConfig
from llmesh.liveconfig.schema import MeshConfig, Provider

log = logging.getLogger("llmesh.gateway.providers")

MAX_KEY_BYTES = 16 * 1024  # a key file larger than this is not a key


class KeyRefused(ValueError):
    """A provider's key source is not one the gateway may read."""


@dataclass(frozen=True)
class ProviderSecrets:
    """``key_dir`` None: no key file may be read; ``key_envs`` empty: no variable may."""
    key_dir: Path | None = None
    key_envs: frozenset[str] = frozenset()
    forbidden_dirs: tuple[Path, ...] = ()  # resolved; no key file is read inside them

    @classmethod
    def of(cls, key_dir: Path | None, key_envs: Iterable[str], mesh_files: Iterable[Path | None] = ()
           ) -> ProviderSecrets:
        """``mesh_files``: the mesh's own secret and certificate files; their directories are closed,
        as named and as resolved (a Kubernetes Secret mount's files are symlinks into a directory
        that changes on each rotation: the named one holds every future one)."""
        files = [f for f in mesh_files if f is not None]
        closed = {f.absolute().parent for f in files} | {f.resolve().parent for f in files}
        return cls(key_dir.resolve() if key_dir is not None else None, frozenset(key_envs), tuple(sorted(closed)))

    def key_path(self, file: str) -> Path:
        """Where ``api_key_file`` is, resolved; KeyRefused when it may not be read."""
        if self.key_dir is None:
            raise KeyRefused("api_key_file is not allowed: the gateway has no provider key directory")
        path = (self.key_dir / file).resolve()
        if not path.is_relative_to(self.key_dir):
            raise KeyRefused(f"api_key_file {file!r} is outside the provider key directory {self.key_dir}")
        for closed in self.forbidden_dirs:
            if path.is_relative_to(closed):
                raise KeyRefused(f"api_key_file {file!r} is in {closed}, a directory of the mesh's own secrets")
        return path

    def env_name(self, name: str) -> str:
        if name not in self.key_envs:
            raise KeyRefused(f"api_key_env {name!r} is not in the gateway's provider_key_envs allow-list")
        return name

    def problems(self, p: Provider) -> list[str]:
        out = []
        for source, value, test in (("api_key_file", p.api_key_file, self.key_path),
                                    ("api_key_env", p.api_key_env, self.env_name)):
            if value is not None:
                try:
                    test(value)
                except KeyRefused as exc:
                    out.append(str(exc))
        return out

    def check(self, config: MeshConfig) -> None:
        """A LiveConfig check: InvalidConfig naming every provider whose key may not be read."""
        problems = [f"providers.{name}: {problem}" for name, p in config.providers.items()
                    for problem in self.problems(p)]
        if problems:
            raise InvalidConfig("; ".join(problems))

    def api_key(self, p: Provider) -> str | None:
        """The key to send, read now; Unavailable (nothing is sent) when it may not be read or is missing."""
        try:
            if p.api_key_env:
                key = os.environ.get(self.env_name(p.api_key_env))
                if not key:
                    raise Unavailable(f"The provider key variable {p.api_key_env} is not set.",
                                      reason="provider_auth")
                return key
            if p.api_key_file:
                return _read_key(self.key_path(p.api_key_file))
        except KeyRefused as exc:  # the details (paths, names) go to the operator's log, not to the client
            log.warning("provider key refused; nothing sent", extra={"base_url": p.base_url, "reason": str(exc)})
            raise Unavailable("The provider's key is refused by the gateway.", reason="provider_key_refused") from None
        return None


def _read_key(path: Path) -> str:
    """A regular file's text (not followed if it became a symlink since ``path`` was resolved)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise KeyRefused("api_key_file is not a regular file")
            data = f.read(MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise Unavailable(f"The provider key file cannot be read: {exc.strerror}.", reason="provider_auth") from None
    if len(data) > MAX_KEY_BYTES:
        raise KeyRefused(f"api_key_file is larger than {MAX_KEY_BYTES} bytes")
    return data.decode("utf-8", "replace").strip()
