"""A lint contract (``make lint``): no service defines its own routing of job requests.

Every service that owns jobs routes its requests through :class:`pacer.owned.router.Router`; a
service module that defines a ``_route`` / ``_on_forwarded`` / ``_dispatch`` method, calls
``Ownership.route`` or reads the forwarding header itself has grown a copy back.  Likewise a
service shell (``app.py``) serialises a job's changes with :mod:`pacer.owned.queues` and never
makes an ``asyncio.Lock`` of its own: a lock in a service's state is shared by every job.  Prints
each offence as ``path:line: what`` and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTING_DEFS = {"_route", "_on_forwarded", "_dispatch", "_route_forwarded"}
ROUTING_NAMES = {"FORWARDED_BY", "forward_subject"}


def offences(root: Path = ROOT / "services") -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in ROUTING_DEFS:
                out.append(f"{rel}:{node.lineno}: defines {node.name} (route through pacer.owned.router.Router)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "route" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "own":
                out.append(f"{rel}:{node.lineno}: calls own.route (route through pacer.owned.router.Router)")
            elif isinstance(node, ast.Name | ast.alias) and getattr(node, "id", getattr(node, "name", "")) in ROUTING_NAMES:
                out.append(f"{rel}:{node.lineno}: uses the forwarding protocol itself")
            elif path.name == "app.py" and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "Lock":
                out.append(f"{rel}:{node.lineno}: makes a lock of its own (serialise a job with pacer.owned.queues)")
    return out


if __name__ == "__main__":
    found = offences()
    print("\n".join(found) or "routing: every service routes through pacer.owned.router and serialises jobs with pacer.owned.queues")
    sys.exit(1 if found else 0)
