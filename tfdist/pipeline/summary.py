"""`model.summary()` of a pipelined model: Keras's table, then its stages and schedule."""

import functools

from tfdist._compat import patches


def install():
    """Makes `model.summary()` end with the stages and the schedule's grid
    (`strategy.describe(model)`) for models built under a tfdist strategy
    with `pipeline` > 1. Once per process; other models' summaries are
    unchanged.

    Example:

    ```python
    with tfdist.Strategy(pipeline=2, microbatches=4).scope():
        model = build_model()
    model.summary()   # ... Keras's table, then "Pipeline stages:", one line per stage
                      # and the schedule's grid
    ```
    """
    patches.install(patches.MODEL_SUMMARY, _with_stages)


def _with_stages(original):
    """Keras's `summary`, then a pipelined model's stages."""

    @functools.wraps(original)
    def summary(model, *args, print_fn=None, **kwargs):
        original(model, *args, print_fn=print_fn, **kwargs)
        strategy = model.distribute_strategy
        if getattr(getattr(strategy, "config", None), "pipeline", 1) > 1:
            for line in ["Pipeline stages:", *strategy.describe(model).splitlines()]:
                (print_fn or print)(line)

    return summary
