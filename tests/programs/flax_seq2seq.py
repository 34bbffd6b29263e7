"""flax's seq2seq example: an LSTM encoder-decoder (``nn.RNN``) learning to add numbers.

Source: github google/flax, examples/seq2seq (``models.py``: ``Seq2seq`` with an
``nn.RNN(nn.LSTMCell)`` encoder from a zero carry that stops at each query's EOS
(``seq_lengths``) and an ``nn.RNN(DecoderLSTMCell)`` decoder started from the encoder's state;
``input_pipeline.py``: ``CharacterTable`` one-hot queries ``"a+b"`` and answers ``"=c"`` with
EOS, ``mask_sequences`` / ``get_sequence_lengths``; ``train.py``: ``TrainState`` with
``optax.adam(0.003)``, batch 128, the masked cross-entropy, sequence accuracy). Written anew
after the example: the same model, data encoding, loss, metrics and optimizer.

Edits beyond API renames:
- the examples come from ``random.Random(0)`` instead of the global ``random`` module, drawn
  up front: 8 steps of 128 (10000 steps in the original), hidden size 128 (512).
- the decoder is teacher-forced in training (the original feeds it tokens sampled from its
  own logits with the ``lstm`` rng): a sampled draw depends on the shape of the batch it is
  drawn for, so a replica's 32 rows cannot draw what one device's 128 rows draw.
- the step goes through ``strategy.run`` on batches from ``experimental_distribute_dataset``;
  the mean over the batch of the masked cross-entropy becomes
  ``jaxdist.compute_average_loss`` of each query's mean over the answer's positions (the same
  number on one device: under ``run`` the gradient of replicated parameters is summed over
  the replicas, as TF sums them, so each replica divides by the global batch).
- the training state is created under ``strategy.scope()``; the per-step metrics are
  averaged over the replicas (``strategy.reduce(MEAN)``: equal shares of the batch).
- no metric writer or logging; decoding (``decode``, unchanged: sampled, one jitted call on a
  batch of 5) runs once at the end; the parameters, metrics and decoded tokens are returned.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import jaxdist

LEARNING_RATE = 0.003
BATCH_SIZE = 128
HIDDEN_SIZE = 128       # 512 in the original
NUM_TRAIN_STEPS = 8     # 10000 in the original
MAX_LEN_QUERY_DIGIT = 3


class CharacterTable:
    """One-hot encoding of ``"a+b"`` / ``"=c"`` strings with a pad (0) and an EOS (1) token."""

    def __init__(self, chars: str, max_len_query_digit: int = 3):
        self._chars = sorted(set(chars))
        self._char_indices = {ch: i + 2 for i, ch in enumerate(self._chars)}
        self._indices_char = {i + 2: ch for i, ch in enumerate(self._chars)}
        self._indices_char[self.pad_id] = "_"
        self._max_len_query_digit = max_len_query_digit

    pad_id, eos_id = 0, 1

    @property
    def vocab_size(self) -> int:
        return len(self._chars) + 2

    @property
    def max_input_len(self) -> int:
        return self._max_len_query_digit * 2 + 2

    @property
    def max_output_len(self) -> int:
        return self._max_len_query_digit + 3

    @property
    def encoder_input_shape(self):
        return (1, self.max_input_len, self.vocab_size)

    @property
    def decoder_input_shape(self):
        return (1, self.max_output_len, self.vocab_size)

    def encode(self, inputs: str) -> np.ndarray:
        return np.array([self._char_indices[c] for c in inputs] + [self.eos_id])

    def decode(self, inputs) -> str:
        chars = []
        for elem in inputs.tolist():
            if elem == self.eos_id:
                break
            chars.append(self._indices_char[elem])
        return "".join(chars)

    def one_hot(self, tokens: np.ndarray) -> np.ndarray:
        vecs = np.zeros((tokens.size, self.vocab_size), dtype=np.float32)
        vecs[np.arange(tokens.size), tokens] = 1
        return vecs

    def encode_onehot(self, batch_inputs, max_len: int | None = None) -> np.ndarray:
        max_len = self.max_input_len if max_len is None else max_len

        def encode_str(s):
            tokens = self.encode(s)
            if len(tokens) > max_len:
                raise ValueError(f"Sequence too long ({len(tokens)}>{max_len}): '{s}'")
            return self.one_hot(np.pad(tokens, [(0, max_len - len(tokens))]))

        return np.array([encode_str(s) for s in batch_inputs])

    def decode_onehot(self, batch_inputs) -> np.ndarray:
        return np.array([self.decode(x.argmax(axis=-1)) for x in batch_inputs])

    def generate_examples(self, num_examples: int, rng: random.Random):
        max_digit = pow(10, self._max_len_query_digit) - 1
        for _ in range(num_examples):
            key = tuple(sorted((rng.randint(0, 99), rng.randint(0, max_digit))))
            yield f"{key[0]}+{key[1]}", "=" + str(key[0] + key[1])

    def get_batch(self, batch_size: int, rng: random.Random) -> dict[str, np.ndarray]:
        inputs, outputs = zip(*self.generate_examples(batch_size, rng))
        return {"query": self.encode_onehot(inputs),
                "answer": self.encode_onehot(outputs, self.max_output_len)}


def mask_sequences(sequence_batch, lengths):
    return sequence_batch * (lengths[:, None] > jnp.arange(sequence_batch.shape[1])[None])


def get_sequence_lengths(sequence_batch, eos_id: int):
    eos_row = sequence_batch[:, :, eos_id]
    eos_idx = jnp.argmax(eos_row, axis=-1)
    return jnp.where(eos_row[jnp.arange(eos_row.shape[0]), eos_idx], eos_idx + 1,
                     sequence_batch.shape[1])


class DecoderLSTMCell(nn.RNNCellBase):
    """One decoder step: an LSTM cell, logits over the vocabulary, a sampled next token."""

    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        predicted_token = jax.random.categorical(self.make_rng("lstm"), logits)
        prediction = jax.nn.one_hot(predicted_token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force,
                                         self.vocab_size),
                         split_rngs={"params": False, "lstm": True}, name="decoder")
        seq_lengths = jnp.argmax(jnp.argmax(encoder_inputs, -1) == self.eos_id, axis=-1)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        return decoder(decoder_inputs[:, :-1], initial_carry=(encoder_state,
                                                               decoder_inputs[:, 0]))


def get_model(ctable: CharacterTable, *, teacher_force: bool = False) -> Seq2seq:
    return Seq2seq(teacher_force=teacher_force, hidden_size=HIDDEN_SIZE, eos_id=ctable.eos_id,
                   vocab_size=ctable.vocab_size)


def get_train_state(rng, ctable: CharacterTable) -> train_state.TrainState:
    model = get_model(ctable, teacher_force=True)
    rng1, rng2 = jax.random.split(rng)
    params = model.init({"params": rng1, "lstm": rng2},
                        jnp.ones(ctable.encoder_input_shape, jnp.float32),
                        jnp.ones(ctable.decoder_input_shape, jnp.float32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(LEARNING_RATE))


def per_query_cross_entropy(logits, labels, lengths):
    """Each query's masked cross-entropy, averaged over the answer's positions."""
    xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
    return -jnp.mean(mask_sequences(xe, lengths), axis=-1)


def compute_metrics(logits, labels, eos_id: int) -> dict[str, Any]:
    lengths = get_sequence_lengths(labels, eos_id)
    loss = jnp.mean(per_query_cross_entropy(logits, labels, lengths))
    token_accuracy = jnp.argmax(logits, -1) == jnp.argmax(labels, -1)
    sequence_accuracy = jnp.sum(mask_sequences(token_accuracy, lengths), axis=-1) == lengths
    return {"loss": loss, "accuracy": jnp.mean(sequence_accuracy)}


@jax.jit
def train_step(state, batch, lstm_rng, eos_id: int):
    labels = batch["answer"][:, 1:]
    lstm_key = jax.random.fold_in(lstm_rng, state.step)

    def loss_fn(params):
        logits, _ = state.apply_fn({"params": params}, batch["query"], batch["answer"],
                                   rngs={"lstm": lstm_key})
        per_query = per_query_cross_entropy(logits, labels,
                                            get_sequence_lengths(labels, eos_id))
        return jaxdist.compute_average_loss(per_query), logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), compute_metrics(logits, labels, eos_id)


def decode(params, inputs, decode_rng, ctable: CharacterTable):
    init_decoder_input = ctable.one_hot(ctable.encode("=")[0:1])
    init_decoder_inputs = jnp.tile(init_decoder_input,
                                   (inputs.shape[0], ctable.max_output_len, 1))
    model = get_model(ctable, teacher_force=False)
    _, predictions = model.apply({"params": params}, inputs, init_decoder_inputs,
                                 rngs={"lstm": decode_rng})
    return predictions


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    ctable = CharacterTable("0123456789+= ", MAX_LEN_QUERY_DIGIT)
    examples = random.Random(0)
    batches = [ctable.get_batch(BATCH_SIZE, examples) for _ in range(NUM_TRAIN_STEPS)]
    rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    dataset = jaxdist.Dataset.from_tensor_slices(rows).batch(BATCH_SIZE)
    rng = jax.random.PRNGKey(0)
    with strategy.scope():
        state = get_train_state(rng, ctable)
    history = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        state, metrics = strategy.run(train_step, args=(state, batch, rng, ctable.eos_id))
        history.append({k: strategy.reduce(jaxdist.ReduceOp.MEAN, v, axis=None)
                        for k, v in metrics.items()})
    decode_batch = ctable.get_batch(5, examples)
    decoded = jax.jit(decode, static_argnums=3)(
        state.params, decode_batch["query"], jax.random.fold_in(rng, state.step), ctable)
    return {"params": state.params, "history": history, "decoded": decoded}
