"""A real Prometheus (Debian's) on a free 127.0.0.1 port, scraping the targets it is given every
second, for tests that check PromQL (the dashboard's, the alert rules') against real series."""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from llmesh.testing import free_ports, terminate, wait_until


@dataclass
class PrometheusServer:
    data_dir: Path
    targets: dict[str, str]  # job name -> host:port
    rule_files: tuple[Path, ...] = ()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        if shutil.which("prometheus") is None:
            pytest.fail("prometheus is not installed: apt-get install prometheus (.ci/run does)")
        if not self.port:
            (self.port,) = free_ports(1)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(f) for f in self.rule_files],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                     for job, target in self.targets.items()]}
        (self.data_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = (self.data_dir / "prometheus.log").open("ab")
        self.proc = proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.data_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.data_dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        if not wait_until(lambda: self._ready() or proc.poll() is not None, timeout_s) or proc.poll() is not None:
            self.stop()
            raise RuntimeError("prometheus did not start:\n" + (self.data_dir / "prometheus.log").read_text()[-2000:])

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str) -> list:
        """The instant query's result; fails the test if the API does not say success."""
        resp = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=5).json()
        assert resp["status"] == "success", resp
        return resp["data"]["result"]

    def stop(self) -> None:
        terminate(self.proc, signal.SIGTERM, 10.0)
