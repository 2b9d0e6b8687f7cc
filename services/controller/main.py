"""Entry point of the controller: ``python -m pacer_services.controller.main``."""

from pacer.runtime import main_entry
from pacer_services.controller.app import create


def main() -> None:
    main_entry("controller", create)


if __name__ == "__main__":
    main()
