"""A coordinator (chief) process for the restart test.

    python tests/coordinator_chief.py train CKPT_DIR   # 6 steps, save, 3 more, then SIGKILL
    python tests/coordinator_chief.py resume CKPT_DIR  # restore, 4 more steps, print JSON
    python tests/coordinator_chief.py count -          # 10 steps, print JSON (launcher test)

Every step adds 1 to ``step`` and to each entry of ``w`` (sgd with lr -1 on a gradient of 1).
"""

import json
import os
import signal
import sys
import time

import numpy as np

import jaxdist
from jaxdist.coordinator import ClusterCoordinator
from jaxdist.ps import optimizers as O


def main(mode: str, ckpt: str) -> None:
    strategy = jaxdist.ParameterServerStrategy(timeout=30.0)
    with strategy.scope():
        model = strategy.create_variables(
            {"w": np.zeros((4,), np.float32), "step": np.zeros((), np.float32)}, O.sgd(-1.0),
            name="model")
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                                     join_timeout=60.0)

    def step(sleep):
        time.sleep(sleep)
        model.apply_gradients({"w": np.ones((4,), np.float32),
                               "step": np.ones((), np.float32)})

    def train(n, sleep=0.0):
        for _ in range(n):
            coordinator.schedule(step, args=(sleep,))
        coordinator.join()

    if mode == "count":
        rvs = [coordinator.schedule(lambda: os.getpid()) for _ in range(10)]
        train(10, 0.01)
        print(json.dumps({"step": float(model.pull()["step"]),
                          "pids": sorted({rv.fetch() for rv in rvs})}), flush=True)
        coordinator.shutdown()
        return
    if mode == "train":
        train(6)
        strategy.extended.save(ckpt, 6)
        train(3)
        print(json.dumps({"before_kill": float(model.pull()["step"])}), flush=True)
        for _ in range(4):
            coordinator.schedule(step, args=(0.2,))
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)  # the coordinator dies with functions in flight
    restored_at = float(model.pull()["step"])
    strategy.extended.restore(ckpt)
    train(4)
    values = model.pull()
    print(json.dumps({"restored_at": restored_at, "step": float(values["step"]),
                      "w": values["w"].tolist()}), flush=True)
    coordinator.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
