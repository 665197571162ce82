"""Metric results over every replica's examples, as one device reports them.

Each replica updates its own copy of the model's metric state (Keras's loss
tracker, the compiled metrics) with its own examples. Keras's `fit` then
averages the replicas' *results*, which is the global result only when every
replica saw as many examples: a global batch that does not split evenly over
the replicas (a last partial batch, a batch size the replicas do not divide)
would report another loss than one device. `synced_results` computes each
result from the state summed over the replicas instead, so every replica
returns the global value.
"""

import tensorflow as tf

from tfdist._compat.tf_distribute import summed_across_replicas


def synced_results(model, local_results, copies: int = 1):
    """`local_results` with each metric of `model` recomputed from the sum of
    every replica's state (one packed all-reduce), in replica context.

    Args:
        model: the compiled Keras model whose `metrics` were just updated.
        local_results: what `model.compute_metrics` returned on this replica.
        copies: how many replicas hold the same state (the ranks of a tensor
            group, which compute on the same examples): the sums are divided
            by it.

    Example:

    ```python
    results = model.compute_metrics(x, y, y_pred, sample_weight)
    results = synced_results(model, results)   # inside strategy.run
    ```
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return local_results
    metrics = [m for m in model.metrics if _summed(m)]
    states = [tf.identity(v.value) for m in metrics for v in m.variables]  # local values
    if not states:
        return local_results
    summed = summed_across_replicas(states)
    if copies > 1:
        summed = [s / tf.cast(copies, s.dtype) for s in summed]
    results = dict(local_results)
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
