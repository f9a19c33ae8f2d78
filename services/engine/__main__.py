from llmesh.service import run
from llmesh.engine.app import EngineApp
from llmesh.engine.config import EngineSettings


def main() -> None:
    run("engine", EngineSettings(), EngineApp)


if __name__ == "__main__":
    main()
