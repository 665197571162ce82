"""Statistics of the global batch inside a distributed training step.

Under data parallelism each replica computes its loss on its own examples and
the replicas' gradients are summed: exact for a loss that averages over the
examples, not for a term built from statistics of the whole batch, such as a
mixture of experts' load-balancing loss (a product of two batch means, which
keras-hub's Mixtral and Qwen-MoE blocks add with `add_loss`). A term computed
from `batch_sum` or `batch_mean` is the global batch's: the statistics are
summed over the replicas that hold other examples (all-reduced forward, their
gradients all-reduced backward), every replica adds the same term, and the
step's gradient is one device's. Within a replica's microbatches
(`microbatches`, `pipeline`) the statistics stay each microbatch's (a
microbatch's backward runs before the next one's forward): there such a term
differs from one device's, and `warn_of_per_replica_losses` says so before
training, as it does for `add_loss` terms computed without these functions.

Example:

```python
class Router(keras.layers.Layer):
    def call(self, probabilities):          # (tokens, experts)
        share = tfdist.batch_statistics.batch_mean(probabilities)
        self.add_loss(keras.ops.sum(share * share))
        return probabilities
```
"""

import threading
import warnings

import keras
import tensorflow as tf

from tfdist._compat import keras_functional, keras_layers, patches
from tfdist.tensor.mesh import DataOnlyMesh

_used = threading.local()  # whether a step's trace called batch_sum
_EVERY_REPLICA = object()  # (a strategy that is not tfdist's)


def batch_sum(x):
    """`x`, a sum over this replica's examples, summed over every replica
    that holds other examples of the global batch (a tensor group's ranks
    hold the same ones); backward, the gradients of the replicas' losses
    summed likewise (each replica's loss its share of the global loss, as
    Keras scales a loss for distribution). `x` itself outside a distributed
    step and under `pipeline` (each microbatch's own).

    Example:

    ```python
    tokens = batch_sum(keras.ops.sum(mask))   # the global batch's token count
    ```
    """
    _used.value = True
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return x
    strategy = context.strategy
    # The replicas holding the batch's other examples: a tfdist strategy's
    # data group (none where statistics stay each replica's or microbatch's),
    # every replica of another strategy.
    group = getattr(strategy, "example_group", _EVERY_REPLICA)
    if group is _EVERY_REPLICA:
        group = DataOnlyMesh(strategy)
    if group is None:
        return x
    if tf.executing_eagerly():
        # Eager replicas run one after another: a collective op would wait
        # for a replica not started yet. A merge call lets them meet.
        return group.eager_example_sum(context, x)
    # In a traced step, the replicas' collective launchers directly:
    # `ReplicaContext.all_reduce` would stop each replica's thread mid-forward
    # (a merge call), and the losses Keras layers add in their calls, kept on
    # the layer objects the replicas share, would mix the replicas' terms.
    launcher = group.data_launcher()

    @tf.custom_gradient
    def summed(x):
        return launcher.all_reduce(x), launcher.all_reduce

    return summed(x)


def batch_mean(x, axis=0):
    """The mean of `x` along its batch axis `axis` over the global batch
    (`batch_sum` of the sum and of the count).

    Example:

    >>> float(batch_mean(keras.ops.convert_to_tensor([1.0, 2.0, 6.0])))
    3.0
    """
    x = keras.ops.convert_to_tensor(x)
    count = keras.ops.cast(keras.ops.shape(x)[axis], x.dtype)
    return batch_sum(keras.ops.sum(x, axis=axis)) / batch_sum(count)


def load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """keras-hub's mixture-of-experts load-balancing loss (Switch Transformer's:
    `num_experts` x the sum over experts of the share of tokens routed to it
    times its mean routing probability), its two means over the global batch.
    The same value as keras-hub's `compute_load_balancing_loss` on one
    device; `use_global_router_losses` makes keras-hub use it.

    Example:

    >>> logits = keras.ops.convert_to_tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> round(float(load_balancing_loss(logits, num_experts=2, top_k=1)), 4)
    1.0
    """
    probabilities = keras.ops.softmax(router_logits, axis=-1)
    _, experts = keras.ops.top_k(probabilities, k=top_k)
    chosen = keras.ops.one_hot(experts, num_experts)  # (tokens, top_k, experts)
    if attention_mask is None:
        tokens_per_expert = batch_mean(chosen)
        probability_per_expert = batch_mean(probabilities)
    else:  # keras-hub's mask of the tokens that count
        if len(attention_mask.shape) == 3:  # Qwen-MoE's attention mask: any key
            mask = keras.ops.any(attention_mask, axis=-1)
        else:  # Mixtral's padding mask, cut to the router's rows
            length = keras.ops.shape(attention_mask)[1]
            rows = keras.ops.shape(router_logits)[0] // length
            mask = keras.ops.slice(attention_mask, [0, 0], [rows, length])
        mask = keras.ops.cast(keras.ops.reshape(mask, (-1,)), "float32")
        kept = batch_sum(keras.ops.sum(mask))
        tokens_per_expert = batch_sum(keras.ops.sum(chosen * mask[:, None, None], axis=0)) / (
            keras.ops.maximum(kept, 1e-9))
        probability_per_expert = batch_sum(
            keras.ops.sum(probabilities * mask[:, None], axis=0)) / keras.ops.maximum(kept, 1e-9)
    tokens_per_expert = keras.ops.mean(tokens_per_expert, axis=0)
    return keras.ops.sum(tokens_per_expert * probability_per_expert) * num_experts


def use_global_router_losses(model):
    """Makes keras-hub's mixture-of-experts blocks in `model` (Mixtral,
    Qwen-MoE, Qwen3-MoE) compute their load-balancing loss with
    `load_balancing_loss`, process-wide (the same values outside a
    distributed step).

    Example:

    ```python
    use_global_router_losses(mixtral_backbone)   # keras-hub's Mixtral now uses it
    ```
    """
    modules = {type(layer).__module__ for layer in keras_functional.nested_sublayers(model)}
    for patch in patches.OPTIONAL:
        if patch.module in modules:
            patches.install(patch, lambda original: load_balancing_loss)


def warn_of_per_replica_losses(model, splits, microbatches):
    """Warns, once per model, when `model` adds losses in its call
    (`add_loss`) while the global batch is split (`splits` replicas of
    different examples, `microbatches` per replica): such terms are computed
    on each part and averaged, as DistributedDataParallel and Megatron do:
    exact for a mean over examples, not for statistics of the whole batch
    unless they come from `batch_sum` / `batch_mean` (across replicas, not
    microbatches). Call after a traced forward.

    Example:

    ```python
    warn_of_per_replica_losses(model, splits=2, microbatches=1)
    ```
    """
    if (splits * microbatches == 1 or getattr(model, "_tfdist_losses_told", False)
            or not keras_layers.call_losses(model)):
        return
    model._tfdist_losses_told = True
    used, _used.value = getattr(_used, "value", False), False
    if used and microbatches == 1:
        return
    where = (f"each of the {microbatches} microbatches of a replica's batch"
             if microbatches > 1 else f"each of the {splits} replicas' examples")
    warnings.warn(
        f"model {model.name!r} adds losses in its call (`add_loss`): they are computed on "
        f"{where} and averaged. That is exact for a mean over the examples, not for a term "
        f"built from statistics of the whole batch (a mixture of experts' load-balancing "
        f"loss): compute such statistics with tfdist.batch_statistics.batch_mean / "
        f"batch_sum to make them the global batch's across replicas"
        f"{' (not across microbatches)' if microbatches > 1 else ''}.",
        stacklevel=2)
