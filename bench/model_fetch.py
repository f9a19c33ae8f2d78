"""What fetching a deployed model costs an engine: the model manager (in process, real gRPC on
127.0.0.1) serves a blob of ``--mib`` MiB that its publish folder names, and the engine's
fetcher downloads it (GetArtifactManifest, FetchArtifact in 1 MiB chunks, sha256 checked,
renamed into place), next to a plain local copy-and-hash of the same file as the floor.

    python -m bench.model_fetch [--mib 256] [--rounds 3]

Figures are the median of ``rounds`` fetches into an empty model store, in MiB/s of wall
time and as a ratio to the floor measured in the same run; the CPU seconds the process spent
per GiB fetched (both sides share it here). Prints one JSON document."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from llmesh.discovery.base import fixed
from llmesh.engine.fetcher import ModelFetcher
from llmesh.engine.modelsource import GrpcArtifactSource
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings
from llmesh.testing import free_ports

MiB = 1 << 20


def floor(src: Path, dst: Path) -> None:
    """Read, hash and write the file locally: what any fetch must at least do."""
    h = hashlib.sha256()
    with src.open("rb") as f, dst.open("wb") as out:
        while block := f.read(MiB):
            h.update(block)
            out.write(block)


async def run(root: Path, mib: int, rounds: int) -> dict[str, object]:
    port, = free_ports(1)
    mgr = ModelMgrApp(ModelMgrSettings(port=port, host="127.0.0.1", model_dir=root / "mgr-models",
                                       store_dir=root / "store", database_url=f"sqlite:///{root / 'r.db'}"))
    src = root / "upload.gguf"
    with src.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))
    blob = mgr.artifacts.add_file(src, "bench.gguf")
    mgr.artifacts.publish("bench@1", blob.sha256, "bench.gguf",
                          {"context_length": 2048,  # random bytes: not a GGUF the store could read
                           "files": [{"path": "bench.gguf", "sha256": blob.sha256, "size": blob.size_bytes}]})
    await mgr.start()
    source = GrpcArtifactSource(fixed(f"127.0.0.1:{port}"))
    fetch_s, floor_s, cpu_s = [], [], []
    try:
        for i in range(rounds):
            models = root / f"engine-{i}"
            started, cpu = time.perf_counter(), time.process_time()
            result = await ModelFetcher(models, source).ensure("bench@1")
            fetch_s.append(time.perf_counter() - started)
            cpu_s.append(time.process_time() - cpu)
            assert result is not None and result.downloaded_bytes == blob.size_bytes
            shutil.rmtree(models)
            started = time.perf_counter()
            await asyncio.to_thread(floor, blob.path, root / "copy")
            floor_s.append(time.perf_counter() - started)
    finally:
        await source.close()
        await mgr.stop(0)
    fetch, local = statistics.median(fetch_s), statistics.median(floor_s)
    return {"bench": "model_fetch", "mib": mib, "rounds": rounds,
            "grpc_fetch_mib_s": round(mib / fetch, 1), "local_copy_hash_mib_s": round(mib / local, 1),
            "fetch_over_floor_time": round(fetch / local, 2),
            "cpu_s_per_gib": round(statistics.median(cpu_s) / (mib / 1024), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(run(Path(tmp), args.mib, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
