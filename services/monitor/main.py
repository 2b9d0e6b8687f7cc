"""Entry point of the monitor service: ``python -m pacer_services.monitor.main``."""

from pacer.runtime import main_entry
from pacer_services.monitor.app import create


def main() -> None:
    main_entry("monitor", create)


if __name__ == "__main__":
    main()
