"""``python -m jaxdist.launch``: runs a command as every task of a local cluster (a ``TF_CONFIG``,
TLS identity and credentials per task).

Starts one process per task on this machine, each with its own ``TF_CONFIG`` (free ports on
127.0.0.1, a fresh cluster token), prints each output line prefixed with the task name, and:

* generates a throwaway CA and one certificate per task in a private temporary directory
  (0700, deleted at exit) and gives each task its own (``JAXDIST_TLS_CA/CERT/KEY``): every
  gRPC service of the cluster speaks mutual TLS. ``--insecure`` uses plaintext on loopback
  instead (``JAXDIST_INSECURE=1``);
* gives the chief a fresh coordinator token (the right to run code on the workers: the chief
  signs its requests with a key derived from it) and each worker only the chief's public key
  and its own answer key (``jaxdist.coordinator.CoordinatorKeys``);

* exits 0 when every chief/worker task exits 0 (ps tasks, which serve forever, are then
  stopped; an evaluator gets ``--evaluator-grace`` seconds to finish);
* when a task fails, stops the others and exits with that task's exit code;
* with ``--max-restarts N``, restarts instead, up to N times, when a task exits with a
  restartable code (42: preempted, 1: failed, or death by a signal; any other code but 0,
  2 for a bad config, 3 for nothing left to train and 130 for an interrupt; after a restart, 3
  means the run before it finished the training: the job is done, exit 0), reporting each
  restart (``[launch] worker:1 exited with 42 (preempted); restart 1 of 3: restarting every
  task (worker:0, worker:1) in 1s``); after N it stops the others and exits with the last failing
  task's code. What restarts: every task of a synchronous job (MultiWorkerMirrored) and of a
  between-graph parameter-server job (whose ps tasks restore the chief's latest checkpoint),
  as a fresh cluster: new ports (a new coordination service) and a new cluster token, the same
  TLS identities and coordinator credentials; under ``--coordinator`` only a lost worker, on
  its address (the chief re-sends its functions; a lost chief or ps restarts every task); an
  evaluator alone. After an exit with 42 the other tasks get ``--grace`` seconds to save and
  exit on their own before they are stopped; each restart then waits ``--restart-delay``
  seconds (default 1, no growing back-off). The program resumes from its latest checkpoint
  (``python -m jaxdist.train`` does with ``checkpoint.dir``), also on another ``--workers``
  count: the global batch and the position in the data stay;
* on Ctrl-C stops every task, never restarting, and exits 130; on SIGTERM the same with 143,
  or 42 when every training task saved a preemption checkpoint and exited with 42.

Who runs what (as TensorFlow's parameter-server guide has it: ps tasks, and with a
coordinator worker tasks too, run a server and wait; the program runs elsewhere):

* ps tasks run ``python -m jaxdist.server --checkpoint_root ROOT``: they serve the variables
  and save or restore checkpoints only under ``ROOT`` (``--checkpoint-root``, default
  ``$JAXDIST_PS_CHECKPOINT_ROOT``, else the launcher's working directory, so a checkpoint path
  relative to the program's working directory lies inside it);
* without ``--coordinator`` (between-graph, TF1 style) every chief and worker task runs the
  command; with ``--coordinator`` (TF2 ``ClusterCoordinator``) a chief task is added and runs
  the command, and the worker tasks run ``python -m jaxdist.server`` too (they run the
  functions the chief schedules), all stopped when the chief exits;
* ``python -m jaxdist.train`` serves its own ps tasks (they restore the job's
  ``checkpoint.dir`` at start), so between-graph its ps tasks run the command as well; so do
  every program's with ``--ps-runs-command``.

Example:
    python -m jaxdist.launch --workers 2 --devices-per-process 2 -- \\
        python -m jaxdist.train --config configs/multi_worker.yaml
    python -m jaxdist.launch --workers 2 --devices-per-process 2 --max-restarts 3 -- \\
        python -m jaxdist.train --config configs/multi_worker.yaml
    python -m jaxdist.launch --workers 2 --ps 2 -- python train_between_graph.py
    python -m jaxdist.launch --coordinator --workers 2 --ps 1 -- python train_coordinator.py
    python -m jaxdist.launch --backend ray --address HEAD:6379 --workers 2 -- \\
        python -m jaxdist.train --config configs/multi_worker.yaml

``--backend ray`` runs every task as a Ray actor on the nodes of a Ray cluster (``--address``,
else a local Ray started for the run), each with ``--cpus-per-task`` / ``--gpus-per-task``,
spread over the nodes (``--placement``), its ``TF_CONFIG`` built from its node's address and a
port free there; the rest is as above (``jaxdist.ray``; docs/multi_host.md, "Ray").
"""

import sys
from collections.abc import Sequence

from jaxdist._src.launch.launcher import Launcher
from jaxdist._src.launch.launcher import main as _main_local
from jaxdist._src.launch.launcher import parse_launch_args as _parse_launch_args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (``--backend ray``: see
    ``jaxdist.ray``)."""
    args, command = _parse_launch_args(argv)
    if args.backend == "ray":
        from jaxdist._src.launch.ray_launch import main_ray

        return main_ray(args, command)
    return _main_local(argv)


__all__ = ["Launcher", "main"]

if __name__ == "__main__":
    sys.exit(main())
