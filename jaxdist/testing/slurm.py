"""A real Slurm cluster on one machine, for tests: ``slurmctld`` and one ``slurmd -N <node>``
per node name, each node with a loopback address of its own (``n1`` -> 127.0.0.1, ``n2`` ->
127.0.0.2), from the distribution's packages (``apt-get install slurm-wlm munge``). Needs root;
``unavailable_reason()`` says why it cannot run here.

Example:
    >>> with LocalSlurm(("n1", "n2")) as slurm:                            # doctest: +SKIP
    ...     job = slurm.run("sbatch", "--parsable", "job.sbatch").stdout.strip()
    ...     slurm.wait_job(job, timeout=120)
    'COMPLETED'
"""

from jaxdist._src.launch.slurm_local import LocalSlurm, SlurmUnavailable, unavailable_reason

__all__ = ["LocalSlurm", "SlurmUnavailable", "unavailable_reason"]
