"""A parameter server: ``python -m pacer.trainer.ps --cluster JSON --index I``.

It only hosts variables; workers place them here with replica_device_setter.
SIGTERM ends it at once (its state lives in checkpoints).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from pacer.extras import require_or_exit
from pacer.trainer.cluster import ClusterDesc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--index", type=int, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    require_or_exit("trainer", "a TensorFlow parameter server")
    import tensorflow as tf

    cluster = ClusterDesc.from_json(args.cluster)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=2)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster.as_tf()), job_name="ps",
                                  task_index=args.index, config=config, start=True)
    print(f"ps {args.index} serving at {server.target}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    # server.join() would never return; a PS holds no state that a checkpoint does not.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
