"""The local launcher behind ``python -m jaxdist.launch`` (its module docstring says what it
does): one process per task, each with its own ``TF_CONFIG``, TLS identity and credentials.

Example:
    >>> from jaxdist.launch import Launcher
    >>> Launcher(["python", "train.py"], workers=2, ps=1).argv_for("ps")[1:3]
    ['-m', 'jaxdist.server']
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence

from jaxdist._src.cluster.validation import task_name
from jaxdist._src.distributed.exit_codes import EXIT_ALREADY_DONE, RESTART_EXIT_CODE
from jaxdist._src.launch.arg_types import (
    non_negative_float,
    non_negative_int,
    non_negative_seconds,
    positive_float,
)
from jaxdist._src.launch.local import (
    TaskProcess,
    exit_status,
    local_cluster,
    new_token,
    task_env,
    task_list,
)
from jaxdist._src.launch.restarts import (
    DEFAULT_RESTART_DELAY,
    RestartBudget,
    describe_exit,
    restart_scope,
)
from jaxdist._src.security.credentials import new_coordinator_token
from jaxdist._src.security.pki import LocalPKI, apply_task_security, local_pki

#: The environment variable a ps server reads its checkpoint root from (``jaxdist.server``).
CHECKPOINT_ROOT_ENV = "JAXDIST_PS_CHECKPOINT_ROOT"


def serves_its_own_ps_tasks(command: Sequence[str]) -> bool:
    """Whether ``command`` is ``python -m jaxdist.train ...``, which serves its ps tasks itself
    (they restore the job's checkpoint at start, under its ``checkpoint.dir``).

    Example:
        >>> from jaxdist._src.launch.launcher import serves_its_own_ps_tasks
        >>> serves_its_own_ps_tasks(["python", "-m", "jaxdist.train", "--config", "c.yaml"])
        True
        >>> serves_its_own_ps_tasks(["python", "train.py"])
        False
    """
    args = list(command)
    for i, a in enumerate(args[:-1]):
        if a == "-m" and args[i + 1] == "jaxdist.train":
            return True
    return False


def server_command(job: str, checkpoint_root: str) -> list[str]:
    """The argv the launcher runs for a ps task (or a coordinator's worker task).

    Example:
        >>> from jaxdist._src.launch.launcher import server_command
        >>> server_command("ps", "/runs")[1:]
        ['-m', 'jaxdist.server', '--checkpoint_root', '/runs']
    """
    argv = [sys.executable, "-m", "jaxdist.server"]
    if job == "ps":
        argv += ["--checkpoint_root", checkpoint_root]
    return argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxdist.launch",
        description="Run COMMAND as every task of a local cluster (TF_CONFIG set per task).",
        epilog="Example: python -m jaxdist.launch --workers 2 -- python train.py",
    )
    p.add_argument("--workers", type=int, default=1, help="number of worker tasks")
    p.add_argument("--ps", type=int, default=0, help="number of parameter-server tasks")
    p.add_argument("--chief", action="store_true", help="add a chief task")
    p.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    p.add_argument("--coordinator", action="store_true",
                   help="TF2 ClusterCoordinator mode: adds a chief that runs COMMAND; ps and "
                        "worker tasks run `python -m jaxdist.server`")
    p.add_argument("--checkpoint-root", default=None, metavar="DIR",
                   help="ps tasks save and restore checkpoints only under DIR (default: "
                        f"${CHECKPOINT_ROOT_ENV}, else the current directory)")
    p.add_argument("--ps-runs-command", action="store_true",
                   help="run COMMAND on the ps tasks too (a program that serves its own ps "
                        "tasks, as `python -m jaxdist.train` does, which needs no flag); "
                        "default: ps tasks run `python -m jaxdist.server`")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="force K CPU devices in each process (JAX_NUM_CPU_DEVICES)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping tasks")
    p.add_argument("--evaluator-grace", type=float, default=60.0,
                   help="seconds the evaluator may run after training finished")
    p.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                   help="restart the job's tasks up to N times when a task is preempted (exit "
                        f"{RESTART_EXIT_CODE}), fails or is killed: every task of a synchronous "
                        "job, only the lost worker under --coordinator; the job resumes from "
                        "its latest checkpoint (default 0: never)")
    p.add_argument("--restart-delay", type=non_negative_seconds,
                   default=DEFAULT_RESTART_DELAY, metavar="SECONDS",
                   help="seconds to wait before each restart (default "
                        f"{DEFAULT_RESTART_DELAY:g})")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC on loopback instead of mutual TLS with a throwaway CA "
                        "(sets JAXDIST_INSECURE=1 in every task)")
    ray = p.add_argument_group("Ray (--backend ray: every task a Ray actor, on the nodes of a "
                               "Ray cluster)")
    ray.add_argument("--backend", choices=("local", "ray"), default="local",
                     help="where the tasks run: processes on this machine (default) or Ray "
                          "actors (pip install 'jaxdist[ray]')")
    ray.add_argument("--address", default=None, metavar="HOST:PORT",
                     help="the Ray cluster to join (default: start a local Ray and shut it "
                          "down at the end)")
    ray.add_argument("--cpus-per-task", type=positive_float, default=1.0, metavar="C",
                     help="Ray CPUs each task reserves (default 1)")
    ray.add_argument("--gpus-per-task", type=non_negative_float, default=0.0, metavar="G",
                     help="Ray GPUs each task reserves (default 0)")
    ray.add_argument("--placement", choices=PLACEMENT_STRATEGIES, default="SPREAD",
                     help="the placement group's strategy: SPREAD (default: over as many "
                          "nodes as possible), STRICT_SPREAD (one task per node), PACK")
    ray.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                     help="set NAME in every task (VALUE, else this process's value; "
                          "repeatable): a Ray task starts from its node's environment")
    ray.add_argument("--placement-timeout", type=non_negative_seconds, default=120.0,
                     metavar="SECONDS",
                     help="how long to wait for Ray to place every task (default 120)")
    ray.add_argument("--lost-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                     help="how long a task's actor may leave a call unanswered before the task "
                          "counts as lost (RayTaskLostError naming it; default 60)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return p


#: The placement-group strategies ``--placement`` accepts (Ray's names).
PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")


class Launcher:
    """Runs a command as every task of a local cluster (see the module docstring).

    Example:
        >>> from jaxdist.launch import Launcher
        >>> import sys
        >>> train_py = [sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'][:11])"]
        >>> code = Launcher(train_py, workers=2).run()
        [launch] started worker:0, worker:1 on {'worker': ['127.0.0.1:...', '127.0.0.1:...']}
        ...
        [launch] all training tasks finished
        >>> code
        0
    """

    def __init__(self, command: Sequence[str], workers: int = 1, ps: int = 0,
                 chief: bool = False, evaluator: bool = False,
                 devices_per_process: int | None = None, grace: float = 10.0,
                 evaluator_grace: float = 60.0, out=None, coordinator: bool = False,
                 insecure: bool = False, checkpoint_root: str | None = None,
                 ps_runs_command: bool = False, max_restarts: int = 0,
                 restart_delay: float = DEFAULT_RESTART_DELAY):
        if not command:
            raise ValueError("no command given: python -m jaxdist.launch ... -- COMMAND ...")
        self.command = list(command)
        self.coordinator = coordinator
        root = checkpoint_root or os.environ.get(CHECKPOINT_ROOT_ENV) or os.getcwd()
        self.checkpoint_root = os.path.abspath(root)
        # jaxdist.train's ps tasks restore the job's checkpoint at start; in coordinator mode
        # the chief restores (the servers only need the root).
        self.ps_runs_command = ps_runs_command or (
            not coordinator and serves_its_own_ps_tasks(self.command))
        self._counts = (workers, ps, chief or coordinator, evaluator)
        self.cluster = self._fresh_cluster()
        self.restarts = RestartBudget(max_restarts)
        if not restart_delay >= 0.0:
            raise ValueError(f"restart_delay must be seconds >= 0, got {restart_delay!r}")
        self.restart_delay = float(restart_delay)
        self.token = new_token()
        self.coordinator_token = new_coordinator_token()
        self.insecure = insecure
        self.pki: LocalPKI | None = None
        self.devices_per_process = devices_per_process
        self.grace = grace
        self.evaluator_grace = evaluator_grace
        self.out = out or sys.stdout
        # Reentrant: ``start`` holds it while it starts the tasks and prints the cluster, so
        # no task's output comes before the "started" line (the tasks' readers wait on it).
        self.lock = threading.RLock()
        self.tasks: dict[str, TaskProcess] = {}
        self._interrupted: int | None = None

    def _fresh_cluster(self) -> dict[str, list[str]]:
        """The cluster of a new run: free ports on this machine (another backend places the
        tasks elsewhere)."""
        return local_cluster(*self._counts)

    def _say(self, msg: str) -> None:
        with self.lock:
            self.out.write(f"[launch] {msg}\n")
            self.out.flush()

    def argv_for(self, job: str) -> list[str]:
        """What task ``job`` runs: a server (ps; a coordinator's workers) or the command.

        Example:
            >>> from jaxdist.launch import Launcher
            >>> Launcher(["python", "train.py"], workers=2, ps=1).argv_for("ps")[1:3]
            ['-m', 'jaxdist.server']
        """
        if job == "ps":
            return list(self.command) if self.ps_runs_command else server_command(
                "ps", self.checkpoint_root)
        if self.coordinator and job == "worker":
            return server_command(job, self.checkpoint_root)
        return list(self.command)

    def start(self) -> None:
        """Starts every task of ``self.cluster``."""
        if not self.insecure and self.pki is None:
            self.pki = local_pki([task_name(j, i) for j, i in task_list(self.cluster)])
        if "ps" in self.cluster:
            os.makedirs(self.checkpoint_root, exist_ok=True)
        with self.lock:
            for job, i in task_list(self.cluster):
                self._start_task(job, i)
            self._say(f"started {', '.join(self.tasks)} on {self.cluster}")
        if "ps" in self.cluster:
            self._say(f"ps tasks checkpoint under {self.checkpoint_root}")

    def _start_task(self, job: str, i: int) -> None:
        name = task_name(job, i)
        env = task_env(self.cluster, job, i, self.token, self.devices_per_process)
        apply_task_security(env, job, i, self.pki, self.coordinator_token)
        # Every task knows the ps tasks' checkpoint root (a program that serves its own
        # ps tasks, or checks where it may save, reads it here).
        env[CHECKPOINT_ROOT_ENV] = self.checkpoint_root
        self.tasks[name] = TaskProcess(name, self.argv_for(job), env, echo=self.out,
                                       echo_lock=self.lock)

    def stop_all(self, except_: Sequence[str] = ()) -> None:
        live = [t for n, t in self.tasks.items() if n not in except_ and t.running()]
        for t in live:
            t.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for t in live:
            if t.wait(max(0.0, deadline - time.monotonic())) is None:
                t.kill()
                t.wait(5.0)

    def _on_signal(self, signum, frame) -> None:
        self._interrupted = signum

    def run(self) -> int:
        """Starts the tasks and supervises them; returns the exit status."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            self.start()
            return self._supervise()
        finally:
            self.stop_all()
            if self.pki is not None:
                self.pki.cleanup()
            for s, h in old.items():
                signal.signal(s, h)

    def _finished(self, code: int | None) -> bool:
        """Whether a task's exit ``code`` means its training is done: 0, or, once the job was
        restarted, 3 (its checkpoint already completes the training: the run before the
        restart finished it, e.g. the chief wrote the last checkpoint and then a peer died)."""
        return code == 0 or (code == EXIT_ALREADY_DONE and self.restarts.used > 0)

    def _supervise(self) -> int:
        evaluators = [n for n in self.tasks if n.startswith("evaluator:")]
        done_at: float | None = None
        while True:
            if self._interrupted is not None:
                return self._stop_interrupted()
            for name, t in list(self.tasks.items()):
                code = t.returncode
                if code is None or self._finished(code):
                    continue
                if not self.restarts.take(code):
                    return self._fail(name, code)
                if not self._restart(name, code):
                    return self._stop_interrupted()
                done_at = None
                break
            if all(self._finished(self.tasks[n].returncode) for n in self._training()):
                if done_at is None:
                    done_at = time.monotonic()
                eval_running = [n for n in evaluators if self.tasks[n].running()]
                if not eval_running or time.monotonic() - done_at > self.evaluator_grace:
                    self.stop_all()
                    if any(self.tasks[n].returncode == EXIT_ALREADY_DONE
                           for n in self._training()):
                        self._say(f"the restarted job's checkpoint already completes its "
                                  f"training (exit {EXIT_ALREADY_DONE})")
                    self._say("all training tasks finished")
                    return 0
            time.sleep(0.1)

    def _training(self) -> list[str]:
        """The tasks whose exit 0 means the job is done (the chief alone under a coordinator:
        its workers serve the chief's functions until stopped)."""
        if self.coordinator:
            return [n for n in self.tasks if n.startswith("chief:")]
        return [n for n in self.tasks if n.split(":")[0] in ("chief", "worker")]

    def _stop_interrupted(self) -> int:
        """Stops every task (SIGTERM, then SIGKILL after ``grace``): 130 after Ctrl-C, 143
        after SIGTERM, or 42 when SIGTERM made every training task save and exit with the
        restart code (the job asks its scheduler to restart it)."""
        signum = int(self._interrupted or signal.SIGINT)
        self._say(f"interrupted (signal {signum}): stopping every task")
        self.stop_all()
        training = [self.tasks[n].returncode for n in self._training()]
        if signum == signal.SIGTERM and training and all(
                c == RESTART_EXIT_CODE for c in training):
            self._say(f"every training task saved and exited with {RESTART_EXIT_CODE} "
                      f"(preempted): exiting with {RESTART_EXIT_CODE}")
            return RESTART_EXIT_CODE
        return 128 + signum

    def _fail(self, name: str, code: int) -> int:
        why = ""
        if self.restarts.max_restarts and code != 0:
            why = (f" ({describe_exit(code)}; no restart left: {self.restarts.used} of "
                   f"{self.restarts.max_restarts} used)" if self.restarts.used
                   >= self.restarts.max_restarts else f" ({describe_exit(code)}: not restarted)")
        self._say(f"{name} failed with exit code {exit_status(code)}{why}; stopping the other "
                  f"tasks")
        self.stop_all(except_=[name])
        return exit_status(code)

    def _sleep(self, seconds: float) -> bool:
        """Waits ``seconds``; False when interrupted meanwhile."""
        deadline = time.monotonic() + seconds
        while self._interrupted is None and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._interrupted is None

    def _restart(self, name: str, code: int) -> bool:
        """Restarts after ``name`` exited with ``code`` (see ``restarts``); False when the
        launcher was interrupted meanwhile (nothing is restarted then)."""
        job, i = name.split(":")[0], int(name.split(":")[1])
        used, most = self.restarts.used, self.restarts.max_restarts
        head = (f"{name} exited with {exit_status(code)} ({describe_exit(code)}); "
                f"restart {used} of {most}")
        if restart_scope(job, self.coordinator) == "task":
            self._say(f"{head}: restarting {name} on {self.cluster[job][i]} in "
                      f"{self.restart_delay:g}s")
            if not self._sleep(self.restart_delay):
                return False
            self._start_task(job, i)
            return True
        live = [n for n, t in self.tasks.items() if n != name and t.running()]
        after = ""
        if live and code == RESTART_EXIT_CODE:
            after = (f" once {', '.join(live)} saved and exited (at most {self.grace:g}s, then "
                     f"stopped)")
        elif live:
            after = f" after stopping {', '.join(live)}"
        self._say(f"{head}: restarting every task ({', '.join(self.tasks)}) in "
                  f"{self.restart_delay:g}s{after}")
        if code == RESTART_EXIT_CODE:
            # Preempted: the others are saving the agreed checkpoint and exiting on their own.
            deadline = time.monotonic() + self.grace
            while any(self.tasks[n].running() for n in live) and time.monotonic() < deadline:
                if not self._sleep(0.1):
                    return False
        self.stop_all()
        if not self._sleep(self.restart_delay):
            return False
        # A fresh cluster: new ports (a new coordination service) and a new cluster token, so
        # no process of the previous run can join; the same TLS identities and credentials.
        self.cluster = self._fresh_cluster()
        self.token = new_token()
        self.tasks = {}
        self.start()
        return True


def command_after_dashes(parser: argparse.ArgumentParser, words: Sequence[str],
                         prog: str) -> list[str]:
    """The command after ``--`` (``parser.error``, which exits 2, naming ``prog``'s synopsis
    when there is none).

    Example:
        >>> from jaxdist._src.launch.launcher import _parser, command_after_dashes
        >>> command_after_dashes(_parser(), ["--", "python", "x.py"], "jaxdist.launch")
        ['python', 'x.py']
    """
    command = list(words)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error(f"no command given: python -m {prog} [options] -- COMMAND ...")
    return command


def parse_launch_args(argv: Sequence[str] | None = None
                      ) -> tuple[argparse.Namespace, list[str]]:
    """``python -m jaxdist.launch``'s options and command (``parser.error``, exit 2, on a bad
    one).

    Example:
        >>> from jaxdist._src.launch.launcher import parse_launch_args
        >>> args, command = parse_launch_args(["--workers", "2", "--", "python", "x.py"])
        >>> args.workers, args.backend, command
        (2, 'local', ['python', 'x.py'])
    """
    args = _parser().parse_args(argv)
    command = command_after_dashes(_parser(), args.command, "jaxdist.launch")
    if args.workers < 0 or args.ps < 0 or (args.workers == 0 and not args.chief):
        _parser().error("need --workers >= 1 (or --chief)")
    if args.backend == "local":
        defaults = _parser().parse_args([])
        given = [f"--{k.replace('_', '-')}" for k in _RAY_OPTIONS
                 if getattr(args, k) != getattr(defaults, k)]
        if given:
            _parser().error(f"{', '.join(given)} only apply to --backend ray")
    return args, command


#: The options of ``--backend ray`` alone.
_RAY_OPTIONS = ("address", "cpus_per_task", "gpus_per_task", "placement", "env",
                "placement_timeout", "lost_timeout")


def command_not_found(command: Sequence[str]) -> bool:
    """Says so (one line on stderr) when ``command[0]`` is not an executable file nor on PATH."""
    if shutil.which(command[0]) is not None:
        return False
    print(f"jaxdist.launch: command not found: {command[0]!r} (not an executable file, "
          f"nor on PATH); expected e.g. -- python -m jaxdist.train --config FILE",
          file=sys.stderr)
    return True


def launcher_options(args: argparse.Namespace) -> dict:
    """The ``Launcher`` keyword arguments of parsed options (every backend's)."""
    return dict(workers=args.workers, ps=args.ps, chief=args.chief, evaluator=args.evaluator,
                devices_per_process=args.devices_per_process, grace=args.grace,
                evaluator_grace=args.evaluator_grace, coordinator=args.coordinator,
                insecure=args.insecure, checkpoint_root=args.checkpoint_root,
                ps_runs_command=args.ps_runs_command, max_restarts=args.max_restarts,
                restart_delay=args.restart_delay)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of the local backend; returns the exit status."""
    args, command = parse_launch_args(argv)
    if command_not_found(command):  # one line, before any task starts
        return 127
    return Launcher(command, **launcher_options(args)).run()
