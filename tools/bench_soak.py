"""Benchmark: a long multi-worker `fit` - threads, RSS and open files per worker over time.

    python tools/bench_soak.py [--workers=2] [--steps=5000] [--zero=0] [--out=results.jsonl]
        [--compression=none] [--compression_warmup=0] [--release_memory]
    python tools/bench_soak.py --strategy=keras   # the same job under plain tf.distribute
    python tools/bench_soak.py --zero=3 --checkpoint_every=50   # and an asynchronous
                                                                # sharded save every 50 steps

Launches `--workers` tasks with `tfdist launch`; each trains a small MLP with
`tfdist.MultiWorkerStrategy` and `model.fit` for `--steps` steps (epochs of
`--steps_per_epoch`) and samples its own thread count, RSS and open file
descriptors every `--sample_every` steps. A job that runs for days must stay
flat: growth is reported from the sample after `--warmup` steps to the last
(the bar: under 5%). One JSON line per task and sample, then a table.

`--checkpoint_every=N` also saves a `tfdist.checkpoint.ShardedCheckpoint`
(asynchronous, `max_to_keep=3`) every N steps into one directory the tasks
share; each sample is taken with no save in flight and also counts the
entries of that directory.

`--stall_task=1 --stall_at=20` makes that task sleep in a callback at that
step (alive, but not taking part in the step): the others must fail within
`--timeout_seconds` (tests/cluster/test_soak.py).
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("workers", 2, "Worker tasks.")
flags.DEFINE_integer("steps", 5000, "Training steps in all.")
flags.DEFINE_integer("steps_per_epoch", 100, "Steps per epoch.")
flags.DEFINE_integer("sample_every", 250, "Steps between two samples.")
flags.DEFINE_integer("warmup", 500, "Steps before the sample growth is measured from.")
flags.DEFINE_integer("zero", 0, "ParallelConfig.zero of the job.")
flags.DEFINE_string("compression", "none", "ParallelConfig.compression of the job.")
flags.DEFINE_integer("compression_warmup", 0, "ParallelConfig.compression_warmup of the job.")
flags.DEFINE_integer("checkpoint_every", 0, "Steps between two sharded checkpoint saves "
                     "(0: none).")
flags.DEFINE_enum("strategy", "tfdist", ["tfdist", "keras"],
                  "tfdist: tfdist.MultiWorkerStrategy; keras: "
                  "tf.distribute.MultiWorkerMirroredStrategy and Keras's own step.")
flags.DEFINE_bool("release_memory", False, "Launch with `tfdist launch --release_memory`.")
flags.DEFINE_float("timeout_seconds", 300, "MultiWorkerStrategy(timeout_seconds=).")
flags.DEFINE_integer("stall_task", -1, "Task index that stalls (default: none).")
flags.DEFINE_integer("stall_at", 0, "Step at which --stall_task sleeps.")
flags.DEFINE_float("stall_seconds", 600, "How long --stall_task sleeps.")
flags.DEFINE_string("samples", None, "Directory where each task writes its samples "
                    "(internal: set by the launching run).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 32


def usage():
    """This process's threads, resident bytes and open file descriptors, and
    the entries of the checkpoint directory (if any)."""
    import psutil

    process = psutil.Process()
    sample = {"threads": process.num_threads(), "rss_bytes": process.memory_info().rss,
              "fds": process.num_fds()}
    if FLAGS.checkpoint_every:
        directory = checkpoint_directory()
        sample["checkpoint_entries"] = (len(os.listdir(directory)) if os.path.isdir(directory)
                                        else 0)
    return sample


def checkpoint_directory():
    return os.path.join(FLAGS.samples, "checkpoints")


def task():
    """One task of the launched job: trains and writes its samples."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import tfdist

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if FLAGS.strategy == "keras":
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfdist.MultiWorkerStrategy(
            config=tfdist.ParallelConfig.from_env(), timeout_seconds=FLAGS.timeout_seconds)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * FLAGS.steps_per_epoch, 16)).astype("float32")
    y = (x[:, :4] + 0.3 * rng.normal(size=(len(x), 4))).argmax(-1).astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if FLAGS.checkpoint_every:
        if FLAGS.strategy == "keras":
            sys.exit("--checkpoint_every needs --strategy=tfdist.")
        checkpoints = tfdist.checkpoint.ShardedCheckpoint(model, checkpoint_directory())
    samples = []
    started = time.monotonic()

    class Sample(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_begin(self, batch, logs=None):
            if index == FLAGS.stall_task and self.step == FLAGS.stall_at:
                time.sleep(FLAGS.stall_seconds)

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if FLAGS.checkpoint_every and self.step % FLAGS.checkpoint_every == 0:
                checkpoints.save(step=self.step)
            if self.step % FLAGS.sample_every == 0:
                if FLAGS.checkpoint_every:  # sampled with no save in flight
                    checkpoints.wait()
                samples.append({"step": self.step,
                                "seconds": round(time.monotonic() - started, 1), **usage()})

    samples.append({"step": 0, "seconds": 0.0, **usage()})
    epochs = -(-FLAGS.steps // FLAGS.steps_per_epoch)
    if FLAGS.strategy == "keras":
        custom_loop(strategy, model, x, y, epochs, Sample())
    else:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, callbacks=[Sample()], verbose=0,
                  shuffle=False)
        if FLAGS.checkpoint_every:
            checkpoints.wait()
    with open(os.path.join(FLAGS.samples, f"worker{index}.json"), "w") as f:
        json.dump(samples, f)


def custom_loop(strategy, model, x, y, epochs, callback):
    """`epochs` of the model's step under plain `tf.distribute`, in a custom
    loop (Keras 3's `fit` fails under `MultiWorkerMirroredStrategy` before its
    first step: its symbolic build reduces the first batch across workers
    eagerly): each worker reads `BATCH` rows a step and Keras's optimizer
    all-reduces the gradients, one collective a step."""
    import tensorflow as tf

    workers = strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH * workers)

    def step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            per_example = tf.keras.losses.sparse_categorical_crossentropy(
                labels, model(features, training=True), from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH * workers)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train = tf.function(lambda batch: strategy.run(step, args=(batch,)))
    for _ in range(epochs):
        for batch in strategy.experimental_distribute_dataset(dataset):
            callback.on_train_batch_begin(0)
            train(batch)
            callback.on_train_batch_end(0)


def growth(samples, warmup):
    """Relative growth of each measure from the first sample at or after
    `warmup` steps to the last one."""
    first = next(s for s in samples if s["step"] >= warmup)
    last = samples[-1]
    return {key: (last[key] - first[key]) / first[key] for key in ("threads", "rss_bytes", "fds")}


def bench():
    import tempfile

    with tempfile.TemporaryDirectory() as samples:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tfdist.cli", "launch", f"--workers={FLAGS.workers}",
             f"--zero={FLAGS.zero}", f"--compression={FLAGS.compression}",
             f"--compression-warmup={FLAGS.compression_warmup}", "--timeout=7200",
             *(["--release_memory"] if FLAGS.release_memory else []), "--",
             sys.executable, __file__,
             f"--samples={samples}", f"--steps={FLAGS.steps}",
             f"--steps_per_epoch={FLAGS.steps_per_epoch}",
             f"--sample_every={FLAGS.sample_every}",
             f"--timeout_seconds={FLAGS.timeout_seconds}", f"--strategy={FLAGS.strategy}",
             f"--checkpoint_every={FLAGS.checkpoint_every}"],
            capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            sys.exit(f"the job failed ({done.returncode}):\n{done.stdout[-4000:]}")
        wall = time.monotonic() - started
        per_task = {index: json.loads((pathlib.Path(samples) / f"worker{index}.json").read_text())
                    for index in range(FLAGS.workers)}
    job = {"zero": FLAGS.zero, "compression": FLAGS.compression,
           "compression_warmup": FLAGS.compression_warmup,
           "checkpoint_every": FLAGS.checkpoint_every, "release_memory": FLAGS.release_memory}
    rows = []
    for index, task_samples in per_task.items():
        for sample in task_samples:
            emit({"bench": "soak", "strategy": FLAGS.strategy, "task": f"worker:{index}",
                  **job, **sample}, FLAGS.out)
        grown = growth(task_samples, FLAGS.warmup)
        emit({"bench": "soak_growth", "strategy": FLAGS.strategy, "task": f"worker:{index}",
              **job, "steps": FLAGS.steps, "warmup": FLAGS.warmup, **grown}, FLAGS.out)
        rows.append((index, task_samples, grown))
    saves = (f", a sharded checkpoint every {FLAGS.checkpoint_every} steps"
             if FLAGS.checkpoint_every else "")
    print(f"\n{FLAGS.strategy}: {FLAGS.workers} workers, zero={FLAGS.zero}, "
          f"compression={FLAGS.compression}{saves}, "
          f"{FLAGS.steps} steps in {wall:.0f} s (growth from step {FLAGS.warmup} "
          "to the last sample)")
    print("| task | threads (start, warm, end) | RSS MiB (warm, end) | fds (warm, end) "
          "| growth threads / RSS / fds |")
    print("|---|---|---|---|---|")
    for index, task_samples, grown in rows:
        warm = next(s for s in task_samples if s["step"] >= FLAGS.warmup)
        end = task_samples[-1]
        print(f"| worker:{index} | {task_samples[0]['threads']}, {warm['threads']}, "
              f"{end['threads']} | {warm['rss_bytes'] / 2**20:.0f}, "
              f"{end['rss_bytes'] / 2**20:.0f} | {warm['fds']}, {end['fds']} | "
              f"{grown['threads']:+.1%} / {grown['rss_bytes']:+.1%} / {grown['fds']:+.1%} |")


def main(argv):
    del argv
    task() if FLAGS.samples else bench()


if __name__ == "__main__":
    app.run(main)
