"""A parameter server: ``python -m pacer.trainer.ps --cluster JSON --index I [--ipc PATH]``.

It only hosts variables; workers place them here with replica_device_setter.
SIGTERM ends it at once (its state lives in checkpoints).  With ``--ipc``
it attaches to its agent's IPC file (role ``ps``) only to tell the agent its
pid (CPU and RSS readings); it never records steps: the agent measures the
server from outside (see :mod:`pacer.agent.agent`, "Servers").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from pacer.agent.ipc import TrainerIPC
from pacer.extras import require_or_exit
from pacer.trainer.cluster import ClusterDesc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--ipc", default="", help="the agent's IPC file (tells the agent this process's pid)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    require_or_exit("trainer", "a TensorFlow parameter server")
    import tensorflow as tf

    cluster = ClusterDesc.from_json(args.cluster)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=2)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster.as_tf()), job_name="ps",
                                  task_index=args.index, config=config, start=True)
    print(f"ps {args.index} serving at {server.target}", flush=True)
    # Kept open while we serve: the agent reads our pid from it.
    ipc = TrainerIPC(args.ipc, role="ps") if args.ipc else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    if ipc is not None:
        ipc.mark_exiting()
    # server.join() would never return; a PS holds no state that a checkpoint does not.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
