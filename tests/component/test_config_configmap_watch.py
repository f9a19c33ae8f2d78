"""A live config mounted from a Kubernetes ConfigMap reaches the service without a restart.

The kubelet updates a mounted ConfigMap atomically (its AtomicWriter): the files live in a
`..<timestamp>` directory, `..data` is a symlink to it, and each key is a symlink through it
(`llmesh.yaml -> ..data/llmesh.yaml`). An update writes a new timestamped directory, points a
`..data_tmp` symlink at it, renames that over `..data` and removes the old directory: the
`llmesh.yaml` link itself never changes. These tests lay the directory out the same way, on a
real filesystem watched by the service's real FileStore and LiveConfig."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from llmesh.liveconfig.live import LiveConfig
from llmesh.liveconfig.stores import FileStore


class ConfigMapMount:
    """A directory as the kubelet keeps a ConfigMap volume with one key, llmesh.yaml."""

    def __init__(self, root: Path):
        self.root = root
        self.generation = 0
        root.mkdir()
        self._current = self._write_generation("default: {max_attempts: 2}\n")
        os.symlink(self._current.name, root / "..data")
        os.symlink("..data/llmesh.yaml", root / "llmesh.yaml")

    @property
    def path(self) -> Path:
        return self.root / "llmesh.yaml"

    def _write_generation(self, text: str) -> Path:
        self.generation += 1
        folder = self.root / f"..2026_12_02_12_00_00.{self.generation:09d}"
        folder.mkdir()
        (folder / "llmesh.yaml").write_text(text)
        return folder

    def update(self, text: str) -> None:
        """The kubelet's swap: new directory, ..data_tmp -> it, rename over ..data, old one removed."""
        new = self._write_generation(text)
        os.symlink(new.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")
        shutil.rmtree(self._current)
        self._current = new


async def _until(predicate, timeout_s: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_a_configmap_update_is_applied_without_a_restart(tmp_path):
    mount = ConfigMapMount(tmp_path / "llmesh")
    live = LiveConfig(FileStore(mount.path), CollectorRegistry(), "gateway")
    await live.start()
    try:
        assert live.current.default.max_attempts == 2
        await asyncio.sleep(0.2)  # the watcher is set up
        mount.update("default: {max_attempts: 3}\n")
        assert await _until(lambda: live.current.default.max_attempts == 3), "the swapped ConfigMap was not applied"
        first = live.revision
        mount.update("default: {max_attempts: 4}\n")  # and again: the watch survives the swap
        assert await _until(lambda: live.current.default.max_attempts == 4)
        assert live.revision > first
    finally:
        await live.stop()


async def test_an_invalid_configmap_update_is_rejected_and_the_last_good_one_stays(tmp_path):
    registry = CollectorRegistry()
    mount = ConfigMapMount(tmp_path / "llmesh")
    live = LiveConfig(FileStore(mount.path), registry, "gateway")
    await live.start()
    try:
        await asyncio.sleep(0.2)
        mount.update("default: {max_attempts: 0}\n")
        assert await _until(lambda: registry.get_sample_value("llmesh_config_rejected_total",
                                                              {"service": "gateway"}) == 1.0)
        assert live.current.default.max_attempts == 2
    finally:
        await live.stop()


async def test_writing_a_file_that_cannot_be_written_says_what_to_do(tmp_path):
    """A promotion writing its traffic split into a mounted ConfigMap (read-only) fails naming the
    file and the way out, as FAILED_PRECONDITION, not as an internal error. Root ignores file modes,
    so the file here sits under a path that is not a directory."""
    from llmesh.errors import FailedPrecondition
    (tmp_path / "not-a-dir").write_text("")
    store = FileStore(tmp_path / "not-a-dir" / "llmesh.yaml")
    with pytest.raises(FailedPrecondition, match=r"llmesh.yaml cannot be written .*ConfigMap is read-only.*"
                                                 r"LLMESH_CONFIG_BACKEND=etcd"):
        await store.write("default: {max_attempts: 3}\n")
