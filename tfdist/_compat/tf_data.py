"""tf.data internals: the datasets a `MultiDeviceIterator` makes for each device.

A distributed dataset's iterator (`tf.distribute.MirroredStrategy` and its
kin) reads the user's dataset once on the host and hands each device its
batches through a small dataset of its own: a generator and a prefetch
buffer of a fixed size, made with TensorFlow's default options, so with
tf.data autotuning on although there is nothing in it to tune. Each such
iterator then keeps an autotuning thread, and TensorFlow 2.20's thread can
sleep through its iterator's destruction for up to 60 s (see
`tfdist.input_options`): measured, a 2-device iterator read every 10 ms
for 30-75 s took 7-11 s to drop, 0.2 s with these datasets' autotuning off.
"""

import functools

import tensorflow as tf

from tfdist._compat import patches


def device_datasets_without_autotuning():
    """Makes every `MultiDeviceIterator`'s per-device datasets without
    tf.data autotuning, process-wide, once (`patches.DEVICE_DATASET`).

    The user's own dataset keeps its options: only the generator and the
    fixed-size prefetch buffer in front of each device lose a tuner that
    had nothing to tune.

    Example:

    ```python
    device_datasets_without_autotuning()   # tfdist's strategies do it
    ```
    """
    patches.install(patches.DEVICE_DATASET, _without_autotuning)


def _without_autotuning(create_device_dataset):
    @functools.wraps(create_device_dataset)
    def create(*args, **kwargs):
        options = tf.data.Options()
        options.autotune.enabled = False
        return create_device_dataset(*args, **kwargs).with_options(options)

    return create
