"""The message codec on the hot paths: what the services run (pacer.codec) against plain msgpack, in one run.

    make bench-codec            # = .venv/bin/python bench/bench_codec.py [--rounds N]

For the messages every training step or shard exchange sends (a lease
request with its reports, its reply, an agent's metrics), the time to encode
and to decode one message, in microseconds: ``pacer.codec.encode`` /
``decode`` (msgspec since 2026-11-29: typed msgpack straight into the
contracts' dataclasses, every field checked) against the floor of
``msgpack.packb`` / ``unpackb`` of the same field map with no types and no
checks.  Both take turns within each round; the median of the rounds is
reported.  ``wire_compatible``: the codec's bytes are exactly the plain map's
and decode back to an equal message (messages written before the switch
still decode).

The switch itself was decided on this benchmark's first form, which timed
the hand-written codec against msgspec in one run (docs/benchmarks.md,
2026-11-29): 7-9x faster per message, the same bytes.

Last line, JSON: per message ``<name>_encode_us`` / ``<name>_decode_us`` for
``codec`` and ``msgpack_plain``, ``<name>_vs_plain`` (codec time / plain time,
encode + decode), ``<name>_bytes``, ``wire_compatible``, ``rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack
from pacer.codec import decode, encode, to_dict
from pacer.contracts.agent import AgentMetrics
from pacer.contracts.shards import LeaseReply, LeaseRequest, ShardLease, ShardProgress


def messages() -> dict[str, Any]:
    """Realistic sizes: a worker holding two shards reports one done and progress on two; the reply
    grants two shards; an agent's metrics of one window."""
    return {
        "lease_request": LeaseRequest(job="ads-online", dataset="train", node="worker-3", want=2, done=[17],
                                      progress=[ShardProgress(18, 1200), ShardProgress(19, 300)], held=[18, 19]),
        "lease_reply": LeaseReply(shards=[ShardLease(20 + i, 0, (20 + i) * 5120, (21 + i) * 5120, (20 + i) * 5120,
                                                     1234 + i) for i in range(2)], lease_s=30.0, finished=False),
        "agent_metrics": AgentMetrics(job="ads-online", node="worker-3", role="worker", ts=1795935112.88,
                                      local_step=4410, iteration=4410, bpt_s=0.0123, batch_size=256,
                                      samples_per_s=20813.0, samples_total=1128960, cpu_percent=97.5,
                                      rss_bytes=612_000_000, last_action_seq=2, last_action_iteration=4000,
                                      primary=False, steps=10, steps_total=4410, incarnation=1),
    }


def per_op_us(fn: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", type=int, default=20_000, help="operations per timing")
    args = ap.parse_args()
    out: dict[str, Any] = {"rounds": args.rounds}
    compatible = True
    for name, msg in messages().items():
        cls = type(msg)
        plain = to_dict(msg)
        ours, floor = encode(msg), msgpack.packb(plain, use_bin_type=True)
        same = ours == floor and decode(cls, floor) == msg
        compatible = compatible and same
        times: dict[str, list[float]] = {k: [] for k in ("ce", "cd", "pe", "pd")}
        for r in range(args.rounds):
            runs: list[tuple[str, Callable[[], Any]]] = [
                ("ce", lambda m=msg: encode(m)), ("cd", lambda c=cls, b=ours: decode(c, b)),
                ("pe", lambda d=plain: msgpack.packb(d, use_bin_type=True)),
                ("pd", lambda b=floor: msgpack.unpackb(b, raw=False))]
            for key, fn in runs if r % 2 == 0 else runs[::-1]:
                times[key].append(per_op_us(fn, args.ops))
        med = {k: statistics.median(v) for k, v in times.items()}
        out |= {f"{name}_encode_us": {"codec": round(med["ce"], 2), "msgpack_plain": round(med["pe"], 2)},
                f"{name}_decode_us": {"codec": round(med["cd"], 2), "msgpack_plain": round(med["pd"], 2)},
                f"{name}_vs_plain": round((med["ce"] + med["cd"]) / (med["pe"] + med["pd"]), 2),
                f"{name}_bytes": len(ours)}
        print(f"{name:14s} codec enc {med['ce']:5.2f} dec {med['cd']:5.2f} us | plain msgpack enc {med['pe']:5.2f} "
              f"dec {med['pd']:5.2f} us | x{out[f'{name}_vs_plain']} | compatible {same}", flush=True)
    out["wire_compatible"] = compatible
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
