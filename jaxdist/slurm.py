"""``python -m jaxdist.slurm``: runs a command as every task of a Slurm job (a ``TF_CONFIG``, TLS
identity and credentials per task; a preempted job is requeued).

Run in the batch script (``sbatch``) or under ``salloc``; it calls ``srun`` itself and gives
each task its own ``TF_CONFIG`` (the allocation laid out as ``SlurmClusterResolver`` lays it
out), a TLS certificate for its node, the cluster token and its coordinator credential, through
a private directory on shared storage that each task reads its own part of (never a command
line, a log or Slurm's job record). A job whose training tasks were preempted (exit 42) is
requeued when it was submitted with ``sbatch --requeue``. See docs/multi_host.md ("Slurm").

Example:
    python -m jaxdist.slurm -- python -m jaxdist.train --config configs/multi_worker.yaml
    python -m jaxdist.slurm --jobs ps=1,worker=2 -- \\
        python -m jaxdist.train --config configs/parameter_server.yaml
    python -m jaxdist.slurm --coordinator --jobs chief=1,ps=1,worker=1 -- \\
        python -m jaxdist.train --config configs/parameter_server_coordinator.yaml
"""

import sys

from jaxdist._src.launch.slurm_launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
