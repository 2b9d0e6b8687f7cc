"""Entry point of the shard service: ``python -m pacer_services.shard_service.main``."""

from pacer.runtime import main_entry
from pacer_services.shard_service.app import create


def main() -> None:
    main_entry("shard", create)


if __name__ == "__main__":
    main()
