"""``keras.utils.set_random_seed`` for the test worker processes that use no tf.data.

Keras seeds TensorFlow's global generator too whenever TensorFlow is installed (the tfdata test
extra), which imports it: about 6 CPU-s per process on a 2-core machine, most of a small
worker's start-up. Here TensorFlow counts as absent to Keras while it seeds (and, Keras caching
that answer, for the rest of the process); where TensorFlow is already imported, it is seeded as
Keras does. The seeds of Python, NumPy and Keras's own generator are the same either way.
"""

import sys


def set_random_seed(seed: int) -> None:
    """``keras.utils.set_random_seed(seed)`` without importing TensorFlow."""
    import keras

    if "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    sys.modules["tensorflow"] = None  # `import tensorflow` raises ImportError meanwhile
    try:
        keras.utils.set_random_seed(seed)
    finally:
        del sys.modules["tensorflow"]
