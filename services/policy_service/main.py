"""Entry point of the built-in policies: ``python -m pacer_services.policy_service.main``."""

from pacer.runtime import main_entry
from pacer_services.policy_service.app import create


def main() -> None:
    main_entry("policies", create)


if __name__ == "__main__":
    main()
