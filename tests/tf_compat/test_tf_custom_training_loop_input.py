"""Port of tensorflow/python/distribute/custom_training_loop_input_test.py onto jaxdist
(``get_next_as_optional`` and the eager loop over a distributed dataset).

TF's inputs and expected values are kept; only the API spelling changes: ``tf.function`` is
dropped (a distributed iterator is Python, read outside ``jax.jit``), TF's strategy
combinations (``all_strategies``) are the default strategy, OneDevice, Mirrored on one CPU
device, Mirrored on two devices and CentralStorage on two devices; TPU combinations and
``tf.Variable`` cases are not ported. TF's ``InvalidArgumentError`` from an empty optional's
``get_value()`` is ``ValueError`` (the table of deliberate differences in docs/tf_names.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import first_devices, tf_test_device, tf_test_devices

import jaxdist
from jaxdist import Dataset

ALL_STRATEGIES = {
    "default_strategy": lambda: jaxdist.get_strategy(),
    "one_device_strategy": lambda: jaxdist.OneDeviceStrategy(tf_test_device("/cpu:0")),
    "mirrored_strategy_with_one_cpu": lambda: jaxdist.MirroredStrategy(tf_test_devices(["/cpu:0"])),
    "mirrored_strategy_with_gpu_and_cpu": lambda: jaxdist.MirroredStrategy(first_devices(2)),
    "central_storage_strategy_with_gpu_and_cpu": lambda: jaxdist.CentralStorageStrategy(
        first_devices(2)
    ),
}
_cache: dict = {}


@pytest.fixture(params=sorted(ALL_STRATEGIES))
def distribution(request):
    if request.param != "default_strategy" and request.param.endswith("gpu_and_cpu"):
        tf_test_device("/cpu:1")  # skips without a second device
    if request.param not in _cache:
        _cache[request.param] = ALL_STRATEGIES[request.param]()
    return _cache[request.param]


def get_dataset_from_tensor_slices(inp_array):
    return Dataset.from_tensor_slices(np.asarray(inp_array, np.float32))


def assert_equal_flattened(expected_results, actual_results):
    """TF's AssertFlattenedMixin: each step's per-replica results, concatenated."""
    assert len(expected_results) == len(actual_results)
    for expected_result, actual_result in zip(expected_results, actual_results):
        final_result = []
        for val in actual_result:
            final_result.extend(np.atleast_1d(np.asarray(val)).tolist())
        assert final_result == expected_result


def test_FullEager(distribution):
    dataset = get_dataset_from_tensor_slices([5., 6., 7., 8.]).batch(2)

    def train_step(data):
        return jnp.square(data)

    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    results = []
    for x in dist_dataset:
        output = distribution.experimental_local_results(
            distribution.run(train_step, args=(x,)))
        results.append(output)
    assert_equal_flattened([[25., 36.], [49., 64.]], results)


def test_GetNextAsOptional(distribution):
    data = [5., 6., 7., 8.]
    dataset = get_dataset_from_tensor_slices(data).batch(2)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)

    def train_step(data):
        return jnp.square(data)

    def run(iterator):
        return distribution.experimental_local_results(
            distribution.run(
                train_step, args=(iterator.get_next_as_optional().get_value(),)))

    assert_equal_flattened([[25., 36.]], [run(iterator)])


def test_GetNextAsOptionalExampleUsage(distribution):
    global_batch_size = 2
    steps_per_loop = 6
    dataset = Dataset.range(8).map(lambda x: x.astype(np.int32)).batch(global_batch_size)
    distributed_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    def train_fn(distributed_iterator):

        def step_fn(x):
            return x

        steps = 0
        for _ in range(steps_per_loop):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            distribution.run(step_fn, args=(optional_data.get_value(),))
            steps += 1
        return steps

    # Not in TF's test, which only checks that the loop runs: 8 rows in batches of 2 end the
    # loop after 4 steps, and an empty optional's value is TF's error.
    assert train_fn(distributed_iterator) == 4
    empty = distributed_iterator.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match="does not have a value"):
        empty.get_value()


def test_GetNextAsOptional_element_spec(distribution):
    """Not in TF's file: TF's ``Optional.element_spec`` is the iterator's element spec, with
    or without a value (jaxdist: ``PerReplicaSpec`` / ``jax.ShapeDtypeStruct`` per array)."""
    dist_dataset = distribution.experimental_distribute_dataset(
        get_dataset_from_tensor_slices([5., 6., 7., 8.]).batch(2))
    if isinstance(dist_dataset, Dataset):
        pytest.skip("the default strategy returns the dataset itself, and jaxdist.Dataset has "
                    "no element_spec")
    iterator = iter(dist_dataset)
    full = iterator.get_next_as_optional()
    assert full.element_spec == dist_dataset.element_spec
    iterator.get_next()
    empty = iterator.get_next_as_optional()
    assert not empty.has_value()
    assert empty.element_spec == dist_dataset.element_spec
    assert jax.tree.structure(empty.element_spec) == jax.tree.structure(full.element_spec)
