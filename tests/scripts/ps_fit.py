"""Parameter-server `model.fit` runs for the tests; prints one `RESULT {json}` line.

Modes:
- `--mode=checks`: an in-process cluster (2 workers, 2 ps); fits a model with a
  partitioned embedding and reports placement, step counts, callbacks' files,
  evaluation and a weights round trip.
- `--mode=ps` / `--mode=sync`: the same classification budget trained
  asynchronously (in-process cluster, `--workers`) or synchronously
  (`tfdist.Strategy`, `--workers` devices); reports held-out accuracy.
- `--mode=drill`: under `tfdist launch` (TF_CONFIG); every task writes its pid
  to `--pid_dir`, and the chief SIGKILLs worker 1 after `--kill_at` steps.
- `--mode=frozen_fetch`: under `tfdist launch` (one worker); the chief
  schedules a few seconds of work, freezes the worker once it has taken it,
  and reports whether tfdist's wait for the result says it is there.
"""

import json
import os
import pathlib
import signal

from absl import app, flags

flags.DEFINE_enum("mode", "checks", ["checks", "ps", "sync", "drill", "frozen_fetch"],
                 "What to run.")
flags.DEFINE_integer("workers", 2, "Workers (in-process cluster) or devices (sync).")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("steps_per_epoch", 30, "Steps per epoch.")
flags.DEFINE_string("pid_dir", None, "drill: where each task writes <type>-<index>.pid.")
flags.DEFINE_integer("kill_at", 20, "drill: the chief kills --kill_task after this many steps.")
flags.DEFINE_string("kill_task", "worker-1", "drill: the task the chief kills (<type>-<index>).")
flags.DEFINE_enum("kill_signal", "SIGKILL", ["SIGKILL", "SIGSTOP"],
                 "drill: the signal sent (SIGSTOP freezes the task).")
flags.DEFINE_string("backup_dir", None, "drill: BackupAndRestore directory.")
flags.DEFINE_integer("delay_ms", 100, "drill: time a worker takes to produce each batch.")
flags.DEFINE_string("out_dir", None, "checks: where callbacks write.")
flags.DEFINE_string("precision", "float32", "ps / sync: the strategies' precision.")
FLAGS = flags.FLAGS

FEATURES, CLASSES, VOCAB = 16, 4, 4096


def classification(n, seed):
    """Gaussian blobs: a task both training modes can learn to the same band."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(1).normal(size=(CLASSES, FEATURES)) * 1.2
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + rng.normal(size=(n, FEATURES))
    return x.astype("float32"), y.astype("int32")


def mlp(optimizer="adam"):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def emit(result):
    print("RESULT " + json.dumps(result), flush=True)


def run_checks():
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist

    strategy = tfdist.ParameterServerStrategy(
        cluster_resolver=tfdist.ps.in_process_cluster(workers=2, ps=2), microbatches=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(1024, 4)).astype("int32")
    labels = (tokens[:, 0] % CLASSES).astype("int32")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 32),  # 512 KiB: split across the 2 ps
            keras.layers.Flatten(),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(optimizer=keras.optimizers.Adam(schedule), steps_per_execution=3,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    out = pathlib.Path(FLAGS.out_dir)
    refused = []
    for bad in (dict(x=(t for t in [tokens]), y=None),
                dict(x=tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(32).repeat(),
                     y=None)):
        try:
            model.fit(**bad, epochs=1, verbose=0)
        except ValueError as e:
            refused.append(str(e))
    try:  # steps_per_execution=3 must divide the epoch
        model.fit(tokens, labels, batch_size=32, epochs=1, verbose=0)
    except ValueError as e:
        refused.append(str(e))
    data = tf.data.Dataset.from_tensor_slices((tokens, labels)).shuffle(1024).batch(32).repeat()
    history = model.fit(
        data, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
        validation_data=(tokens[:256], labels[:256]), verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(str(out / "ckpt.weights.h5"),
                                                   save_weights_only=True),
                   keras.callbacks.TensorBoard(str(out / "tb")),
                   keras.callbacks.BackupAndRestore(str(out / "backup"))])

    def dataset_fn(context):  # each worker builds its own
        return tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(32).repeat()

    history_fn = model.fit(dataset_fn, epochs=1, steps_per_epoch=6, verbose=0)

    def placement(variable):
        value = variable.value
        return [v.device for v in getattr(value, "variables", [value])]

    evaluated = model.evaluate(tokens, labels, batch_size=64, verbose=0, return_dict=True)
    predicted = model.predict(tokens[:64], verbose=0)
    model.save_weights(out / "final.weights.h5")
    local = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(VOCAB, 32),
                              keras.layers.Flatten(), keras.layers.Dense(CLASSES)])
    local.load_weights(out / "final.weights.h5")
    iterations = int(model.optimizer.iterations)
    emit({
        "refused": refused,
        "iterations": iterations,
        "dataset_fn_loss": history_fn.history["loss"],
        "learning_rate": float(model.optimizer.learning_rate),
        "schedule_at_iterations": float(schedule(iterations)),
        "history_keys": sorted(history.history),
        "history_len": len(history.history["loss"]),
        "model_placement": {v.path: placement(v) for v in model.weights},
        "optimizer_placement": {v.path: placement(v) for v in model.optimizer.variables},
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
        "evaluated_accuracy": evaluated["accuracy"],
        "local_accuracy": float(np.mean(local.predict(tokens, verbose=0).argmax(-1) == labels)),
        "prediction_max_diff": float(np.abs(local.predict(tokens[:64], verbose=0)
                                            - predicted).max()),
    })


def run_budget(mode):
    """Same data, batch size, optimizer and number of steps; accuracy on held-out data."""
    import numpy as np
    import tensorflow as tf

    import tfdist

    x, y = classification(4096, seed=0)
    x_test, y_test = classification(2048, seed=1)
    if mode == "ps":
        tfdist_strategy = tfdist.ParameterServerStrategy(
            cluster_resolver=tfdist.ps.in_process_cluster(workers=FLAGS.workers, ps=1),
            precision=FLAGS.precision)
        batch = 32  # each worker's step
    else:
        tfdist.use_virtual_devices(FLAGS.workers)
        tfdist_strategy = tfdist.Strategy(data=FLAGS.workers, precision=FLAGS.precision)
        batch = 32 * FLAGS.workers  # the same examples per step as all workers together
    steps = FLAGS.epochs * FLAGS.steps_per_epoch * (FLAGS.workers if mode == "ps" else 1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=0).batch(
        batch, drop_remainder=True).repeat()
    with tfdist_strategy.scope():
        model = mlp()
    model.fit(data, epochs=FLAGS.epochs, steps_per_epoch=steps // FLAGS.epochs, verbose=0)
    accuracy = float(np.mean(model.predict(x_test, verbose=0).argmax(-1) == y_test))
    emit({"accuracy": accuracy, "iterations": int(model.optimizer.iterations.numpy()),
          "steps": steps})


def write_pid():
    """Writes this task's pid to `--pid_dir`/<type>-<index>.pid."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    pathlib.Path(FLAGS.pid_dir, f"{task['type']}-{task['index']}.pid").write_text(
        str(os.getpid()))


def pid_of(task):
    """The pid task `task` (<type>-<index>) wrote to `--pid_dir`."""
    return int(pathlib.Path(FLAGS.pid_dir, f"{task}.pid").read_text())


def run_drill():
    import keras
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing

    write_pid()
    import tfdist

    strategy = tfdist.ParameterServerStrategy()  # workers and ps serve here

    class KillWorker(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == FLAGS.kill_at:
                pid = pid_of(FLAGS.kill_task)
                print(f"killing {FLAGS.kill_task} (pid {pid}) after {self.steps} steps "
                      f"with {FLAGS.kill_signal}", flush=True)
                os.kill(pid, getattr(signal, FLAGS.kill_signal))

    x, y = classification(2048, seed=0)
    # Each batch takes --delay_ms to produce on the worker: steps are in flight
    # when the kill lands, and fit lasts long enough for the restarted worker
    # to rejoin.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat().apply(
        testing.sleep(FLAGS.delay_ms * 1000))
    with strategy.scope():
        model = mlp()
    callbacks = [KillWorker()]
    if FLAGS.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(FLAGS.backup_dir))
        # A restarted chief resumes at its last backed-up epoch: kill only once.
        killed = pathlib.Path(FLAGS.backup_dir).exists()
        callbacks = callbacks[1:] if killed else callbacks
    model.fit(data, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch, verbose=0,
              callbacks=callbacks)
    emit({"iterations": int(model.optimizer.iterations),
          "steps": FLAGS.epochs * FLAGS.steps_per_epoch})


def run_frozen_fetch():
    import numpy as np
    import tensorflow as tf

    write_pid()
    import tfdist
    from tfdist._compat.tf_parameter_server import wait_for_result

    strategy = tfdist.ParameterServerStrategy()  # workers and ps serve here

    @tf.function
    def seconds_of_work():
        x = tf.random.stateless_uniform([256, 256], seed=[1, 2])
        return tf.reduce_sum(tf.foldl(lambda a, _: tf.tanh(a @ x), tf.range(3000), x))

    value = strategy.coordinator.schedule(seconds_of_work)
    value._status_available_event.wait(60)  # the worker took the function
    worker = pid_of("worker-0")
    os.kill(worker, signal.SIGSTOP)
    ready_while_frozen = wait_for_result(value, 3.0)
    os.kill(worker, signal.SIGCONT)
    ready_after = wait_for_result(value, 120.0)
    emit({"ready_while_frozen": ready_while_frozen, "ready_after": ready_after,
          "result_is_finite": bool(ready_after and np.isfinite(value.fetch()))})


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    keras.config.disable_traceback_filtering()  # whole tracebacks in the test log
    if FLAGS.mode == "checks":
        run_checks()
    elif FLAGS.mode == "drill":
        run_drill()
    elif FLAGS.mode == "frozen_fetch":
        run_frozen_fetch()
    else:
        run_budget(FLAGS.mode)


if __name__ == "__main__":
    app.run(main)
