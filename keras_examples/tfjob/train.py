"""The training script of the example TFJob: MultiWorkerStrategy on the digits.

Every task runs it. The cluster comes from TF_CONFIG (the Kubeflow training
operator, or `tfdist launch`, sets it), the ParallelConfig from TFDIST_CONFIG, and
the log directory from TFDIST_LOGDIR: there `tfdist.callbacks.BackupAndRestore`
keeps the job's training state, so a restarted job resumes where it stopped (on
Kubernetes, mount a shared persistent volume there), and the first task saves
the trained model.

    tfdist launch --workers=2 --microbatches=2 -- python keras_examples/tfjob/train.py
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import digits  # noqa: E402  (first: it quiets TensorFlow's C++ logs)

# isort: split
import keras  # noqa: E402
from absl import flags  # noqa: E402

import tfdist  # noqa: E402
from tfdist.cluster import read_tf_config  # noqa: E402

flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 128, "Global batch size.")
flags.DEFINE_list("profile_steps", None, "start,stop: every task records a profiler "
                  "trace of these steps into $TFDIST_LOGDIR (one TensorBoard run).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    digits.quiet_logs()
    strategy = tfdist.MultiWorkerStrategy(config=tfdist.ParallelConfig.from_env())
    task = read_tf_config()
    with strategy.scope():
        model = digits.build_model()
    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: print(
        f"epoch {epoch + 1} done: loss {logs['loss']:.4f}", flush=True))]
    logdir = os.environ.get("TFDIST_LOGDIR")
    if logdir:
        callbacks.append(tfdist.callbacks.BackupAndRestore(os.path.join(logdir, "backup")))
    if logdir and FLAGS.profile_steps:
        start, stop = (int(step) for step in FLAGS.profile_steps)
        callbacks.append(tfdist.callbacks.Profiler(logdir, steps=(start, stop), tasks="all"))
    x, y = digits.load()
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                        callbacks=callbacks, verbose=0)
    print(f"{task.task if task else 'local'}: {strategy.num_replicas_in_sync} replicas, "
          f"{strategy.config.to_json()}; losses "
          f"{[round(v, 4) for v in history.history['loss']]}")
    if logdir:
        # Every task saves (with `zero`, reading the optimizer state gathers
        # it from all tasks); only the chief's file is kept.
        chief = task is None or task.task in ("chief:0", "worker:0")
        with tempfile.TemporaryDirectory(dir=logdir if chief else None) as private:
            # Written aside, then renamed over the last model: a task killed
            # mid-save leaves the previous file whole, not a truncated one.
            model.save(os.path.join(private, "digits.keras"))
            if chief:
                os.replace(os.path.join(private, "digits.keras"),
                           os.path.join(logdir, "digits.keras"))


if __name__ == "__main__":
    digits.run(main)
