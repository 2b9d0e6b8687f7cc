"""Entry point of the auth callout responder: ``python -m pacer_services.auth_callout.main``."""

from pacer.runtime import main_entry
from pacer_services.auth_callout.app import create


def main() -> None:
    main_entry("auth", create)


if __name__ == "__main__":
    main()
