"""tf.data options for the datasets tfdist's strategies distribute.

The one option set: tf.data autotuning is off unless the dataset's own
options set it. TensorFlow 2.20's autotuning thread can miss the wake-up
its iterator's destruction sends it (the iterator's `CancellationManager`
runs the thread's wake-up callback before it marks itself cancelled; the
thread wakes, reads "not cancelled" and sleeps out its optimisation period,
which doubles up to 60 s), and destroying a distributed dataset's iterator
waits for that thread. Keras destroys the previous iterator at each epoch's
start and at the end of `fit`, so an epoch could start up to a minute late,
at random. Without autotuning, `num_parallel_calls=tf.data.AUTOTUNE` runs as
many calls in parallel as the machine has cores (up to 16) and
`prefetch(AUTOTUNE)` grows its buffer by tf.data's own heuristic; a pipeline
that needs the autotuner sets `options.autotune.enabled = True` and keeps it.
The datasets TensorFlow makes for each device in front of the user's have
no autotuning either way (`tfdist._compat.tf_data`).
"""

import tensorflow as tf


def without_autotuning(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data autotuning off, unless its options set it.

    Example:

    >>> ds = tf.data.Dataset.range(8).batch(2)
    >>> without_autotuning(ds).options().autotune.enabled
    False
    >>> options = tf.data.Options()
    >>> options.autotune.enabled = True
    >>> without_autotuning(ds.with_options(options)).options().autotune.enabled
    True
    """
    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
