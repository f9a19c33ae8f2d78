from llmesh.cli.main import main

main()
