"""tfdist's step engine: the training step a tfdist strategy runs for `model.fit`."""

from tfdist.engine.step import TrainStep

__all__ = ["TrainStep"]
