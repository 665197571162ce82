"""The places where tfdist relies on Keras and TensorFlow internals.

Keras 3 and `tf.distribute` have no public hooks for some of what tfdist
does (turning off an optimizer's own gradient all-reduce, pointing its slot
lookup at shard buffers, ...). Each such use is a named function here, so a
Keras or TensorFlow upgrade means auditing this package and nothing else.
"""
