"""tf_keras (Keras 2) optimizer internals: variable keys, slot lookup, the
current learning rate, and replacing a slot variable with another.

tf_keras's optimizers (`tf_keras.optimizers.Adam`, ... the v2.11+ ones) find a
variable's slots through `_index_dict`, keyed by `_var_key(variable)`, and keep
the slots themselves in lists (`_momentums`, ...) and in `_variables` (what
`optimizer.variables` and checkpoints hold). The tables are checkpointed
dictionaries, which must not change once built.

Example:

```python
index = variable_index(optimizer, model.trainable_variables[0])   # 0
```
"""

import weakref


def variable_index(optimizer, variable) -> int:
    """The position of `variable` in the optimizer's slot lists.

    Example:

    ```python
    variable_index(model.optimizer, model.trainable_variables[0])   # 0
    ```
    """
    return optimizer._index_dict[optimizer._var_key(variable)]


def knows(optimizer, variable) -> bool:
    """Whether the built optimizer has slots for `variable`.

    Example:

    ```python
    knows(model.optimizer, model.trainable_variables[0])   # True once built
    ```
    """
    return optimizer._var_key(variable) in getattr(optimizer, "_index_dict", {})


def found_as(buffer, variable):
    """Makes tf_keras optimizers take `buffer` (a ZeRO shard buffer) for
    `variable`: its slots, its weight-decay exclusion. tf_keras keys a part
    of a distributed variable by its container (`_var_key` reads
    `_distributed_container`), which `buffer` now names as `variable`; the
    optimizer's own tables stay untouched (they are checkpointed).

    Example:

    ```python
    found_as(buffer, model.trainable_variables[0])
    optimizer.update_step(gradient_shard, buffer)   # updates kernel 0's slot shards
    ```
    """
    buffer._distributed_container = weakref.ref(variable)


def current_learning_rate(optimizer):
    """The learning rate of this step: a schedule's value is computed first,
    as `apply_gradients` does (`_compute_current_learning_rate`).

    Example:

    ```python
    learning_rate = current_learning_rate(model.optimizer)
    ```
    """
    optimizer._compute_current_learning_rate()
    return optimizer.learning_rate


def summed_duplicates(optimizer, gradients):
    """`gradients` with the slices of each `tf.IndexedSlices` that share an
    index summed, as `apply_gradients` does before `update_step`
    (`_deduplicate_sparse_grad`).

    Example:

    ```python
    gradients = summed_duplicates(model.optimizer, gradients)
    ```
    """
    return optimizer._deduplicate_sparse_grad(gradients)


def replace_variables(optimizer, replacements: dict):
    """Puts `replacements[id(old)]` wherever the optimizer holds `old`: its
    slot lists and `_variables`, each replaced by a new list (tracked lists
    may only be appended to), and forgets its cached checkpoint children.

    Example:

    ```python
    replace_variables(optimizer, {id(slot): sharded_slot})
    ```
    """
    for name, value in list(vars(optimizer).items()):
        if isinstance(value, (list, tuple)) and any(id(v) in replacements for v in value):
            setattr(optimizer, name, [replacements.get(id(v), v) for v in value])
    vars(optimizer).pop("_coalesced_children", None)
