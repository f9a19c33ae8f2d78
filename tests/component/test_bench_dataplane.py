"""`python -m bench.dataplane --gateway-workers N` runs its load section against a gateway of N
workers with Redis, which requires credentials: the bench makes an API key in that Redis and
every gateway call (gRPC, HTTP/SSE, the many-streams run) carries it (a tiny run: this checks
the bench, not the figures)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_section_with_gateway_workers_runs_every_path_without_errors():
    done = subprocess.run([sys.executable, "-m", "bench.dataplane", "--sections", "load", "--gateway-workers", "2",
                           "--levels", "1", "--level-requests", "4", "--load-rounds", "1", "--streams", "4",
                           "--tokens", "4", "--decode-ms", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["gateway_workers"] == 2
    paths = report["results"]["ttft"]["c1"]
    assert set(paths) == {"engine_grpc", "relay_grpc", "gateway_grpc", "gateway_http"}
    for name, row in paths.items():
        assert row["errors"] == 0 and row["requests"] == 4, (name, row, done.stderr[-3000:])
    streams = report["results"]["streams_4"]
    for round_ in ("round1", "round2"):
        assert streams[round_]["errors"] == 0 and streams[round_]["requests"] == 4, (streams, done.stderr[-3000:])
