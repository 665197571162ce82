"""Metric results over every replica's examples, as one device reports them.

Each replica updates its own copy of the model's metric state (Keras's loss
tracker, the compiled metrics) with its own examples. Keras's `fit` then
averages the replicas' *results*, which is the global result only when every
replica saw as many examples: a global batch that does not split evenly over
the replicas (a last partial batch, a batch size the replicas do not divide)
would report another loss than one device. tfdist computes each result from
the state summed over the global batch's examples instead, so every replica
returns the global value: `local_states` gives the states to sum, the step's
reduce part sums them in the gradients' own all-reduce where it can
(`tfdist.engine.reduce`: one collective per step, not two), and
`synced_results` computes the results from the sums. The strategies then
take those results from any replica instead of averaging them across replicas
as Keras asks (`TrainStep.synced`: no collective either).
"""

import tensorflow as tf


def local_states(model):
    """This replica's additive metric states, to be summed over the global
    batch, with the metrics they belong to, in replica context:
    `(metrics, states)`, both empty with one replica.

    Example:

    ```python
    metrics, states = local_states(model)   # inside strategy.run, after the updates
    ```
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return [], []
    metrics = [m for m in model.metrics if _summed(m)]
    return metrics, [tf.identity(v.value) for m in metrics for v in m.variables]


def synced_results(metrics, summed):
    """The results of `metrics` computed from their `summed` states (aligned
    with `local_states`'s), by name: the global results, equal on every
    replica, to replace this replica's own.

    Example:

    >>> metric = keras.metrics.Mean(name="loss")
    >>> synced_results([metric], [tf.constant(6.0), tf.constant(3.0)])
    {'loss': <tf.Tensor: shape=(), dtype=float32, numpy=2.0>}
    """
    results = {}
    summed = list(summed)
    for metric in metrics:
        count = len(metric.variables)
        result, summed = metric.stateless_result(summed[:count]), summed[count:]
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def _summed(metric):
    """Whether a metric's state is additive over examples (every variable
    aggregated by sum, as Keras's built-in metrics declare) and floating."""
    return bool(metric.variables) and all(
        v.aggregation == "sum" and v.dtype.startswith("float") for v in metric.variables)
