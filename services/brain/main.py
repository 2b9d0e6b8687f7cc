"""Entry point of the brain-optimizer: ``python -m pacer_services.brain.main``."""

from pacer.extras import require_or_exit
from pacer.runtime import main_entry


def main() -> None:
    require_or_exit("brain", "the brain-optimizer")  # scipy/pymoo: a slim image says so at start
    from pacer_services.brain.app import create

    main_entry("brain", create)


if __name__ == "__main__":
    main()
