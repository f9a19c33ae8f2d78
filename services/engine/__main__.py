import os

if os.environ.get("LLMESH_ENGINE_BACKEND") == "minilm":
    # One BLAS thread for the numpy embedder, as the cache has (its products are small; on a shared
    # machine OpenBLAS's thread pool made an embedding several times slower). Set before numpy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from llmesh.service import run  # after the environment is set
from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings


def main() -> None:
    run("engine", EngineSettings(), EngineApp)


if __name__ == "__main__":
    main()
