"""Update parts: reduced gradients in, the model's weights and optimizer state updated.

The last of a step's three parts (`TrainStep` = update(reduce(compute(batch)))).
Called in replica context with what the reduce part returned:

- `KerasApply`: the model's own Keras optimizer applies the full reduced
  gradients (its own all-reduce switched off for the call: they are reduced
  already). Under loss scaling every replica sees the same reduced gradients,
  so a non-finite gradient anywhere skips the step everywhere.
- `tfdist.optim.zero.ShardedUpdate`: ZeRO's, on this replica's gradient shards:
  sharded optimizer update, then the parameters all-gathered.

Ops are named `tfdist/apply/...` (and ZeRO's gather `tfdist/gather/...`).
"""

import tensorflow as tf

from tfdist._compat.keras_optimizer import gradients_already_reduced, update_steps_traced_once


class KerasApply:
    """The model's optimizer applies already-reduced gradients.

    Example:

    ```python
    KerasApply(model)(reduced_grads)   # in replica context
    ```
    """

    def __init__(self, model):
        self.model = model

    def __call__(self, grads):
        optimizer = self.model.optimizer
        with tf.name_scope("apply"), gradients_already_reduced(optimizer), \
                update_steps_traced_once(optimizer):
            optimizer.apply_gradients(zip(grads, self.model.trainable_weights))
