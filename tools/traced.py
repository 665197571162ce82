"""What the benchmarks read from the training function Keras's `fit` traced.

Example:

    from traced import step_graph
    graph = step_graph(model)   # after model.fit(...)
"""


def train_function(model):
    """The `tf.function` `fit` traced for `model` (Keras keeps it in a closure)."""
    cells = [c.cell_contents for c in model.train_function.__closure__]
    (traced,) = [c for c in cells if hasattr(c, "get_concrete_function")]
    return traced


def step_graph(model):
    """The graph of the per-step function `fit` traced (all replicas' ops)."""
    (concrete,) = train_function(model)._list_all_concrete_functions()
    (step,) = [f for name, f in concrete.graph._functions.items() if "one_step_on_data" in name]
    return step.graph
