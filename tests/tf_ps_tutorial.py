"""TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial on jaxdist.

Source: tensorflow/docs, site/en/tutorials/distribute/parameter_server_training.ipynb (its
"Model.fit" and "custom training loop" parts), run as the chief of

    python -m jaxdist.launch --coordinator --workers 2 --ps 2 -- python tests/tf_ps_tutorial.py DIR

(the launcher replaces the tutorial's in-process cluster: the ps and worker tasks run
``python -m jaxdist.server``). Renames: ``tf.distribute.experimental.ParameterServerStrategy``
-> ``jaxdist.ParameterServerStrategy``, ``tf.distribute.experimental.partitioners`` ->
``jaxdist``, ``...coordinator.ClusterCoordinator`` -> ``jaxdist.coordinator``,
``tf.keras`` -> ``keras``, ``tf.data.Dataset`` -> ``jaxdist.Dataset``, ``tf.random.uniform``
-> ``np.random.uniform``, ``tf.reduce_mean`` -> ``keras.ops.mean``, ``tf.distribute.ReduceOp``
-> ``jaxdist.ReduceOp``, ``tf.keras.callbacks.TensorBoard/ModelCheckpoint`` ->
``jaxdist.keras.*``. The script sets ``KERAS_BACKEND=jax`` itself (the worker servers import
Keras on the JAX backend on their own).

Edits beyond renames:

Model.fit part:
  * ``jaxdist.keras.attach(model, strategy)`` after ``compile`` (Keras 3 has no ps variables of
    its own); the model stays lazily built (no Input): its first ``fit`` builds it, as TF's.
  * Keras 3 has no ``DatasetCreator``: ``fit`` gets a generator over ``dataset_fn``'s dataset
    (the coordinator's pipeline; each step is scheduled with its batch), and no ``shard``
    (jaxdist.Dataset has none; one input pipeline).
  * ``y`` is ``(10, 1)``, not ``(10,)``: Keras 3's ``mse`` does not broadcast a ``(batch,)``
    target against ``(batch, 10)`` predictions as tf.keras did (plain Keras 3 fails too).
  * ``ModelCheckpoint`` needs a ``.keras`` file name in Keras 3; ``BackupAndRestore`` is left
    out (the state lives on the ps: ``strategy.extended.save`` / ``restore``).
Custom training loop part:
  * ``StringLookup`` needs TensorFlow: the examples are generated as vocabulary ids (index 0
    is the out-of-vocabulary id, as StringLookup numbers them) and the preprocessing models
    are dropped.
  * The variables go to the ps through ``attach`` (TF creates them there in ``scope()``);
    ``tf.GradientTape`` becomes ``jax.value_and_grad`` of ``model.stateless_call``, and the
    gradients are pushed with ``apply_gradients`` of the ps variables (a Keras optimizer or
    metric mutated on a worker would change that worker's copy only).
  * ``accuracy.update_state`` on the workers becomes the step returning its correct and total
    counts, which the coordinator adds up.
  * 2 epochs of 5 steps instead of 4, ``output_dim`` of the embedding as in the tutorial.

Prints one JSON line per part for the test (``tests/test_tf_ps_tutorial.py``).
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # the program sets it itself; the workers follow

import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402
from jaxdist._src.coordinator import ClusterCoordinator  # noqa: E402

working_dir = sys.argv[1]

# ---------------------------------------------------------------- the strategy
cluster_resolver = jaxdist.cluster_resolver.TFConfigClusterResolver()
NUM_PS = len(cluster_resolver.cluster_spec().as_dict()["ps"])
variable_partitioner = jaxdist.MinSizePartitioner(min_shard_bytes=(256 << 10),
                                                  max_shards=NUM_PS)
strategy = jaxdist.ParameterServerStrategy(cluster_resolver,
                                           variable_partitioner=variable_partitioner)
coordinator = ClusterCoordinator(strategy)  # TF's fit makes one itself


# ---------------------------------------------------------------- Model.fit
def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = np.random.uniform(size=(10, 10)).astype("float32")
    y = np.random.uniform(size=(10, 1)).astype("float32")

    dataset = jaxdist.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)

    return dataset


dc = (batch for batch in dataset_fn(jaxdist.InputContext()))

with strategy.scope():
    model = keras.models.Sequential([keras.layers.Dense(10)])

    model.compile(keras.optimizers.SGD(), loss="mse", steps_per_execution=10)
training = jaxdist.keras.attach(model, strategy)
assert not model.built  # built by its first fit

log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt.keras")

callbacks = [
    jaxdist.keras.TensorBoard(log_dir=log_dir),
    jaxdist.keras.ModelCheckpoint(filepath=ckpt_filepath),
]

history = model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks, verbose=0)
print(json.dumps({"part": "fit", "loss": history.history["loss"], "steps": training.steps,
                  "functions_run": coordinator.functions_run(),
                  "versions": sorted(training.variables.versions.values()),
                  "checkpoint": os.path.exists(ckpt_filepath)}), flush=True)

# ---------------------------------------------------------------- custom training loop
feature_vocab = [
    "avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"
]
label_vocab = ["yes", "no"]


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append([feature_vocab.index(f) + 1 for f in features])
        examples["label"].append([label_vocab.index(label[0])])
    return {k: np.asarray(v, np.int32) for k, v in examples.items()}


random.seed(0)
examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = jaxdist.Dataset.from_tensor_slices(
        ({"features": examples["features"]}, examples["label"]))
    train_dataset = raw_dataset.shuffle(200).batch(32).repeat()
    return train_dataset


with strategy.scope():
    model_input = keras.layers.Input(shape=(3,), dtype="int32", name="model_input")

    emb_layer = keras.layers.Embedding(input_dim=len(feature_vocab) + 1, output_dim=16384)
    emb_output = keras.ops.mean(emb_layer(model_input), axis=1)
    dense_output = keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
    model = keras.Model({"features": model_input}, dense_output)

    optimizer = keras.optimizers.RMSprop(learning_rate=0.1)
    model.compile(optimizer=optimizer)
variables = jaxdist.keras.attach(model, strategy, name="ctl").variables

# the embedding is split into two shards, one per ps
placement = variables.placement()
assert placement[0] == ["/job:ps/task:0", "/job:ps/task:1"], placement

loss_object = keras.losses.BinaryCrossentropy(reduction=None)


def step_fn(iterator):

    def replica_fn(trainable, batch_data, labels):
        def loss_fn(trainable):
            pred, _ = model.stateless_call(trainable, [], batch_data, training=True)
            per_example_loss = loss_object(labels, pred)
            return jaxdist.compute_average_loss(per_example_loss), pred

        (loss, pred), gradients = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        actual_pred = (pred > 0.5).astype("int32")
        correct = jnp.sum(actual_pred == labels)
        return loss, gradients, correct

    batch_data, labels = next(iterator)
    loss, gradients, correct = strategy.run(replica_fn, args=(variables, batch_data, labels))
    variables.apply_gradients(gradients)
    return (strategy.reduce(jaxdist.ReduceOp.SUM, loss, axis=None),
            strategy.reduce(jaxdist.ReduceOp.SUM, correct, axis=None))


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epoches = 2
steps_per_epoch = 5
accuracies = []
for i in range(num_epoches):
    results = [coordinator.schedule(step_fn, args=(per_worker_iterator,))
               for _ in range(steps_per_epoch)]
    # Wait at epoch boundaries.
    coordinator.join()
    correct = sum(int(r.fetch()[1]) for r in results)
    accuracies.append(correct / (32 * steps_per_epoch))
    print("Finished epoch %d, accuracy is %f." % (i, accuracies[-1]), flush=True)  # noqa: UP031

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch()[0], flush=True)  # noqa: UP031
variables.pull()  # (refreshes the versions this process knows)
print(json.dumps({"part": "custom_loop", "accuracies": accuracies,
                  "final_loss": float(loss.fetch()[0]),
                  "versions": sorted(variables.versions.values())}), flush=True)
coordinator.shutdown()
