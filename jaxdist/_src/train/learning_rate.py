"""The learning rate: the schedule a job config names, and the rate inside an optax state (read
it for the logs, change it between steps).

``schedule_from_config`` builds the optax schedule of a config's ``optimizer`` section for the
synchronous strategies (``schedule_args`` names the optax constructor and its arguments; the
parameter-server job turns the same pair into a spec its ps tasks rebuild).

An optimizer built with ``optax.inject_hyperparams`` keeps its hyperparameters in its state
(``InjectStatefulHyperparamsState.hyperparams``), as arrays. Changing the array's value changes
the rate of the next update without recompiling the step (same shape, same dtype, same
sharding). Job configs build every optimizer this way; wrap your own as
``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdist._src.train.learning_rate import get_learning_rate, set_learning_rate
    >>> import optax
    >>> params = {"w": jnp.zeros(3)}
    >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    >>> state = tx.init(params)
    >>> round(float(get_learning_rate(state)), 6)
    0.1
    >>> state = set_learning_rate(state, 0.01)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

HOW_TO_INJECT = ("build the optimizer with optax.inject_hyperparams, e.g. "
                 "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)")


def _is_injected(node: Any) -> bool:
    hp = getattr(node, "hyperparams", None)
    return isinstance(hp, dict) and "learning_rate" in hp


def _injected_states(opt_state: Any) -> list[Any]:
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_injected)
    return [s for s in leaves if _is_injected(s)]


def has_learning_rate(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds an injected ``learning_rate``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.learning_rate import has_learning_rate
        >>> import optax
        >>> params = {"w": jnp.zeros(3)}
        >>> has_learning_rate(optax.adam(1e-3).init(params))
        False
    """
    return bool(_injected_states(opt_state))


def is_scheduled(opt_state: Any) -> bool:
    """Whether the injected learning rate follows a schedule (recomputed every update).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.learning_rate import is_scheduled
        >>> import optax
        >>> params = {"w": jnp.zeros(3)}
        >>> is_scheduled(optax.inject_hyperparams(optax.sgd)(
        ...     learning_rate=optax.cosine_decay_schedule(0.1, 100)).init(params))
        True
    """
    return any("learning_rate" in (getattr(s, "hyperparams_states", None) or {})
               for s in _injected_states(opt_state))


def get_learning_rate(opt_state: Any) -> float | None:
    """The learning rate of the last update (or the initial one); ``None`` if not injected.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.learning_rate import get_learning_rate
        >>> import optax
        >>> p = {"w": jnp.zeros(3)}
        >>> get_learning_rate(optax.inject_hyperparams(optax.sgd)(learning_rate=0.5).init(p))
        0.5
    """
    states = _injected_states(opt_state)
    if not states:
        return None
    return float(np.asarray(jax.device_get(states[0].hyperparams["learning_rate"])))


def set_learning_rate(opt_state: Any, value: float) -> Any:
    """A copy of ``opt_state`` whose injected learning rate is ``value``.

    The new array keeps the old one's dtype and sharding, so the compiled step is reused.

    Raises:
        ValueError: the state has no injected learning rate, or it follows a schedule (which
            would overwrite the value at the next update).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.learning_rate import set_learning_rate
        >>> import optax
        >>> state = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).init(jnp.zeros(3))
        >>> state = set_learning_rate(state, 1e-4)
    """
    if not has_learning_rate(opt_state):
        raise ValueError(f"the optimizer's learning rate cannot be changed at run time; "
                         f"{HOW_TO_INJECT}")
    if is_scheduled(opt_state):
        raise ValueError("the optimizer's learning rate follows a schedule, which sets it at "
                         "every update; use a constant learning rate (optimizer.schedule: "
                         "constant) to change it at run time, e.g. with ReduceLROnPlateau")

    def replace(node: Any) -> Any:
        if not _is_injected(node):
            return node
        old = node.hyperparams["learning_rate"]
        new = np.asarray(value, dtype=np.asarray(jax.device_get(old)).dtype)
        sharding = getattr(old, "sharding", None)
        new = jax.device_put(new, sharding) if sharding is not None else new
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": new})

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_injected)


def with_hyperparams_of(opt_state: Any, fresh: Any) -> Any:
    """``opt_state`` (e.g. restored from a checkpoint) with the injected hyperparameters
    (learning rate, weight decay, ...) of ``fresh`` (the state of the optimizer as now
    configured); its moments and update count are kept. States without injected
    hyperparameters, or of another structure, come back unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.learning_rate import get_learning_rate, with_hyperparams_of
        >>> import optax
        >>> old = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).init(jnp.zeros(3))
        >>> new = optax.inject_hyperparams(optax.adam)(learning_rate=0.1).init(jnp.zeros(3))
        >>> round(get_learning_rate(with_hyperparams_of(old, new)), 6)
        0.1
    """
    fresh_states = iter(_injected_states(fresh))
    if len(_injected_states(opt_state)) != len(_injected_states(fresh)):
        return opt_state

    def replace(node: Any) -> Any:
        if not _is_injected(node):
            return node
        return node._replace(hyperparams=dict(next(fresh_states).hyperparams))

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_injected)


#: The job config's ``optimizer.schedule`` values.
SCHEDULE_KINDS = ("constant", "cosine", "warmup_cosine", "exponential", "linear")


def schedule_args(section: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The schedule a validated ``optimizer`` section names: ``(optax constructor name,
    keyword arguments)``, or ``None`` for a constant rate.

    Raises:
        ValueError: an unknown ``schedule`` (naming the valid ones).

    Example:
        >>> from jaxdist._src.train.learning_rate import schedule_args
        >>> schedule_args({"learning_rate": 0.1, "schedule": "linear", "decay_steps": 10,
        ...                "end_learning_rate": 0.0})
        ('linear_schedule', {'init_value': 0.1, 'end_value': 0.0, 'transition_steps': 10})
    """
    lr, kind = section["learning_rate"], section.get("schedule", "constant")
    end, steps = section.get("end_learning_rate", 0.0), section.get("decay_steps")
    if kind == "constant":
        return None
    if kind == "cosine":
        return "cosine_decay_schedule", dict(init_value=lr, decay_steps=steps,
                                             alpha=end / lr if lr else 0.0)
    if kind == "warmup_cosine":
        return "warmup_cosine_decay_schedule", dict(
            init_value=0.0, peak_value=lr, warmup_steps=section.get("warmup_steps", 0),
            decay_steps=steps, end_value=end)
    if kind == "exponential":
        return "exponential_decay", dict(init_value=lr, transition_steps=steps,
                                         decay_rate=section.get("decay_rate", 0.5))
    if kind == "linear":
        return "linear_schedule", dict(init_value=lr, end_value=end, transition_steps=steps)
    raise ValueError(f"optimizer.schedule: {kind!r} is not valid; expected one of "
                     f"{', '.join(SCHEDULE_KINDS)}")


def schedule_from_config(section: Mapping[str, Any]) -> float | Any:
    """The learning rate of a validated ``optimizer`` section: the constant rate, or the optax
    schedule over the update count.

    Example:
        >>> from jaxdist._src.train.learning_rate import schedule_from_config
        >>> lr = schedule_from_config({"learning_rate": 0.1, "schedule": "cosine",
        ...                            "decay_steps": 100, "end_learning_rate": 0.0})
        >>> round(float(lr(50)), 6)
        0.05
    """
    import optax

    args = schedule_args(section)
    if args is None:
        return section["learning_rate"]
    name, kwargs = args
    return getattr(optax, name)(**kwargs)


__all__ = ["HOW_TO_INJECT", "SCHEDULE_KINDS", "get_learning_rate", "has_learning_rate",
           "is_scheduled", "schedule_args", "schedule_from_config", "set_learning_rate",
           "with_hyperparams_of"]
