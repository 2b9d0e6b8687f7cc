"""Entry point of the brain-optimizer: ``python -m pacer_services.brain.main``."""

from pacer.runtime import main_entry
from pacer_services.brain.app import create


def main() -> None:
    main_entry("brain", create)


if __name__ == "__main__":
    main()
