from llmesh.service import run
from llmesh.modelmgr.app import ModelMgrApp
from llmesh.modelmgr.config import ModelMgrSettings


def main() -> None:
    run("modelmgr", ModelMgrSettings(), ModelMgrApp)


if __name__ == "__main__":
    main()
