"""Entry point of the HTTP API and dashboard: ``python -m pacer_services.api.main``.

``PACER_NATS_URL`` says where the bus is; ``PACER_API_HOST`` / ``PACER_API_PORT``
where to listen (default ``127.0.0.1:8750``).
"""

from pacer.runtime import main_entry
from pacer_services.api.app import create


def main() -> None:
    main_entry("api", create)


if __name__ == "__main__":
    main()
