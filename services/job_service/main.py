"""Entry point of the job service: ``python -m pacer_services.job_service.main``."""

from pacer.runtime import main_entry
from pacer_services.job_service.app import create


def main() -> None:
    main_entry("jobs", create)


if __name__ == "__main__":
    main()
