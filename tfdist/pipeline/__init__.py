"""Pipeline parallelism: stages of a Keras model on their own devices.

`stages` cuts a model's graph into balanced contiguous stages; `placement`
puts each stage's variables (and optimizer slots) on its devices; `schedule`
is the order of the stages' forwards and backwards, as data; `runner` runs one
stage's forward and backward of a microbatch; `compute` runs a replica's batch
through every stage in the schedule's order (phase 1 of the step).
"""
