"""What every process on this machine shows of itself, for the credentials tests of
tests/test_slurm_cluster.py and tests/test_ray_cluster.py: a secret must be in no process's
command line, and in no environment but its task's command's (the probe's)."""

from __future__ import annotations

import os


def process_records(probe: str, wrapper: str) -> tuple[list[str], int]:
    """Every process's command line and every environment but the probes' (a process whose
    command line names ``probe`` and not ``wrapper``); returns them and how many probes ran."""
    records: list[str] = []
    probes_seen = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().decode("latin-1")
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().decode("latin-1")
        except OSError:
            continue
        records.append(cmdline)
        if probe in cmdline and wrapper not in cmdline:
            probes_seen += 1
        else:
            records.append(environ)
    return records, probes_seen
