"""`StepLedger`: each scheduled training step is applied at most once.

A `ClusterCoordinator` runs a scheduled function *at least* once: when a worker
dies after applying a step but before the chief has its result, the step is
run again on another worker, and would be applied twice. The ledger, a small
vector on a ps task, records the id of every step applied; a re-run finds its
id there and skips the apply phase. (A worker that dies in the few
milliseconds between recording a step and finishing its updates leaves that
step partly applied: parameter servers have no transactions.)
"""

import tensorflow as tf

# Slots of the ledger: more than the steps ever in flight at once.
_CAPACITY = 1 << 14


class StepLedger:
    """Records which step ids were applied, on the ps task of `colocate_with`.

    Example:

    ```python
    ledger = StepLedger(strategy, colocate_with=model.optimizer.iterations.value)
    grads, metrics = strategy.run(step.gradients, args=(batch,))
    ledger.apply_once(step_id, lambda: strategy.run(step.apply_gradients, args=(grads,)))
    ```
    """

    def __init__(self, strategy, colocate_with):
        with strategy.scope(), strategy.extended.colocate_vars_with(colocate_with):
            self._applied = tf.Variable(tf.zeros([_CAPACITY], tf.int64), trainable=False,
                                        name="tfdist_applied_steps")

    def apply_once(self, step_id, apply):
        """Runs `apply()` unless step `step_id` (an int64 tensor) already ran it."""
        slot = tf.math.floormod(step_id, _CAPACITY)
        mark = step_id + 1  # 0 is "empty"
        done = tf.equal(tf.gather(self._applied, slot), mark)

        def record_then_apply():
            record = self._applied.scatter_update(
                tf.IndexedSlices(tf.reshape(mark, [1]), tf.reshape(slot, [1])))
            with tf.control_dependencies([record]):
                apply()
            return tf.constant(True)

        return tf.cond(done, lambda: tf.constant(False), record_then_apply)
