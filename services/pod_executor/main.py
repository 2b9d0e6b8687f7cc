"""Entry point of the pod-executor: ``python -m pacer_services.pod_executor.main``."""

from pacer.runtime import main_entry
from pacer_services.pod_executor.app import create


def main() -> None:
    main_entry("executor", create)


if __name__ == "__main__":
    main()
