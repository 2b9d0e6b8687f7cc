"""Entry point of the Kubernetes operator: ``python -m pacer_services.operator.main``."""

from pacer.runtime import main_entry
from pacer_services.operator.app import create


def main() -> None:
    main_entry("operator", create)


if __name__ == "__main__":
    main()
