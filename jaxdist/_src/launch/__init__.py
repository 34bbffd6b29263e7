"""Launchers: start and supervise a cluster's tasks (local processes, Slurm, Ray), and the
local test clusters of ``jaxdist.testing``."""
