import os

# One BLAS thread: the embedder's products are small, and on a shared machine
# OpenBLAS's thread pool made one embedding 5x slower (measured under load).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from llmesh.service import run
from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings


def main() -> None:
    run("cache", CacheSettings(), CacheApp)


if __name__ == "__main__":
    main()
