from llmesh.service import run
from llmesh.scheduler.app import SchedulerApp
from llmesh.scheduler.config import SchedulerSettings


def main() -> None:
    run("scheduler", SchedulerSettings(), SchedulerApp)


if __name__ == "__main__":
    main()
