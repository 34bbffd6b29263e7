"""``PreemptionCheckpointHandler``: TF's preemption handling for a custom training loop.

``tf.distribute.experimental.PreemptionCheckpointHandler`` on jaxdist. The handler restores the
latest checkpoint when it is created (``total_run_calls`` included), and ``run(fn, *args)`` asks
this process's ``PreemptionWatcher`` (``jaxdist._src.distributed.preemption``) before each step
whether a preemption notice (SIGTERM, or ``TerminationConfig.termination_watcher_fn``) arrived
on any process. At the step every process agreed on (the next one none has started) the chief
saves the checkpoint, with ``total_run_calls`` recorded, the other processes wait for it, and
every process calls ``TerminationConfig.exit_fn`` (default: ``sys.exit(42)``, the restart code).

Differences from TF, each a consequence of jaxdist's agreement:

* TF's ``grace_period`` > 0 trains on through the grace period and saves a second time before
  it ends; jaxdist always saves at the first step no process started and exits: nothing is lost
  but the step in flight, and ``grace_period`` is the deadline for that (after it runs out the
  process exits at once with the restart code, without a new checkpoint).
* Processes other than the chief write nothing (TF writes their copy into a temporary
  ``workertemp_<id>`` directory and deletes it): jaxdist's state is replicated and the chief's
  copy is the checkpoint.
* An ``exit_fn`` that returns (it does not end the process) lets a single-process loop go on
  training after the checkpoint, as in TF, with a fresh watcher; in a multi-process job every
  process must exit, so the handler raises ``PreemptionError`` there.

Example:
    >>> import jaxdist
    >>> import jax.numpy as jnp
    >>> ckpt = jaxdist.Checkpoint(params={"w": jnp.zeros(2)})
    >>> handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, "run/ckpt")
    >>> for _ in range(handler.total_run_calls, 10):
    ...     ckpt.params = handler.run(lambda p: {"w": p["w"] + 1}, ckpt.params)
    >>> handler.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxdist._src.cluster import validation
from jaxdist._src.distributed import preemption
from jaxdist._src.distributed.preemption import PreemptionError
from jaxdist._src.distributed.termination import TerminationConfig
from jaxdist._src.train.tracked_checkpoint import Checkpoint, CheckpointError, CheckpointManager

log = logging.getLogger(__name__)

#: The ``Checkpoint`` attribute that holds ``total_run_calls`` at the save (TF's name).
ITERATION_ATTRIBUTE = "checkpointed_runs"


def _local_mode(cluster_resolver: Any) -> bool:
    """No cluster (``None`` or an empty cluster spec): one process, the chief."""
    if cluster_resolver is None:
        return True
    return not cluster_resolver.cluster_spec().jobs


class PreemptionCheckpointHandler:
    """Saves a checkpoint at the step every process agreed on and exits when any process is
    preempted (TF's ``PreemptionCheckpointHandler``, for custom loops).

    Args:
        cluster_resolver: the job's cluster resolver (``strategy.cluster_resolver``): it says
            which process is the chief; ``None`` (``MirroredStrategy``, ``OneDeviceStrategy``)
            or one with an empty cluster spec (a local ``MultiWorkerMirroredStrategy``) for
            one process.
        checkpoint_or_checkpoint_manager: a ``jaxdist.Checkpoint`` (the handler manages it in
            ``checkpoint_dir``, keeping one checkpoint) or a ``jaxdist.CheckpointManager``
            (your own, which you may also save with for backups).
        checkpoint_dir: where the handler saves and restores; required with a ``Checkpoint``.
        termination_config: a ``jaxdist.TerminationConfig`` (the watcher function, exit
            function, grace period, save function); default: SIGTERM is the notice, 30 s grace
            period, exit with 42.

    The latest checkpoint is restored here, so the objects hold their saved values and
    ``total_run_calls`` counts the steps run before the restart.

    Raises:
        CheckpointError: a ``Checkpoint`` without ``checkpoint_dir``, something that is neither
            a ``Checkpoint`` nor a ``CheckpointManager``, or a directory that is not writable.
        NotImplementedError: a cluster with parameter servers (``ParameterServerStrategy``
            saves through its coordinator).

    Example:
        >>> import jaxdist
        >>> import jax.numpy as jnp
        >>> ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
        >>> handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, "preempt_ckpt")
        >>> while handler.total_run_calls < 3:
        ...     ckpt.w = handler.run(lambda w: w + 1, ckpt.w)
        >>> ckpt.w.tolist(), handler.total_run_calls
        ([3.0, 3.0], 3)
        >>> handler.close()
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Any,
                 checkpoint_dir: str | os.PathLike | None = None,
                 termination_config: TerminationConfig | None = None):
        if termination_config is not None and not isinstance(termination_config,
                                                             TerminationConfig):
            raise TypeError(
                f"termination_config={termination_config!r}: expected a "
                f"jaxdist.TerminationConfig or None")
        if cluster_resolver is not None and "ps" in cluster_resolver.cluster_spec().as_dict():
            raise NotImplementedError(
                "PreemptionCheckpointHandler does not support a cluster with parameter servers "
                "(ParameterServerStrategy): its checkpoints are saved by the coordinator")
        self._cluster_resolver = cluster_resolver
        if _local_mode(cluster_resolver):
            self._is_chief = True
            self._id_in_cluster = "single_worker"
        else:
            spec = cluster_resolver.cluster_spec()
            task_type, task_id = cluster_resolver.task_type, cluster_resolver.task_id
            self._is_chief = validation.is_chief(spec, task_type, task_id)
            self._id_in_cluster = str(validation.id_in_cluster(spec, task_type, task_id))
        self._manager = self._make_manager(checkpoint_or_checkpoint_manager, checkpoint_dir)
        checkpoint = self._manager.checkpoint
        if ITERATION_ATTRIBUTE not in checkpoint.tracked():
            setattr(checkpoint, ITERATION_ATTRIBUTE, 0)
        self._manager.restore_or_initialize()
        self._run_counter = int(getattr(checkpoint, ITERATION_ATTRIBUTE))
        self._config = termination_config or TerminationConfig()
        self._consuming = contextlib.ExitStack()
        self._watch()
        log.info("PreemptionCheckpointHandler initialized or restored: total_run_calls=%d",
                 self._run_counter)

    def _make_manager(self, value: Any, checkpoint_dir: Any) -> CheckpointManager:
        if isinstance(value, CheckpointManager):
            return value
        if isinstance(value, Checkpoint):
            if not checkpoint_dir:
                raise CheckpointError(
                    "When a checkpoint is passed, a checkpoint_dir must be passed as well "
                    "(PreemptionCheckpointHandler(resolver, checkpoint, checkpoint_dir=...))")
            return CheckpointManager(value, checkpoint_dir, max_to_keep=1)
        raise CheckpointError(
            f"checkpoint_or_checkpoint_manager={type(value).__name__}: expected a "
            f"jaxdist.Checkpoint or a jaxdist.CheckpointManager")

    def _watch(self) -> None:
        """Installs (or joins) the process's watcher and answers its notices from now on: a
        SIGTERM between two ``run`` calls is a notice too, handled at the next one."""
        self._watcher = preemption.install(self._config)
        self._consuming.enter_context(self._watcher.consume())

    @property
    def total_run_calls(self) -> int:
        """The number of ``run`` (or ``save_checkpoint_if_preempted``) calls, including those
        before the restart (restored from the checkpoint)."""
        return self._run_counter

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The ``CheckpointManager`` the handler saves with."""
        return self._manager

    def run(self, distributed_train_function: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        """Runs one training step, ``distributed_train_function(*args, **kwargs)``, unless the
        processes agreed to stop before it: then the chief saves the checkpoint (the others
        wait) and every process exits as ``TerminationConfig`` says.

        Pass a single-step function (it contains ``strategy.run``): the processes agree on a
        step boundary, so a shorter step means a checkpoint sooner after the notice.

        Returns:
            what ``distributed_train_function`` returns.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
            >>> handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, "run_ckpt")
            >>> ckpt.w = handler.run(lambda w: w + 1, ckpt.w)
            >>> handler.total_run_calls
            1
            >>> handler.close()
        """
        self._check_preemption_and_maybe_checkpoint()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Saves and exits if the processes agreed to stop here; counts one step otherwise.

        The alternative to ``run``: call it before each step (the step itself is not passed).

        Args:
            *args: passed to ``CheckpointManager.save`` (e.g. ``checkpoint_number=``).
            **kwargs: passed to ``CheckpointManager.save``.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
            >>> handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, "save_ckpt")
            >>> handler.save_checkpoint_if_preempted()
            >>> ckpt.w = ckpt.w + 1
            >>> handler.total_run_calls
            1
            >>> handler.close()
        """
        self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._run_counter += 1

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A scope for the training loop (TF's, for ``TPUStrategy``); with jaxdist the handler
        answers notices from its creation on, so the scope only marks the loop.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
            >>> handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, "scope_ckpt")
            >>> with handler.watch_preemption_scope():
            ...     ckpt.w = handler.run(lambda w: w * 2, ckpt.w)
            >>> handler.close()
        """
        with self._watcher.consume():
            yield

    # ------------------------------------------------------------------ the preemption
    def _check_preemption_and_maybe_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        step = self._run_counter
        if not self._watcher.should_stop(step):
            return
        checkpoint = self._manager.checkpoint

        def save() -> None:
            setattr(checkpoint, ITERATION_ATTRIBUTE, step)
            path = self._manager.save(*args, **kwargs)
            log.info("PreemptionCheckpointHandler: checkpoint of step %d saved at %s", step,
                     path)

        setattr(checkpoint, ITERATION_ATTRIBUTE, step)
        watcher = self._watcher
        self._consuming.close()
        try:
            watcher.finish(step, save, is_chief=self._is_chief,
                           what="preemption checkpoint")
        finally:
            # The notice is answered (the process exits, or exit_fn returned): this watcher is
            # done; a process that goes on gets a fresh one below.
            preemption.uninstall()
        if jax.process_count() > 1:
            raise PreemptionError(
                f"TerminationConfig.exit_fn returned after the preemption checkpoint of step "
                f"{step} on worker {self._id_in_cluster}: in a multi-process job every process "
                f"must exit (sys.exit) so the job restarts and its processes agree anew")
        self._watch()

    def close(self) -> None:
        """Stops answering notices (SIGTERM ends the process as by default again unless another
        loop answers them)."""
        self._consuming.close()

    def __repr__(self) -> str:
        return (f"PreemptionCheckpointHandler(total_run_calls={self._run_counter}, "
                f"directory={self._manager.directory!r}, chief={self._is_chief})")


__all__ = ["ITERATION_ATTRIBUTE", "PreemptionCheckpointHandler"]
