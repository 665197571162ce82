"""`tf.distribute` iterators released on a thread of their own.

Dropping an iterator of a distributed dataset that feeds several devices (its
`MultiDeviceIterator`) blocks in TensorFlow's C++ until the input pipeline's
autotuning thread reaches the end of its current period, which doubles while
the iterator lives, up to 60 s (a plain `tf.data` iterator stops at once).
Keras drops one at the start of every epoch after the first and at the end of
`fit`; one kept alive by a reference cycle is dropped by the garbage
collector, at any later point of the program. `release_in_background` gives
each iterator of a distributed dataset a finalizer that hands its devices'
iterators to one daemon thread, which waits in their place.

Example:

```python
dataset = release_in_background(strategy.experimental_distribute_dataset(ds))
iterator = iter(dataset)
del iterator          # returns at once; "tfdist-iterator-release" waits
```
"""

import queue
import threading
import weakref

import tensorflow as tf
from tensorflow.python.distribute import input_lib

_released = queue.SimpleQueue()
_thread_lock = threading.Lock()
_thread = None
_classes = {}  # a distributed dataset class -> its subclass releasing in background


def release_in_background(dataset):
    """`dataset` (a `tf.distribute` distributed dataset), its iterators
    released on the "tfdist-iterator-release" thread when dropped; any other
    value is returned as it is.

    Example:

    ```python
    release_in_background(strategy.experimental_distribute_dataset(ds))
    ```
    """
    base = type(dataset)
    if base in _classes.values() or not issubclass(
            base, (input_lib.DistributedDataset, input_lib.DistributedDatasetsFromFunction)):
        return dataset
    if base not in _classes:
        _classes[base] = type(base.__name__, (base,), {
            "__iter__": _iterating(base), "__slots__": (), "__module__": __name__})
    dataset.__class__ = _classes[base]
    return dataset


def _iterating(base):
    """`base.__iter__`, its iterators released in background when dropped."""
    def __iter__(self):
        iterator = base.__iter__(self)
        if tf.executing_eagerly():  # not a traced function's symbolic iterator
            # The finalizer runs before `iterator` lets go of its workers.
            weakref.finalize(iterator, _release, list(iterator._iterators))
        return iterator
    return __iter__


def _release(workers):
    """Takes each worker's devices' iterator from it and hands them to the
    release thread, whose references are then the only ones."""
    owned = [worker._iterator for worker in workers]
    for worker in workers:
        worker._iterator = None
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = threading.Thread(target=_drop_forever, name="tfdist-iterator-release",
                                       daemon=True)
            _thread.start()
    _released.put(owned)


def _drop_forever():
    while True:
        owned = _released.get()
        del owned  # TensorFlow's wait happens here, without the GIL
