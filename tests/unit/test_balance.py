"""The balance rule of pacer.ownership (:func:`jobs_to_give_up`), pure: which job an instance gives up now."""

from __future__ import annotations

import pytest
from pacer.ownership import HOLD_PERIODS, balance_period, jobs_to_give_up

P = 30.0  # the balance period
NOW = 1000.0


def mine(holders: dict[str, str], me: str, at: float = 0.0) -> dict[str, float]:
    """Every job ``me`` holds, acquired at ``at``."""
    return {j: at for j, h in holders.items() if h == me}


def give(holders: dict[str, str], live: set[str], me: str, acquired: dict[str, float] | None = None,
         given: dict[str, float] | None = None, now: float = NOW, in_flight: tuple[str, ...] = ()) -> list[str]:
    return jobs_to_give_up(holders, live, me, mine(holders, me) if acquired is None else acquired,
                           given or {}, now, P, in_flight)


def test_six_jobs_at_one_of_two_instances_move_one_at_a_time_until_three_each() -> None:
    holders = {f"j{i}": "a" for i in range(6)}
    moves = 0
    for _ in range(10):  # the rounds of both instances, each period
        for me in ("a", "b"):
            for job in give(holders, {"a", "b"}, me):
                assert holders[job] == me
                holders[job] = "b" if me == "a" else "a"  # the other takes it
                moves += 1
    assert sorted(holders.values()) == ["a"] * 3 + ["b"] * 3
    assert moves == 3  # never a move back


@pytest.mark.parametrize(("a", "b", "moves"), [(2, 0, 1), (3, 0, 1), (3, 1, 1), (2, 1, 0), (1, 0, 0), (0, 0, 0),
                                               (3, 2, 0), (4, 4, 0)])
def test_a_job_moves_only_when_it_narrows_the_spread(a: int, b: int, moves: int) -> None:
    holders = {**{f"a{i}": "a" for i in range(a)}, **{f"b{i}": "b" for i in range(b)}}
    assert len(give(holders, {"a", "b"}, "a")) == moves
    assert give(holders, {"a", "b"}, "b") == []  # the less loaded one never gives


def test_at_most_one_job_per_round() -> None:
    holders = {f"j{i}": "a" for i in range(20)}
    assert len(give(holders, {"a", "b", "c"}, "a")) == 1


def test_only_live_instances_count() -> None:
    holders = {"j1": "a", "j2": "a", "j3": "a", "x": "gone"}
    assert give(holders, set(), "a") == []  # alone (our own presence not read yet counts as alone)
    assert give(holders, {"a"}, "a") == []
    assert give(holders, {"a", "gone"}, "a") == ["j3"]  # 3 vs 1 (its presence says it lives)
    assert give(holders, {"a", "b"}, "a") == ["j3"]  # 3 vs 0: x, held by an instance not live, counts for nobody
    assert give({**holders, "y": "b", "z": "b"}, {"a", "b"}, "a") == []  # 3 vs 2


def test_the_most_recently_acquired_job_held_a_period_goes_ties_by_name() -> None:
    holders = {"old": "a", "mid": "a", "new": "a", "fresh": "a"}
    acquired = {"old": 0.0, "mid": 500.0, "new": NOW - P, "fresh": NOW - P + 1}
    assert give(holders, {"a", "b"}, "a", acquired) == ["new"]  # "fresh" is younger than a period
    tie = {"x": 10.0, "y": 10.0, "w": 10.0}
    assert give({j: "a" for j in tie}, {"a", "b"}, "a", tie) == ["y"]


def test_nothing_acquired_a_period_ago_nothing_moves() -> None:
    holders = {f"j{i}": "a" for i in range(4)}
    assert give(holders, {"a", "b"}, "a", {j: NOW - P / 2 for j in holders}) == []


def test_only_jobs_we_own_and_hold_may_go() -> None:
    holders = {"j1": "a", "j2": "a", "j3": "a"}
    # not movable (left out of acquired by the service) or held per KV by someone else now
    assert give(holders, {"a", "b"}, "a", {"j1": 0.0}) == ["j1"]
    assert give(holders, {"a", "b"}, "a", {}) == []
    assert give(holders, {"a", "b"}, "a", {"elsewhere": 0.0}) == []


def test_a_hand_over_in_flight_stops_the_next_move() -> None:
    holders = {f"j{i}": "a" for i in range(5)}
    given = {"j9": NOW - 10 * P}
    assert give(holders, {"a", "b"}, "a", given=given, in_flight=("j9",)) == []  # released, nobody holds it yet
    # landed (held by b, though we have not seen it yet), or no longer in flight: the rule goes on
    assert give({**holders, "j9": "b"}, {"a", "b"}, "a", given=given, in_flight=("j9",)) == ["j4"]
    assert give(holders, {"a", "b"}, "a", given=given) == ["j4"]


def test_a_job_given_up_is_not_given_up_again_for_a_while() -> None:
    holders = {"j1": "a", "j2": "a", "j3": "a"}
    acquired = {"j1": 0.0, "j2": 0.0, "j3": 100.0}
    assert give(holders, {"a", "b"}, "a", acquired, given={"j3": NOW - P}) == ["j2"]  # j3 came back: kept
    assert give(holders, {"a", "b"}, "a", acquired, given={"j3": NOW - HOLD_PERIODS * P}) == ["j3"]


def test_with_three_instances_only_the_most_loaded_gives() -> None:
    holders = {**{f"a{i}": "a" for i in range(4)}, **{f"b{i}": "b" for i in range(4)}}
    live = {"a", "b", "c"}
    assert give(holders, live, "a") == ["a3"]  # a tie at the top: the first name gives
    assert give(holders, live, "b") == []
    assert give(holders, live, "c") == []
    holders["b4"] = "b"
    assert give(holders, live, "a") == [] and give(holders, live, "b") == ["b4"]


def test_the_period_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_BALANCE_EVERY_S", raising=False)
    assert balance_period() == 30.0
    assert balance_period(0) == 0.0
    monkeypatch.setenv("PACER_BALANCE_EVERY_S", "0")
    assert balance_period() == 0.0
    monkeypatch.setenv("PACER_BALANCE_EVERY_S", "12.5")
    assert balance_period() == 12.5
    assert balance_period(3.0) == 3.0  # given wins over the environment
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("PACER_BALANCE_EVERY_S", bad)
        with pytest.raises(ValueError, match="PACER_BALANCE_EVERY_S"):
            balance_period()
