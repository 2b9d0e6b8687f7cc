"""The lint contract of ``make lint``: no service defines its own request routing
nor a lock shared by every job (tests/lint_routing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lint_routing import offences


def test_no_service_routes_requests_itself() -> None:
    assert offences() == []


def test_the_contract_catches_a_copy(tmp_path: Path) -> None:
    svc = tmp_path / "svc"
    svc.mkdir()
    (svc / "app.py").write_text(
        "from pacer.ownership import FORWARDED_BY\n"
        "class S:\n"
        "    async def _on_forwarded(self, msg):\n"
        "        await self.own.route(msg, 'j', self.handle)\n"
        "    def __init__(self):\n"
        "        self.lock = asyncio.Lock()\n")
    import lint_routing

    old = lint_routing.ROOT
    lint_routing.ROOT = tmp_path
    try:
        found = offences(svc)
    finally:
        lint_routing.ROOT = old
    assert len(found) == 4, found
    assert any("lock of its own" in f for f in found), found
