"""``make bench``: every benchmark, one JSON document per line-separated section."""

import subprocess
import sys

for module in ("bench.gateway", "bench.governance", "bench.llamacpp", "bench.engine", "bench.guards", "bench.cache",
               "bench.routing", "bench.provider", "bench.validation",
               "bench.dataplane"):
    print(f"# {module}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", module, *sys.argv[1:]], check=True)
