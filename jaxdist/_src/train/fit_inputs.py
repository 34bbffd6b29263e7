"""What the Trainer feeds its devices: the host batches of ``fit``, ``evaluate`` and
``predict``, in the order the distributed dataset splits them, checked against the model.

``InputFeed`` is a mixin of ``Trainer``: this process's rows of every global batch
(``_local_rows``), chunks of ``steps_per_execution`` steps and input blocks of several chunks
(one host-to-device transfer for several dispatches, ``_input_block``), a stream's batches with
their positions, padded evaluation batches, and the shape and label checks done before any
work starts.

Example:
    >>> from jaxdist._src.train.fit_inputs import InputFeed
    >>> class Trainer(InputFeed): ...
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.input.options import InputOptions
from jaxdist._src.train import data as data_lib
from jaxdist._src.train import inputs as inputs_lib

# Input blocks (``InputFeed._input_block``): one host-to-device transfer feeds up to this many
# steps, of at most this many bytes (this process's rows).
BLOCK_STEPS = 32
BLOCK_BYTES = 16 << 20


class InputFeed:
    """Mixin of ``Trainer``: its host batches and input blocks, and the checks of its data.

    Example:
        >>> trainer._local_rows(x, num_steps=1)   # this process's replicas' rows  # doctest: +SKIP
    """

    def _check_shapes(self, d: data_lib.ArrayData, what: str) -> None:
        b = self.global_batch_size
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *a.shape[1:]), a.dtype), d.x)
        shapes = jax.tree.map(lambda a: tuple(a.shape[1:]), d.x)
        try:
            out = jax.eval_shape(
                lambda p, r, x: self._apply(p, r, x), self.params, self.rest, example
            )
        except Exception as e:  # noqa: BLE001 - any shape error becomes one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise data_lib.DataError(
                f"{what}: the model cannot take examples of shape {shapes}: {first}"
            ) from None
        data_lib.check_labels(d.y, out, self.loss_fn, what)
        if self.accuracy and d.y.ndim == 1 and getattr(out, "ndim", 0) == 2:
            bad = (d.y < 0) | (d.y >= out.shape[-1])
            if np.issubdtype(d.y.dtype, np.integer) and bad.any():
                raise data_lib.DataError(
                    f"{what}: label {d.y[bad][0]} is out of range for a model with "
                    f"{out.shape[-1]} outputs; expected labels in [0, {out.shape[-1]})"
                )

    def _example(self, d: Any) -> data_lib.ArrayData:
        """Data to check against the model: array data itself, a stream's first element."""
        if isinstance(d, data_lib.ArrayData):
            return d
        x, y, _ = d.peek()
        if y is None:
            raise data_lib.DataError(f"{d.what}: the {d.name}'s elements have no labels; "
                                     f"expected (x, y) batches or dicts with 'x' and 'y'")
        return data_lib.ArrayData(x, y)

    def _stream_steps_per_epoch(self, train: inputs_lib.StreamSource,
                                steps_per_epoch: int | None, steps: int | None) -> int:
        if steps_per_epoch is not None:
            return int(steps_per_epoch)
        n = train.num_elements()
        if n is None:
            if steps is not None:
                return int(steps)
            raise data_lib.DataError(
                f"train_data is a {train.name} with no known length; pass steps_per_epoch=N "
                f"(or steps=N), as Keras needs for such data")
        return n * train.rows_per_element() // self.global_batch_size

    def _eval_chunks(self, d: Any, labels: bool, batch_size: int | None = None):
        """Global batches of ``d`` (this process's rows), the last padded: ``(x, y, w, mask)``
        or, without ``labels``, ``(x, mask)``; ``batch_size`` rows each (default
        ``global_batch_size``)."""
        b = self.global_batch_size if batch_size is None else batch_size
        if isinstance(d, data_lib.ArrayData):
            batches = data_lib.eval_batches(d, b)
        else:
            batches = (data_lib.pad_batch(x, y if y is not None else
                                          np.zeros((inputs_lib.row_count(x),), np.int32), w, b)
                       for x, y, w in d.batches(b, epoch=0, pad_last=True))
        n = self._mesh_replicas
        eb = -(-b // n) * n  # padded (masked) to a multiple of the mesh's replicas
        for x, y, w, m in batches:
            if labels and isinstance(d, inputs_lib.StreamSource):
                data_lib.check_batch_labels(y, d.what, self.loss_fn)
            if eb != b:  # masked zero rows: weight and mask 0, so the sums do not change
                x, y, w, m = jax.tree.map(lambda a: data_lib.pad_rows(a, eb), (x, y, w, m))
            rows = functools.partial(self._local_rows, num_steps=1, batch_size=eb)
            if labels:
                yield rows(x), rows(y), rows(w), rows(m)
            else:
                yield rows(x), rows(m)

    def _local_rows(self, x: Any, num_steps: int, batch_size: int | None = None) -> Any:
        """Orders ``num_steps`` global batches so that each local replica gets its rows.

        ``x`` (an array or a dict of arrays) holds ``num_steps`` consecutive global batches of
        ``batch_size`` rows (default ``global_batch_size``). Replica ``r`` of the ``N`` of
        this process's mesh must see rows ``[r*B/N, (r+1)*B/N)`` of every one of them, in step
        order; the distributed dataset splits its input into equal consecutive parts, one per
        local replica.
        """
        if isinstance(x, Mapping):
            return {k: self._local_rows(v, num_steps, batch_size) for k, v in x.items()}
        n = self._mesh_replicas
        b = self.global_batch_size if batch_size is None else batch_size
        if b % n:
            raise ValueError(
                f"a batch of {b} rows does not split across the {n} replicas of this "
                f"process's {type(self.strategy).__name__} mesh; expected a multiple of {n}")
        per = b // n
        x = x.reshape(num_steps, n, per, *x.shape[1:])[:, self._local_replicas]
        x = np.swapaxes(x, 0, 1)
        return x.reshape(len(self._local_replicas) * num_steps * per, *x.shape[3:])

    def _distribute(self, local_batches: Any, options: Any = None) -> Any:
        """Distributes batches that already hold only this process's rows (``_local_rows``).

        The rows are chosen here, so the strategy must not shard them again across processes:
        the dataset is tagged ``AutoShardPolicy.OFF`` (with ``MultiWorkerMirroredStrategy`` the
        default ``AUTO``/``DATA`` would keep 1/P of rows that are already 1/P of a batch).
        """
        from jaxdist._src.input.autoshard import with_auto_shard_policy

        return self.strategy.experimental_distribute_dataset(
            with_auto_shard_policy(local_batches, "OFF"), options=options)

    def _host_chunks(self, train: data_lib.ArrayData, order: np.ndarray,
                     chunks: Sequence[tuple[int, int]]):
        b = self.global_batch_size
        for start, k in chunks:
            part = train.take(order[start * b:(start + k) * b])
            w = np.ones((k * b,), np.float32) if part.w is None else part.w
            yield (self._local_rows(part.x, k), self._local_rows(part.y, k),
                   self._local_rows(w, k))

    def _host_blocks(self, train: data_lib.ArrayData, order: np.ndarray,
                     groups: Sequence[Sequence[tuple[int, int]]], sizes: Mapping[int, int]):
        """Like ``_host_chunks`` for groups of consecutive chunks of ``kk`` steps each: one
        input block per group (``_input_block``), padded to ``sizes[kk]`` chunks so that
        its shape, hence the compiled step, is the same for every group."""
        b = self.global_batch_size
        for group in groups:
            start, kk = group[0]
            part = train.take(order[start * b:(start + len(group) * kk) * b])
            w = np.ones((len(part),), np.float32) if part.w is None else part.w
            yield self._input_block(part.x, part.y, w, kk, sizes[kk])

    def _input_block(self, x: Any, y: Any, w: Any, kk: int, count: int) -> tuple[Any, Any, Any]:
        """``count`` chunks of ``kk`` global batches as one input block ``(x, y, w)``.

        ``x``, ``y``, ``w`` hold the rows of up to ``count`` chunks, in step order (missing
        chunks at the end are zero rows, never run). Each array becomes ``(local replicas x
        count, kk x rows per replica, ...)``: the distributed dataset gives every replica its
        ``(count, kk x rows per replica, ...)`` share, and a dispatch of ``train_replica``
        takes one chunk of it on the device. One transfer then feeds ``count`` dispatches.
        """
        rows = count * kk * self.global_batch_size
        per = self.global_batch_size // self._mesh_replicas
        local = len(self._local_replicas)

        def block(a: Any) -> np.ndarray:
            a = np.asarray(a)
            if a.shape[0] != rows:
                a = data_lib.pad_rows(a, rows)
            a = self._local_rows(a, count * kk)
            return a.reshape(local * count, kk * per, *a.shape[1:])

        return jax.tree.map(block, x), block(y), block(w)

    def _block_sizes(self, train: Any, spe: int, k: int | None = None) -> dict[int, int]:
        """Chunks per input block for chunks of ``k`` (default: ``steps_per_execution``) and
        of 1 steps: up to ``BLOCK_STEPS`` steps and ``BLOCK_BYTES`` bytes per block, a power of
        two no larger than needed for an epoch (so one fit compiles at most two programs, as
        without blocks)."""
        if k is None:
            k = self.config.steps_per_execution
        if not isinstance(train, data_lib.ArrayData):
            return {k: 1, 1: 1}   # a stream: one chunk per block (no reading further ahead)
        row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:]))
                  for a in jax.tree.leaves((train.x, train.y))) + 4  # + the weight
        chunk_bytes = max(1, row * self.global_batch_size)

        def size(kk: int, chunks_needed: int) -> int:
            cap = max(1, min(BLOCK_STEPS // kk, BLOCK_BYTES // (kk * chunk_bytes)))
            need = 1 << max(0, int(chunks_needed) - 1).bit_length()  # next power of two
            return max(1, min(cap, need))

        return {k: size(k, spe // k), 1: size(1, spe if k == 1 else k - 1)}

    def _stream_chunks(self, train: inputs_lib.StreamSource, chunks: Sequence[tuple[int, int]],
                       positions: list[Any], ran_out: list[bool], blocks: bool = False):
        """Like ``_host_chunks`` for a stream: ``k`` global batches per chunk; the stream's
        position after each chunk goes to ``positions`` (the distributed dataset reads ahead,
        so the loop takes a position only when it runs the chunk). With ``blocks`` each chunk
        is an input block of one chunk (``_input_block``)."""
        b = self.global_batch_size
        restored = self._restored_position
        self._restored_position = None
        state = None
        if restored and restored.get("epoch") == self.epoch:
            state = restored.get("grain_state")
        it = train.batches(b, self.epoch, skip=chunks[0][0] if chunks else 0, state=state)
        for _, k in chunks:
            got = list(itertools.islice(it, k))
            if len(got) < k:
                ran_out[0] = True
                return
            for _, yb, _ in got:
                data_lib.check_batch_labels(yb, train.what, self.loss_fn)
            x = jax.tree.map(lambda *a: np.concatenate(a), *[g[0] for g in got])
            y = np.concatenate([g[1] for g in got])
            w = np.concatenate([np.ones((b,), np.float32) if g[2] is None else g[2]
                                for g in got])
            positions.append(train.position())
            if blocks:
                yield self._input_block(x, y, w, k, 1)
            else:
                yield self._local_rows(x, k), self._local_rows(y, k), self._local_rows(w, k)

    def _epoch_inputs(self, train: Any, order: Any, chunks: Sequence[tuple[int, int]],
                      groups: Sequence[Sequence[tuple[int, int]]], block_sizes: Mapping[int, int],
                      blocks: bool, positions: list[Any], ran_out: list[bool]) -> Any:
        """An epoch's distributed inputs: one ``(x, y, w)`` per group of chunks (``None``s
        when the hook feeds its steps itself). Blocks of up to 32 steps: a thread prepares
        them (a gather of the epoch's rows) while this one dispatches and waits; its hand-off
        costs once per block, not per step."""
        opts = InputOptions(experimental_per_replica_buffer_size=2, prefetch_thread=True)
        if self._hook.owns_input:  # e.g. per-worker datasets
            return ((None, None, None) for _ in groups)
        if isinstance(train, inputs_lib.StreamSource):
            return iter(self._distribute(
                self._stream_chunks(train, chunks, positions, ran_out, blocks), options=opts))
        if blocks:
            return iter(self._distribute(
                self._host_blocks(train, order, groups, block_sizes), options=opts))
        return iter(self._distribute(self._host_chunks(train, order, chunks), options=opts))


__all__ = ["BLOCK_BYTES", "BLOCK_STEPS", "InputFeed"]
