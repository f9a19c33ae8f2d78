from llmesh.service import run
from llmesh.cache.app import CacheApp
from llmesh.cache.config import CacheSettings


def main() -> None:
    run("cache", CacheSettings(), CacheApp)


if __name__ == "__main__":
    main()
