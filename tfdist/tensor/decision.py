"""`Decision`: the tensor layout the plan gives one layer, and why."""

import dataclasses

import keras

from tfdist.tensor.layouts import TensorLayout


@dataclasses.dataclass
class Decision:
    """How one layer is laid out: `layout` is a `TensorLayout` (`Column`,
    `Row`, `Heads`, `Vocabulary`, `Classifier` or `Replicated`); `reason`
    says why (or what it pairs with); `name` is what `describe` calls the
    layer (its path inside a custom layer; by default its name); decisions
    with the same `group` (a column-parallel group and its row layer) are
    split together or not at all; `alternatives` are other layouts of the
    layer an explicit plan (a `LayoutMap`) may ask for instead, each with
    the reason it would print (a group's members switch together: the
    i-th alternative of each).

    Example:

    ```python
    decision = Decision(layer, Column(), "paired with dense_1")
    decision.name                                   # layer.name
    decision.layout.apply(decision.layer, strategy.tensor_mesh)
    ```
    """

    layer: keras.layers.Layer
    layout: TensorLayout
    reason: str
    name: str = ""
    group: object = None
    alternatives: tuple = ()

    def __post_init__(self):
        self.name = self.name or self.layer.name
