"""When a PS loses its variables, the chief rewinds the dataset so that nothing trained is skipped.

Found by the chaos runs: a PS relaunched empty had its variables initialised
afresh by the chief while every record trained before stayed DONE in the
shard service, so that PS's part of the model silently lost them.  The rule
(pure) decides the shard checkpoint to go back to; the worker applies it
with the shard service's restore before its first step.
"""

from __future__ import annotations

import pytest
from pacer.trainer.worker import START_CHECKPOINT, rewind_target


@pytest.mark.parametrize(("chief", "ps_lost", "missing", "restored", "want"), [
    (True, True, True, "step-400", "step-400"),   # rolled back to a checkpoint: its shard state
    (True, True, True, "", START_CHECKPOINT),      # no checkpoint yet: everything trains again
    (True, True, False, "", ""),                   # restore asked, but every variable is still there
    (True, False, True, "", ""),                   # a new job: nothing was trained
    (False, True, True, "step-400", ""),           # only the chief rewinds
])
def test_rewind_target(chief: bool, ps_lost: bool, missing: bool, restored: str, want: str) -> None:
    assert rewind_target(chief, ps_lost, missing, restored) == want
