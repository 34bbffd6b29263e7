"""``python -m jaxdist.slurm``: run a command as every task of a Slurm job, each with its own
``TF_CONFIG``, TLS identity and credentials (the Slurm counterpart of ``jaxdist.launch``).

In a batch script (``sbatch``) or an allocation (``salloc``), on the batch host:

1. reads the allocation (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``) and lays out the
   cluster as ``SlurmClusterResolver`` does (nodes sorted by name, each with its tasks per
   node, task ``k`` of a node on ``port_base + k``, jobs sorted by name: ``--jobs ps=1,worker=2``
   makes task 0 ``ps:0``);
2. creates the credentials directory (``--credentials-dir``, default
   ``.jaxdist-slurm/job-<id>-<restart>`` under the working directory, which must be on storage every
   node mounts, mode 0700) with one subdirectory per task (0700): the cluster CA, a certificate
   valid for the task's node (its name and address) and its key, and ``secrets.json`` (0600):
   the cluster token; the chief also the coordinator token, a worker only the chief's public key
   and its own answer key. The CA's private key never touches the disk. Nothing secret is put
   on a command line, in the environment Slurm sees, or in the output;
3. runs ``srun --distribution=block --kill-on-bad-exit=0 python -m jaxdist.slurm --task DIR --
   COMMAND``: on its node each task checks that Slurm put it where the layout says, reads its own
   files only (``secrets.json`` is deleted once read), and runs COMMAND with ``TF_CONFIG``
   (cluster, task, token), ``JAXDIST_CLUSTER_TOKEN``, ``JAXDIST_TLS_CA/CERT/KEY`` and its
   coordinator credential in COMMAND's environment only; when COMMAND ends it prints
   ``[jaxdist.slurm] worker:1 (task 1 on n2) exited with code 1``. Tasks that serve (ps; with
   ``--coordinator`` the workers too) are stopped once the training tasks ended, an evaluator
   after ``--evaluator-grace`` seconds more;
4. after ``srun``: deletes the credentials directory; names each task that never reported (its
   node or process was lost); when every training task exited with 42 (jaxdist's preemption
   exit: ``#SBATCH --signal=TERM@60`` or ``scancel --signal=TERM`` made them save a checkpoint)
   and the job may be requeued (``sbatch --requeue``), asks Slurm to requeue it
   (``scontrol requeue``): the job runs again from the start of its script and resumes from its
   checkpoint. Exits with ``srun``'s status (the highest task exit code; 42 when every
   training task was preempted).

A SIGTERM to ``python -m jaxdist.slurm`` itself (``#SBATCH --signal=B:TERM@60``: the batch
shell, which ``exec``s it) is passed on to every task with ``scancel --signal=TERM``.

Example:
    >>> from jaxdist._src.launch.slurm_launch import layout
    >>> plan = layout(["n1", "n2"], [2, 1], {"ps": 1, "worker": 2}, 9000)
    >>> [(t.name, t.node, t.address) for t in plan]
    [('ps:0', 'n1', 'n1:9000'), ('worker:0', 'n1', 'n1:9001'), ('worker:1', 'n2', 'n2:9000')]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.resolver import TOKEN_ENV
from jaxdist._src.cluster.slurm import expand_hostlist, expand_tasks_per_node
from jaxdist._src.distributed.exit_codes import RESTART_EXIT_CODE, SERVER_IGNORES_SIGTERM_ENV
from jaxdist._src.launch.launcher import command_after_dashes
from jaxdist._src.launch.local import new_token, tf_config
from jaxdist._src.security.credentials import new_coordinator_token
from jaxdist._src.security.pki import LocalPKI, apply_task_security, per_task_pki

#: The file of a credentials directory that says how the cluster is laid out (not secret).
PLAN_FILE = "cluster.json"
#: A task's secrets (tokens, coordinator credential), deleted by the task once read.
SECRETS_FILE = "secrets.json"
DEFAULT_PORT_BASE = 8888
#: The environment variable ``--port-base`` defaults to (an sbatch script need not change).
PORT_BASE_ENV = "JAXDIST_SLURM_PORT_BASE"
_PREFIX = "[jaxdist.slurm]"


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """One task of the layout: its Slurm rank, name, node and address."""

    procid: int
    job: str
    index: int
    node: str
    address: str
    slot: int = 0  #: the task's place on its node (port_base + slot; GPUs slot * gpus_per_task on)

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


def parse_jobs(text: str | None, num_tasks: int) -> dict[str, int]:
    """``"ps=1,worker=2"`` -> ``{"ps": 1, "worker": 2}``; ``None``: every task a worker.

    Example:
        >>> from jaxdist._src.launch.slurm_launch import parse_jobs
        >>> parse_jobs("ps=1,worker=2", 3), parse_jobs(None, 2)
        ({'ps': 1, 'worker': 2}, {'worker': 2})
    """
    if not text:
        return {"worker": num_tasks}
    jobs: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise ClusterConfigError(f"--jobs {text!r} has {part!r}: expected JOB=COUNT with "
                                     f"COUNT >= 1, e.g. ps=1,worker=2")
        jobs[name.strip()] = int(count)
    return jobs


def layout(nodes: Sequence[str], tasks_per_node: Sequence[int], jobs: Mapping[str, int],
           port_base: int) -> list[SlurmTask]:
    """The tasks of a job step as ``SlurmClusterResolver`` lays them out (TF's rules).

    Raises:
        ClusterConfigError: the jobs ask for another number of tasks than the step has.
    """
    if len(nodes) != len(tasks_per_node):
        raise ClusterConfigError(f"Slurm tasks per node {list(tasks_per_node)} do not match "
                                 f"the {len(nodes)} nodes {list(nodes)}")
    slots = [(node, k) for node, n in sorted(zip(nodes, tasks_per_node)) for k in range(n)]
    if sum(jobs.values()) != len(slots):
        raise ClusterConfigError(f"--jobs {dict(jobs)} ask for {sum(jobs.values())} tasks, but "
                                 f"the Slurm job has {len(slots)} (nodes {list(nodes)}, tasks "
                                 f"per node {list(tasks_per_node)}); expected "
                                 f"sbatch --ntasks={sum(jobs.values())}")
    out: list[SlurmTask] = []
    for job, n in sorted(jobs.items()):
        for i in range(n):
            node, k = slots[len(out)]
            out.append(SlurmTask(len(out), job, i, node, f"{node}:{port_base + k}", k))
    return out


def cluster_of(plan: Sequence[SlurmTask]) -> dict[str, list[str]]:
    """``{job: [address, ...]}`` of a layout."""
    cluster: dict[str, list[str]] = {}
    for t in plan:
        cluster.setdefault(t.job, []).append(t.address)
    return cluster


def _node_names(node: str) -> list[str]:
    """The names a node's certificate is valid for: its name and the addresses it resolves to."""
    names = [node]
    try:
        names += sorted({i[4][0] for i in socket.getaddrinfo(node, None)})
    except OSError:
        pass
    return names


def _write_json(path: str, data: Mapping, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)


def prepare(directory: str, plan: Sequence[SlurmTask], rpc_layer: str = "grpc",
            gpus_per_task: int = 0, coordinator: bool = False,
            evaluator_grace: float = 60.0) -> LocalPKI:
    """Creates the credentials directory of a job (see the module docstring).

    Raises:
        FileExistsError: ``directory`` exists (a credentials directory is never reused).
    """
    os.makedirs(os.path.dirname(os.path.abspath(directory)), mode=0o700, exist_ok=True)
    os.mkdir(directory, 0o700)
    os.chmod(directory, 0o700)
    pki = per_task_pki({t.name: (os.path.join(directory, f"task-{t.procid}"),
                                 _node_names(t.node)) for t in plan})
    pki.directory = directory
    token, coordinator_token = new_token(), new_coordinator_token()
    for t in plan:
        env = apply_task_security({}, t.job, t.index, None, coordinator_token)
        env.pop("JAXDIST_INSECURE", None)
        env[TOKEN_ENV] = token
        _write_json(os.path.join(directory, f"task-{t.procid}", SECRETS_FILE), env, 0o600)
    _write_json(os.path.join(directory, PLAN_FILE),
                {"cluster": cluster_of(plan), "rpc_layer": rpc_layer,
                 "gpus_per_task": int(gpus_per_task),
                 "training_jobs": list(training_jobs(coordinator)),
                 "evaluator_grace": float(evaluator_grace),
                 "tasks": [dataclasses.asdict(t) for t in plan]}, 0o644)
    return pki


def task_environment(directory: str, environ: Mapping[str, str]) -> tuple[SlurmTask, dict]:
    """This task's environment for COMMAND (run inside ``srun``; see the module docstring).

    Reads the layout and this task's own files (by ``SLURM_PROCID``) and deletes its
    ``secrets.json``.

    Raises:
        ClusterConfigError: not in a Slurm step, the step has another number of tasks than the
            layout, or Slurm put this task on another node than the layout says.
    """
    procid = environ.get("SLURM_PROCID", "")
    if not procid.isdigit():
        raise ClusterConfigError("python -m jaxdist.slurm --task runs inside srun: $SLURM_PROCID "
                                 f"is {procid or 'not set'}")
    with open(os.path.join(directory, PLAN_FILE)) as f:
        plan = json.load(f)
    tasks = [SlurmTask(**t) for t in plan["tasks"]]
    step_tasks = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", ""))
    if step_tasks != str(len(tasks)) or int(procid) >= len(tasks):
        raise ClusterConfigError(f"the srun step has {step_tasks} tasks (this is task "
                                 f"{procid}), but the cluster has {len(tasks)}: run srun with "
                                 f"the whole allocation")
    me = tasks[int(procid)]
    node = environ.get("SLURMD_NODENAME", "")
    if node and node != me.node:
        raise ClusterConfigError(f"Slurm put task {procid} ({me.name}) on node {node}, but the "
                                 f"cluster has it on {me.node} ({me.address}): run srun with "
                                 f"--distribution=block")
    task_dir = os.path.join(directory, f"task-{me.procid}")
    secrets_path = os.path.join(task_dir, SECRETS_FILE)
    try:
        with open(secrets_path) as f:
            secrets = json.load(f)
        os.unlink(secrets_path)
    except FileNotFoundError:
        raise ClusterConfigError(f"task {procid} ({me.name}): its secrets in {task_dir} were "
                                 f"already read (each task reads them once, at its start)"
                                 ) from None
    env = dict(environ)
    for key in list(env):
        if key.startswith(("JAXDIST_TLS_", "JAXDIST_COORDINATOR_")) or key in (
                "JAXDIST_INSECURE", TOKEN_ENV, "TF_CONFIG"):
            del env[key]
    env.update(secrets)
    env["TF_CONFIG"] = tf_config(plan["cluster"], me.job, me.index, secrets[TOKEN_ENV])
    env.update({"JAXDIST_TLS_CA": os.path.join(task_dir, "ca.pem"),
                "JAXDIST_TLS_CERT": os.path.join(task_dir, "cert.pem"),
                "JAXDIST_TLS_KEY": os.path.join(task_dir, "key.pem"),
                "PYTHONUNBUFFERED": "1"})
    gpus = int(plan.get("gpus_per_task") or 0)
    if gpus:  # SlurmClusterResolver's auto_set_gpu: task k of a node gets GPUs k*g ... k*g+g-1
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(me.slot * gpus + g) for g in range(gpus))
    return me, env


def _say(msg: str) -> None:
    print(f"{_PREFIX} {msg}", flush=True)


def _read_exit(directory: str, procid: int) -> int | None:
    try:
        with open(os.path.join(directory, f"task-{procid}", "exit")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def training_jobs(coordinator: bool) -> tuple[str, ...]:
    """The jobs whose tasks train (their end ends the job): the chief alone under a TF2
    ``ClusterCoordinator`` (its workers serve), else the chief and the workers.

    Example:
        >>> from jaxdist._src.launch.slurm_launch import training_jobs
        >>> training_jobs(False), training_jobs(True)
        (('chief', 'worker'), ('chief',))
    """
    return ("chief",) if coordinator else ("chief", "worker")


def _training_done(directory: str, tasks: Sequence[SlurmTask], training: Sequence[str]) -> bool:
    """Whether every training task reported an exit code (so the servers may stop)."""
    mine = [t for t in tasks if t.job in training]
    return bool(mine) and all(_read_exit(directory, t.procid) is not None for t in mine)


def _run_task(directory: str, command: Sequence[str], grace: float = 10.0) -> int:
    me, env = task_environment(directory, os.environ)
    with open(os.path.join(directory, PLAN_FILE)) as f:
        plan = json.load(f)
    tasks = [SlurmTask(**t) for t in plan["tasks"]]
    training = tuple(plan.get("training_jobs") or training_jobs(False))
    evaluator_grace = float(plan.get("evaluator_grace", 60.0))
    node = os.environ.get("SLURMD_NODENAME", me.node)
    # A serving task (a ps; a coordinator's worker) keeps serving through a preemption's
    # SIGTERM, which Slurm sends to every process of the step, while the training tasks agree
    # where to stop and save; it is stopped with SIGINT once they have ended.
    serving = me.job not in training and me.job != "evaluator"
    if serving:
        env[SERVER_IGNORES_SIGTERM_ENV] = "1"
    # Slurm signals every process of the step (SIGTERM on preemption): COMMAND handles it.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(list(command), env=env,
                                preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                    for s in (signal.SIGTERM, signal.SIGINT)])
    except OSError as e:
        _say(f"{me.name} (task {me.procid} on {node}) could not start {command[0]!r}: "
             f"{e.strerror or e}")
        return 127
    _say(f"{me.name} (task {me.procid} on {node}, {me.address}) started as pid {proc.pid}")
    stopped, stop_at = False, None
    while True:
        try:
            code = proc.wait(0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        # A ps task (a coordinator's worker too) serves until stopped: stop it once training
        # is over, as python -m jaxdist.launch does (srun's step ends when all its tasks have);
        # an evaluator gets evaluator_grace seconds to evaluate the last checkpoint first.
        if me.job in training or stopped:
            continue
        if stop_at is None and _training_done(directory, tasks, training):
            stop_at = time.monotonic() + (evaluator_grace if me.job == "evaluator" else 0.0)
        if stop_at is not None and time.monotonic() >= stop_at:
            stopped = True
            proc.send_signal(signal.SIGINT if serving else signal.SIGTERM)
            try:
                code = proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                proc.kill()
    status = code if code >= 0 else 128 - code
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    after = " (stopped once training was over)" if stopped else ""
    _say(f"{me.name} (task {me.procid} on {node}) {how}{after}")
    try:
        with open(os.path.join(directory, f"task-{me.procid}", "exit"), "w") as f:
            f.write(str(status))
    except OSError:
        pass
    return status


#: The status of a task ended by SIGTERM's default action (128 + 15).
SIGTERM_STATUS = 128 + int(signal.SIGTERM)


def _job_requeueable(job_id: str) -> bool:
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return " Requeue=1 " in f" {out} "


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxdist.slurm",
        description="Run COMMAND as every task of this Slurm job (TF_CONFIG, TLS identity and "
                    "credentials per task); run it in the batch script, it calls srun.",
        epilog="Example: python -m jaxdist.slurm -- python -m jaxdist.train --config "
               "configs/multi_worker.yaml")
    p.add_argument("--jobs", default=None, metavar="JOB=N,...",
                   help="the jobs, sorted by name onto the tasks as SlurmClusterResolver does "
                        "(default: every task a worker), e.g. ps=1,worker=2")
    p.add_argument("--port-base", type=int,
                   default=os.environ.get(PORT_BASE_ENV) or DEFAULT_PORT_BASE,
                   help=f"task k of a node listens on PORT_BASE + k (default "
                        f"${PORT_BASE_ENV}, else {DEFAULT_PORT_BASE})")
    p.add_argument("--gpus-per-task", type=int, default=0, metavar="G",
                   help="give task k of a node GPUs k*G ... k*G+G-1 (CUDA_VISIBLE_DEVICES), as "
                        "SlurmClusterResolver's auto_set_gpu does (default 0: leave "
                        "CUDA_VISIBLE_DEVICES as Slurm set it)")
    p.add_argument("--credentials-dir", default=None, metavar="DIR",
                   help="where the per-task credentials are made (a new directory on storage "
                        "every node mounts; default .jaxdist-slurm/job-<id>, deleted at exit)")
    p.add_argument("--coordinator", action="store_true",
                   help="TF2 ClusterCoordinator job: the chief alone trains; the ps and worker "
                        "tasks serve and are stopped once the chief ended")
    p.add_argument("--evaluator-grace", type=float, default=60.0, metavar="S",
                   help="seconds an evaluator task may run after training ended (default 60)")
    p.add_argument("--no-requeue", action="store_true",
                   help="do not requeue the job when every training task was preempted (42)")
    p.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                   help="an extra srun argument (repeatable), e.g. --srun-arg=--gpus-per-task=1")
    p.add_argument("--task", default=None, metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    command = command_after_dashes(_parser(), args.command, "jaxdist.slurm")
    try:
        if args.task is not None:
            return _run_task(args.task, command)
        return _run_job(args, command)
    except ClusterConfigError as e:
        print(f"python -m jaxdist.slurm: {e}", file=sys.stderr)
        return 2


def _run_job(args: argparse.Namespace, command: list[str]) -> int:
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id or "SLURM_JOB_NODELIST" not in env:
        raise ClusterConfigError("not inside a Slurm job ($SLURM_JOB_ID / $SLURM_JOB_NODELIST "
                                 "unset): run it in an sbatch script or under salloc")
    if shutil.which(command[0]) is None:
        raise ClusterConfigError(f"command not found: {command[0]!r}")
    if args.gpus_per_task < 0:
        raise ClusterConfigError(f"--gpus-per-task must be >= 0, got {args.gpus_per_task}")
    nodes = expand_hostlist(env["SLURM_JOB_NODELIST"])
    per_node = expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "1"))
    plan = layout(nodes, per_node, parse_jobs(args.jobs, sum(per_node)), args.port_base)
    restart = env.get("SLURM_RESTART_COUNT", "0")
    directory = os.path.abspath(args.credentials_dir or os.path.join(
        ".jaxdist-slurm", f"job-{job_id}-{restart}"))
    try:
        prepare(directory, plan, gpus_per_task=args.gpus_per_task,
                coordinator=args.coordinator, evaluator_grace=args.evaluator_grace)
    except OSError as e:
        raise ClusterConfigError(f"cannot create the credentials directory {directory}: "
                                 f"{e.strerror or e} (a new directory is made for every run)"
                                 ) from None
    try:
        _say(f"job {job_id} (restart {restart}): "
             + ", ".join(f"{t.name} on {t.node} ({t.address})" for t in plan)
             + f"; credentials in {directory} (0700, one directory per task)")
        srun = ["srun", "--distribution=block", "--kill-on-bad-exit=0",
                f"--ntasks={len(plan)}", *args.srun_arg,
                sys.executable, "-m", "jaxdist.slurm", "--task", directory, "--", *command]
        proc = subprocess.Popen(srun)

        def forward(signum, frame):
            # SIGTERM to the batch shell (#SBATCH --signal=B:TERM@T, scancel --batch): pass it
            # to every task of the job's steps, as --signal=TERM@T would (srun itself takes
            # SIGTERM as "kill the step"); a task saves and exits 42.
            _say(f"got signal {signum}: sending SIGTERM to every task (scancel --signal=TERM)")
            subprocess.run(["scancel", "--signal=TERM", job_id], timeout=60, check=False)

        old = signal.signal(signal.SIGTERM, forward)
        # Ctrl-C (under salloc) reaches srun too, which reports on the first and ends the step
        # on a second within a second; this process reports once srun is done.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
        code = code if code >= 0 else 128 - code
        codes = {}
        for t in plan:
            got = _read_exit(directory, t.procid)
            if got is not None:
                codes[t.name] = got
            else:
                _say(f"{t.name} (task {t.procid} on {t.node}) did not report an exit code: its "
                     f"process or node was lost")
        training = [c for n, c in codes.items()
                    if n.split(":")[0] in training_jobs(args.coordinator)]
        _say(f"srun exited with {code}; task exit codes {codes}")
        # Preempted: every training task saved and exited 42, or (one that had not yet set
        # up its preemption handler, e.g. still starting) ended by the SIGTERM itself, with at
        # least one 42 (the chief's: the agreed checkpoint is written).
        if (RESTART_EXIT_CODE in training
                and all(c in (RESTART_EXIT_CODE, SIGTERM_STATUS) for c in training)):
            code = RESTART_EXIT_CODE
            if not args.no_requeue and _job_requeueable(job_id):
                _say(f"every training task saved and exited with {RESTART_EXIT_CODE} "
                     f"(preempted): requeueing job {job_id}; it resumes from its checkpoint")
                shutil.rmtree(directory, ignore_errors=True)
                subprocess.run(["scontrol", "requeue", job_id], timeout=60, check=False)
            else:
                _say(f"every training task saved and exited with {RESTART_EXIT_CODE} "
                     f"(preempted); the job is not requeued (submit it with sbatch --requeue)")
        return code
    finally:
        shutil.rmtree(directory, ignore_errors=True)


__all__ = ["PLAN_FILE", "SECRETS_FILE", "SlurmTask", "cluster_of", "layout", "main",
           "parse_jobs", "prepare", "task_environment", "training_jobs"]
