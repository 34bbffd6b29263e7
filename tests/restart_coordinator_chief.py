"""A ClusterCoordinator chief for ``launch --coordinator --max-restarts``: it SIGKILLs worker:1
mid-run and keeps scheduling; the launcher restarts that worker alone on its address.

    python -m jaxdist.launch --coordinator --workers 2 --ps 1 --max-restarts 1 -- \\
        python tests/restart_coordinator_chief.py

Every step adds 1 to ``step`` on the ps task and returns the pid and index of the worker that
ran it. The chief prints one JSON line: the steps scheduled, the ``step`` the ps holds (equal
when every function ran exactly once), worker:1's pid before the kill and after its restart.
"""

import json
import os
import signal
import time

import numpy as np

import jaxdist
from jaxdist.coordinator import ClusterCoordinator
from jaxdist.ps import optimizers as O


def main() -> None:
    strategy = jaxdist.ParameterServerStrategy(timeout=30.0)
    with strategy.scope():
        model = strategy.create_variables({"step": np.zeros((), np.float32)}, O.sgd(-1.0),
                                          name="model")
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=0.2, heartbeat_timeout=2.0,
                                     join_timeout=60.0)

    def step():
        time.sleep(0.02)
        model.apply_gradients({"step": np.ones((), np.float32)})
        return os.getpid(), json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    scheduled = 0

    def train(n):
        nonlocal scheduled
        rvs = [coordinator.schedule(step) for _ in range(n)]
        scheduled += n
        coordinator.join()
        return {rv.fetch() for rv in rvs}

    deadline = time.monotonic() + 30
    seen = train(10)
    while not any(i == 1 for _, i in seen) and time.monotonic() < deadline:
        seen |= train(4)
    (old,) = {pid for pid, i in seen if i == 1}
    os.kill(old, signal.SIGKILL)  # worker:1 dies; its functions in flight run again elsewhere
    seen = train(20)
    deadline = time.monotonic() + 60  # until worker:1 is back, restarted by the launcher
    while not any(i == 1 and pid != old for pid, i in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = train(4)
    new = sorted({pid for pid, i in seen if i == 1 and pid != old})
    print(json.dumps({"scheduled": scheduled, "step": float(model.pull()["step"]), "old": old,
                      "new": new}), flush=True)
    coordinator.shutdown()


if __name__ == "__main__":
    main()
