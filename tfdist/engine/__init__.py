"""tfdist's step engine: the training step a tfdist strategy runs for
`model.fit` (`tfdist.engine.step.TrainStep`), and its parts.

It imports none of them, so that a lower layer's module (a pipeline stage's
compute) can import the generic parts without the whole engine.
"""
