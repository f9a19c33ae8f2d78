"""Where the services of a one-machine mesh listen. One base port decides all of them,
so several meshes (tests, say) can share a machine."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.settings import DEFAULT_PORTS

CORE_SERVICES = ("scheduler", "modelmgr", "cache")
MAX_ENGINES = 100


@dataclass(frozen=True)
class Layout:
    host: str = "127.0.0.1"
    base_port: int = DEFAULT_PORTS["gateway"]
    http_port: int = DEFAULT_PORTS["gateway_http"]

    def port(self, service: str) -> int:
        offsets = {"gateway": 0, "scheduler": 1, "modelmgr": 2, "cache": 3}
        return self.base_port + offsets[service]

    def address(self, service: str) -> str:
        return f"{self.host}:{self.port(service)}"

    def metrics_port(self, service: str) -> int:
        """Prometheus /metrics: base+20.. for the services, base+200+i for engine i."""
        if service.startswith("engine-"):
            return self.base_port + 200 + int(service.removeprefix("engine-"))
        return self.port(service) + 20

    def engine_address(self, index: int) -> str:
        """Engine i (at most MAX_ENGINES) listens on base+100+i."""
        if not 0 <= index < MAX_ENGINES:
            raise ValueError(f"a one-machine mesh runs at most {MAX_ENGINES} engines")
        return f"{self.host}:{self.base_port + 100 + index}"

    def reserved_ports(self) -> str:
        """Every port this layout may use, as net.ipv4.ip_local_reserved_ports takes them."""
        top = self.base_port + 200 + MAX_ENGINES - 1
        return f"{self.base_port}-{top}" + ("" if self.base_port <= self.http_port <= top else f",{self.http_port}")

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"
