"""Writes (or, with --check, verifies) the example TFJob manifests of this folder.

Each manifest is the output of the `tfdist tfjob` command below it; CI runs
`generate.py --check` so they never drift from the tool.

    python keras_examples/tfjob/generate.py          # rewrite the manifests
    python keras_examples/tfjob/generate.py --check  # exit 1 if one is stale
"""

import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
IMAGE = "registry.example.com/tfdist-examples:0.1.0"  # built from ./Dockerfile

MANIFESTS = {
    "multiworker.yaml": [
        "--name=digits-multiworker", f"--image={IMAGE}", "--workers=4",
        "--microbatches=2", "--cpu=2", "--memory=4Gi", "--logdir=/logs/digits",
        "--backoff-limit=3", "--",
        "python", "keras_examples/tfjob/train.py", "--epochs=10",
    ],
    # Asynchronous parameter-server training: a restarted worker rejoins, a
    # restarted chief resumes from its backup.
    "parameter_server.yaml": [
        "--name=digits-ps", f"--image={IMAGE}", "--chief", "--workers=4", "--ps=2",
        "--cpu=2", "--memory=4Gi", "--restart-policy=OnFailure", "--backoff-limit=3", "--",
        "python", "keras_examples/parameter_server.py", "--epochs=10",
        "--steps_per_epoch=100", "--backup_dir=/logs/digits-ps/backup",
    ],
}


def render(args):
    done = subprocess.run([sys.executable, "-m", "tfdist.cli", "tfjob", *args],
                          capture_output=True, text=True, check=True)
    return done.stdout


def main(check):
    stale = []
    for name, args in MANIFESTS.items():
        text = render(args)
        path = HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale manifests: {stale}; run python keras_examples/tfjob/generate.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv[1:]))
