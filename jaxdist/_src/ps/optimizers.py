"""Optimizers a parameter server runs, as JSON specs it rebuilds without pickle (``from jaxdist.ps
import optimizers``; an attribute of ``jaxdist.ps``).

A ps applies the optax update to the shards it holds, each shard on its own. That is exact only
for transforms that act element by element (every output element depends on the same element
of the gradient, parameter and state): ``sgd``, ``momentum``, ``adam``, ``adamw``, ``adagrad``,
``rmsprop``, ``clip`` (per-element clipping). A transform that needs the whole gradient
(``clip_by_global_norm``) must run on the worker, before the push; it is allowed only at the
front of a ``chain``. Anything else (per-layer trust ratios such as LAMB/LARS, an optax object
the ps cannot rebuild) is rejected with ``ValueError``.

Specs travel as JSON (name + hyper-parameters) and are rebuilt into optax transforms on the ps.
A learning rate may be a schedule spec (``cosine_decay_schedule``, ``warmup_cosine_decay_schedule``,
``exponential_decay``, ``linear_schedule``, ``piecewise_constant_schedule``, ...): the ps evaluates
it on the update count of each shard's optimizer state, which is the global step of
between-graph training (every worker step pushes to every shard once), as TF's ``global_step``.

Example:
    >>> import jaxdist.ps
    >>> opt = jaxdist.ps.optimizers.chain(
    ...     jaxdist.ps.optimizers.clip_by_global_norm(1.0),   # worker side
    ...     jaxdist.ps.optimizers.adam(1e-3))                  # ps side, per shard
    >>> opt.worker_part().name, opt.ps_part().name
    ('clip_by_global_norm', 'adam')
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optax

# name -> (optax constructor, runs element by element on a ps shard)
_ELEMENTWISE: dict[str, Callable[..., optax.GradientTransformation]] = {
    "sgd": optax.sgd,
    "momentum": lambda learning_rate, momentum=0.9, nesterov=False: optax.sgd(
        learning_rate, momentum=momentum, nesterov=nesterov
    ),
    "adam": optax.adam,
    "adamw": optax.adamw,
    "adagrad": optax.adagrad,
    "rmsprop": optax.rmsprop,
    "clip": optax.clip,
}
_WORKER_SIDE: dict[str, Callable[..., optax.GradientTransformation]] = {
    "clip_by_global_norm": optax.clip_by_global_norm,
}
_SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "constant_schedule": optax.constant_schedule,
    "cosine_decay_schedule": optax.cosine_decay_schedule,
    "exponential_decay": optax.exponential_decay,
    "linear_schedule": optax.linear_schedule,
    "piecewise_constant_schedule": optax.piecewise_constant_schedule,
    "polynomial_schedule": optax.polynomial_schedule,
    "warmup_cosine_decay_schedule": optax.warmup_cosine_decay_schedule,
    "warmup_exponential_decay_schedule": optax.warmup_exponential_decay_schedule,
}


@dataclass(frozen=True)
class ScheduleSpec:
    """A JSON-describable optax schedule (``name`` with keyword ``kwargs``).

    Pass one as a learning rate: ``adam(cosine_decay_schedule(1e-3, decay_steps=1000))``. It is
    also callable, ``spec(step)``, like the optax schedule it builds.

    Attributes:
        name: an optax schedule constructor name, e.g. ``"cosine_decay_schedule"``.
        kwargs: its arguments (numbers, bools; ``boundaries_and_scales`` as ``[[step, scale]]``).
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in _SCHEDULES:
            raise ValueError(f"schedule {self.name!r} is not one a ps can rebuild: expected one "
                             f"of {sorted(_SCHEDULES)}")
        try:
            json.dumps(self.kwargs)
            self.build()
        except (TypeError, ValueError) as e:
            raise ValueError(f"schedule {self.name!r} cannot be built from {self.kwargs!r}: "
                             f"{e}") from None

    def build(self) -> optax.Schedule:
        """The optax schedule this spec describes."""
        kwargs = dict(self.kwargs)
        if "boundaries_and_scales" in kwargs and kwargs["boundaries_and_scales"] is not None:
            kwargs["boundaries_and_scales"] = {int(b): float(v)
                                               for b, v in kwargs["boundaries_and_scales"]}
        return _SCHEDULES[self.name](**kwargs)

    def __call__(self, step: Any) -> Any:
        return self.build()(step)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable description (``from_json`` inverts it)."""
        return {"schedule": self.name, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScheduleSpec:
        if not isinstance(data, dict) or "schedule" not in data:
            raise ValueError(f"expected a schedule description with a 'schedule', got {data!r}")
        return cls(data["schedule"], dict(data.get("kwargs", {})))


@dataclass(frozen=True)
class OptimizerSpec:
    """A JSON-describable optax transform: ``name`` with keyword ``kwargs`` (or a chain).

    Attributes:
        name: an optax constructor name (``"adam"``, ...) or ``"chain"``.
        kwargs: its hyper-parameters (numbers, bools, strings).
        parts: the chained specs when ``name == "chain"``.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    parts: tuple[OptimizerSpec, ...] = ()

    def __post_init__(self):
        if self.name == "chain":
            for p in self.parts:
                if not isinstance(p, OptimizerSpec):
                    raise TypeError(
                        f"chain parts must be jaxdist.ps.optimizers specs, got {p!r}"
                    )
            return
        if self.name not in _ELEMENTWISE and self.name not in _WORKER_SIDE:
            raise ValueError(
                f"optimizer {self.name!r} cannot run on a parameter server: expected one of "
                f"{sorted(_ELEMENTWISE)} (elementwise, applied per shard on the ps) or "
                f"{sorted(_WORKER_SIDE)} (whole-gradient, applied on the worker)"
            )
        for k, v in self.kwargs.items():
            if callable(v) and not isinstance(v, ScheduleSpec):
                raise ValueError(
                    f"{self.name}: {k}={v!r} is a function the ps cannot rebuild without pickle; "
                    f"use a schedule spec such as jaxdist.ps.optimizers.cosine_decay_schedule("
                    f"...) (one of {sorted(_SCHEDULES)})"
                )
        try:
            json.dumps(self._json_kwargs())
        except TypeError:
            raise ValueError(
                f"hyper-parameters of {self.name!r} must be JSON numbers/strings/bools or "
                f"schedule specs (no arrays), got {self.kwargs!r}"
            ) from None

    def _json_kwargs(self) -> dict[str, Any]:
        return {k: v.to_json() if isinstance(v, ScheduleSpec) else v
                for k, v in self.kwargs.items()}

    # ------------------------------------------------------------------ classification
    @property
    def elementwise(self) -> bool:
        """True when the whole transform can run per shard on a ps."""
        if self.name == "chain":
            return all(p.elementwise for p in self.parts)
        return self.name in _ELEMENTWISE

    def _flat(self) -> list[OptimizerSpec]:
        if self.name != "chain":
            return [self]
        out: list[OptimizerSpec] = []
        for p in self.parts:
            out.extend(p._flat())
        return out

    def split(self) -> tuple[OptimizerSpec | None, OptimizerSpec | None]:
        """Splits into ``(worker_part, ps_part)``; either may be ``None``.

        Raises:
            ValueError: a whole-gradient transform comes after an elementwise one (it would
                need the full update, which is spread over the ps tasks).
        """
        flat = self._flat()
        worker: list[OptimizerSpec] = []
        ps: list[OptimizerSpec] = []
        for p in flat:
            if p.name in _WORKER_SIDE:
                if ps:
                    raise ValueError(
                        f"{p.name!r} follows {ps[-1].name!r} in the chain: a transform that "
                        f"needs the whole gradient can run only on the worker, before every "
                        f"elementwise (ps-side) transform; move it to the front of the chain"
                    )
                worker.append(p)
            else:
                ps.append(p)
        return _join(worker), _join(ps)

    def worker_part(self) -> OptimizerSpec | None:
        """The transforms that run on the worker before the push (``None``: none)."""
        return self.split()[0]

    def ps_part(self) -> OptimizerSpec | None:
        """The elementwise transforms each ps applies to its shards (``None``: none)."""
        return self.split()[1]

    # ------------------------------------------------------------------ build / serialize
    def build(self) -> optax.GradientTransformation:
        """The optax transform this spec describes."""
        if self.name == "chain":
            return optax.chain(*(p.build() for p in self.parts))
        ctor = _ELEMENTWISE.get(self.name) or _WORKER_SIDE[self.name]
        return ctor(**{k: v.build() if isinstance(v, ScheduleSpec) else v
                       for k, v in self.kwargs.items()})

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable description (``from_json`` inverts it)."""
        if self.name == "chain":
            return {"name": "chain", "parts": [p.to_json() for p in self.parts]}
        return {"name": self.name, "kwargs": self._json_kwargs()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OptimizerSpec:
        if not isinstance(data, dict) or "name" not in data:
            raise ValueError(f"expected an optimizer description with a 'name', got {data!r}")
        if data["name"] == "chain":
            return cls("chain", {}, tuple(cls.from_json(p) for p in data.get("parts", [])))
        kwargs = {k: ScheduleSpec.from_json(v) if isinstance(v, dict) and "schedule" in v else v
                  for k, v in dict(data.get("kwargs", {})).items()}
        return cls(data["name"], kwargs)

    def key(self) -> str:
        """A canonical string (equal specs give equal keys)."""
        return json.dumps(self.to_json(), sort_keys=True)


def _join(parts: list[OptimizerSpec]) -> OptimizerSpec | None:
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return OptimizerSpec("chain", {}, tuple(parts))


def as_spec(optimizer: Any) -> OptimizerSpec | None:
    """Checks ``optimizer`` is something a ps can run; returns it as a spec.

    Args:
        optimizer: an ``OptimizerSpec``, its JSON dict, or ``None`` (no update on the ps).

    Raises:
        ValueError: ``optimizer`` is an optax object (the ps cannot rebuild an arbitrary
            closure) or another unsupported value.
    """
    if optimizer is None or isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, dict):
        return OptimizerSpec.from_json(optimizer)
    if isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            "a raw optax GradientTransformation cannot be split across parameter servers (the "
            "ps cannot tell whether it is elementwise, nor rebuild it without pickle); use "
            "jaxdist.ps.optimizers.sgd / momentum / adam / adamw / adagrad / rmsprop / clip, and "
            "clip_by_global_norm at the front of jaxdist.ps.optimizers.chain(...)"
        )
    raise TypeError(f"expected a jaxdist.ps.optimizers spec, got {type(optimizer).__name__}")


def sgd(learning_rate: float | ScheduleSpec, momentum: float | None = None, nesterov: bool = False):
    """``optax.sgd`` on the ps. Example: ``sgd(0.1)``."""
    return OptimizerSpec("sgd", _drop_none(learning_rate=learning_rate, momentum=momentum,
                                           nesterov=nesterov))


def momentum(learning_rate: float | ScheduleSpec, momentum: float = 0.9, nesterov: bool = False):
    """SGD with momentum on the ps (TF's ``MomentumOptimizer``). Example: ``momentum(0.1)``."""
    return OptimizerSpec("momentum", dict(learning_rate=learning_rate, momentum=momentum,
                                          nesterov=nesterov))


def adam(learning_rate: float | ScheduleSpec, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8):
    """``optax.adam`` on the ps. Example: ``adam(1e-3)``."""
    return OptimizerSpec("adam", dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps))


def adamw(learning_rate: float | ScheduleSpec, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 1e-4):
    """``optax.adamw`` on the ps. Example: ``adamw(1e-3, weight_decay=1e-4)``."""
    return OptimizerSpec("adamw", dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                       weight_decay=weight_decay))


def adagrad(learning_rate: float | ScheduleSpec, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7):
    """``optax.adagrad`` on the ps. Example: ``adagrad(0.1)``."""
    return OptimizerSpec("adagrad", dict(learning_rate=learning_rate,
                                         initial_accumulator_value=initial_accumulator_value,
                                         eps=eps))


def rmsprop(learning_rate: float | ScheduleSpec, decay: float = 0.9, eps: float = 1e-8,
            momentum: float | None = None):
    """``optax.rmsprop`` on the ps. Example: ``rmsprop(1e-3)``."""
    return OptimizerSpec("rmsprop", _drop_none(learning_rate=learning_rate, decay=decay, eps=eps,
                                               momentum=momentum))


def clip(max_delta: float):
    """Per-element clipping (elementwise; runs on the ps). Example: ``clip(1.0)``."""
    return OptimizerSpec("clip", dict(max_delta=max_delta))


def clip_by_global_norm(max_norm: float):
    """Global-norm clipping: needs the whole gradient, so it runs on the worker before the push.

    Example:
        >>> from jaxdist.ps import optimizers
        >>> opt = optimizers.chain(optimizers.clip_by_global_norm(1.0), optimizers.adam(1e-3))
    """
    return OptimizerSpec("clip_by_global_norm", dict(max_norm=max_norm))


def chain(*specs: OptimizerSpec) -> OptimizerSpec:
    """``optax.chain`` of specs; whole-gradient transforms must come first.

    Example:
        >>> from jaxdist.ps import optimizers
        >>> opt = optimizers.chain(optimizers.clip_by_global_norm(1.0), optimizers.sgd(0.1))
    """
    spec = OptimizerSpec("chain", {}, tuple(specs))
    spec.split()  # validates the order now
    return spec


# ---------------------------------------------------------------------- schedules
def constant_schedule(value: float) -> ScheduleSpec:
    """``optax.constant_schedule``. Example: ``sgd(constant_schedule(0.1))``."""
    return ScheduleSpec("constant_schedule", dict(value=value))


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> ScheduleSpec:
    """``optax.cosine_decay_schedule``: from ``init_value`` to ``alpha * init_value``.

    Example:
        >>> from jaxdist.ps import optimizers
        >>> opt = optimizers.adam(optimizers.cosine_decay_schedule(1e-3, decay_steps=10_000))
    """
    return ScheduleSpec("cosine_decay_schedule", dict(
        init_value=init_value, decay_steps=decay_steps, alpha=alpha, exponent=exponent))


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> ScheduleSpec:
    """``optax.warmup_cosine_decay_schedule`` (``decay_steps`` includes the warm-up).

    Example:
        >>> from jaxdist.ps import optimizers
        >>> schedule = optimizers.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=100,
        ...                                                     decay_steps=1000)
        >>> opt = optimizers.adamw(schedule)
    """
    return ScheduleSpec("warmup_cosine_decay_schedule", dict(
        init_value=init_value, peak_value=peak_value, warmup_steps=warmup_steps,
        decay_steps=decay_steps, end_value=end_value, exponent=exponent))


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> ScheduleSpec:
    """``optax.exponential_decay`` (TF's ``tf.compat.v1.train.exponential_decay``).

    Example:
        >>> from jaxdist.ps import optimizers
        >>> schedule = optimizers.exponential_decay(0.1, transition_steps=1000, decay_rate=0.96,
        ...                                         staircase=True)
        >>> opt = optimizers.sgd(schedule)
    """
    return ScheduleSpec("exponential_decay", _drop_none(
        init_value=init_value, transition_steps=transition_steps, decay_rate=decay_rate,
        transition_begin=transition_begin, staircase=staircase, end_value=end_value))


def warmup_exponential_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                      transition_steps: int, decay_rate: float,
                                      transition_begin: int = 0, staircase: bool = False,
                                      end_value: float | None = None) -> ScheduleSpec:
    """``optax.warmup_exponential_decay_schedule``.

    Example:
        >>> from jaxdist.ps import optimizers
        >>> schedule = optimizers.warmup_exponential_decay_schedule(0.0, 1e-3, 100, 1000, 0.5)
        >>> opt = optimizers.adam(schedule)
    """
    return ScheduleSpec("warmup_exponential_decay_schedule", _drop_none(
        init_value=init_value, peak_value=peak_value, warmup_steps=warmup_steps,
        transition_steps=transition_steps, decay_rate=decay_rate,
        transition_begin=transition_begin, staircase=staircase, end_value=end_value))


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> ScheduleSpec:
    """``optax.linear_schedule``. Example: ``sgd(linear_schedule(0.1, 0.0, 1000))``."""
    return ScheduleSpec("linear_schedule", dict(
        init_value=init_value, end_value=end_value, transition_steps=transition_steps,
        transition_begin=transition_begin))


def polynomial_schedule(init_value: float, end_value: float, power: float,
                        transition_steps: int, transition_begin: int = 0) -> ScheduleSpec:
    """``optax.polynomial_schedule``. Example: ``sgd(polynomial_schedule(0.1, 0.0, 2, 1000))``."""
    return ScheduleSpec("polynomial_schedule", dict(
        init_value=init_value, end_value=end_value, power=power,
        transition_steps=transition_steps, transition_begin=transition_begin))


def piecewise_constant_schedule(init_value: float,
                                boundaries_and_scales: dict[int, float] | None = None
                                ) -> ScheduleSpec:
    """``optax.piecewise_constant_schedule`` (TF's ``piecewise_constant`` with scales).

    Example:
        >>> from jaxdist.ps import optimizers
        >>> schedule = optimizers.piecewise_constant_schedule(0.1, {3000: 0.1, 6000: 0.1})
        >>> opt = optimizers.momentum(schedule)
    """
    pairs = None
    if boundaries_and_scales is not None:
        pairs = [[int(b), float(v)] for b, v in sorted(boundaries_and_scales.items())]
    return ScheduleSpec("piecewise_constant_schedule", dict(
        init_value=init_value, boundaries_and_scales=pairs))


def _drop_none(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


#: Names of the optimizers that act element by element (they run on the ps, shard by shard).
ELEMENTWISE = tuple(sorted(_ELEMENTWISE))
#: Names of the transforms that need the whole gradient and so run on the worker before the push.
WORKER_SIDE = tuple(sorted(_WORKER_SIDE))
#: Names of the learning-rate schedules a spec may use.
SCHEDULES = tuple(sorted(_SCHEDULES))

__all__ = [
    "ELEMENTWISE",
    "OptimizerSpec",
    "SCHEDULES",
    "ScheduleSpec",
    "WORKER_SIDE",
    "adagrad",
    "adam",
    "adamw",
    "as_spec",
    "chain",
    "clip",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "linear_schedule",
    "momentum",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "rmsprop",
    "sgd",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]
