"""Pipeline parallelism: stages of a Keras model on their own devices.

`stages` cuts a model's graph into balanced contiguous stages; `placement`
puts each stage's variables (and optimizer slots) on its devices. The step
that runs them is `tfdist.engine.pipeline`.
"""
