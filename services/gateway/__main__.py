from llmesh.service import run
from llmesh.gateway.app import GatewayApp
from llmesh.gateway.config import GatewaySettings


def main() -> None:
    run("gateway", GatewaySettings(), GatewayApp)


if __name__ == "__main__":
    main()
