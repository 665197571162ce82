"""The examples run as documented (small settings, fresh processes)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "keras_examples"


def run_example(name, *flags):
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_data_parallel_example_prints_loss_and_throughput_per_epoch():
    out = run_example("data_parallel.py", "--epochs=3", "--microbatches=2")
    epochs = re.findall(r"epoch (\d): loss ([\d.]+)  accuracy ([\d.]+)  ([\d,]+) examples/s", out)
    assert [e[0] for e in epochs] == ["1", "2", "3"]
    losses = [float(e[1]) for e in epochs]
    assert losses[2] < losses[0]
    assert '"microbatches": 2' in out


def test_profile_fit_example_writes_a_trace_and_scalars(tmp_path):
    out = run_example("profile_fit.py", f"--logdir={tmp_path}", "--epochs=2")
    trace = re.search(r"^trace: (.*\.xplane\.pb)$", out, re.M)[1]
    assert pathlib.Path(trace).parent.parent == tmp_path / "plugins" / "profile"
    assert list((tmp_path / "tfdist").glob("events.out.tfevents.*"))


def test_zero_adam_example_prints_loss_and_a_quarter_of_the_state_per_device():
    out = run_example("zero_adam.py", "--devices=4", "--zero=2", "--epochs=2")
    epochs = re.findall(r"epoch (\d): loss ([\d.]+)  optimizer bytes (.*)  parameter bytes", out)
    assert [e[0] for e in epochs] == ["1", "2"]
    assert float(epochs[1][1]) < float(epochs[0][1])
    sizes = dict(re.findall(r"(CPU:\d)=([\d,]+)", epochs[1][2]))
    assert sorted(sizes) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    # digits MLP (64-256-256-10): 85,002 parameters, Adam's two float32 slots
    # split 4 ways (+ padding, iteration counter and learning rate).
    slots = 2 * 4 * 85_002
    assert all(slots / 4 <= int(s.replace(",", "")) <= 1.001 * slots / 4 + 12
               for s in sizes.values())


def test_tensor_example_splits_attention_and_mlp_over_stages_and_shards_state():
    out = run_example("tensor_parallel_transformer.py", "--devices=8", "--tensor=2",
                      "--pipeline=2", "--microbatches=2", "--zero=1", "--blocks=2",
                      "--epochs=2", "--width=32")
    stages = re.findall(r"^stage (\d)  \[(CPU:\d), (CPU:\d), (CPU:\d), (CPU:\d)\]", out, re.M)
    assert stages == [("0", "CPU:0", "CPU:2", "CPU:4", "CPU:6"),
                      ("1", "CPU:1", "CPU:3", "CPU:5", "CPU:7")]
    assert len(re.findall(r"MultiHeadAttention\s+heads", out)) == 2
    assert len(re.findall(r"Dense\s+(column|row)\s", out)) == 4  # each block's MLP pair
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    whole = int(re.search(r"unsplit model: ([\d,]+) bytes", out)[1].replace(",", ""))
    weights = re.search(r"weight bytes per device: (.*)", out)[1]
    state = re.search(r"optimizer state bytes per device: (.*)", out)[1]
    for line in (weights, state):
        sizes = [int(v.replace(",", "")) for v in re.findall(r"CPU:\d=([\d,]+)", line)]
        # Half the model per stage, its big weights halved again by tensor;
        # Adam's two slots of each device's part, halved by zero.
        assert len(sizes) == 8 and all(size < whole / 3 for size in sizes)


def test_pipeline_example_places_interleaved_stages_and_learns():
    out = run_example("pipeline_transformer.py", "--devices=4", "--pipeline=2",
                      "--schedule=interleaved", "--epochs=2", "--blocks=2", "--width=32",
                      "--microbatches=2")
    stages = re.findall(r"^stage (\d)  \[(CPU:\d), (CPU:\d)\]", out, re.M)
    # 2 stages per device: device 0 (CPU:0, and CPU:2 in the second data
    # replica) runs stages 0 and 2, device 1 stages 1 and 3.
    assert stages == [("0", "CPU:0", "CPU:2"), ("1", "CPU:1", "CPU:3"),
                      ("2", "CPU:0", "CPU:2"), ("3", "CPU:1", "CPU:3")]
    assert "schedule interleaved, 2 microbatches, 2 stages per device:" in out
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    sizes = dict(re.findall(r"(CPU:\d)=([\d,]+)", out))
    # data replicas hold the same stage's weights: CPU:0 == CPU:2, CPU:1 == CPU:3
    assert sizes["CPU:0"] == sizes["CPU:2"] and sizes["CPU:1"] == sizes["CPU:3"]


def test_keras_hub_gpt2_example_splits_the_tied_embedding_over_tensor_and_stages():
    # One replica of 2 stages x 2 tensor ranks (the 8-device layout, data=2,
    # is the tensor example's).
    out = run_example("keras_hub_gpt2.py", "--devices=4", "--tensor=2", "--pipeline=2",
                      "--microbatches=2", "--layers=2", "--width=32", "--epochs=2",
                      "--examples=512")
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert re.search(r"^stage 1 .*; tied: token_embedding \(a copy of stage 0's\)$", out, re.M)
    assert re.search(r"token_embedding\s+ReversibleEmbedding\s+vocabulary\s+32 rows -> 16", out)
    assert len(re.findall(r"CachedMultiHeadAttention\s+heads", out)) == 2
    whole = int(re.search(r"unsplit model: ([\d,]+) bytes", out)[1].replace(",", ""))
    weights = re.search(r"weight bytes per device: (.*)", out)[1]
    sizes = [int(v.replace(",", "")) for v in re.findall(r"CPU:\d=([\d,]+)", weights)]
    # A stage's blocks, halved by tensor (the last stage's copy of the table too).
    assert len(sizes) == 4 and all(size < whole / 2 for size in sizes)


@pytest.mark.model_garden
def test_model_garden_bert_example_trains_a_tf_keras_model_with_microbatches_and_zero():
    out = run_example("model_garden_bert.py", "--devices=2", "--microbatches=2", "--zero=2",
                      "--steps=60", "--steps_per_loop=20")
    loops = re.findall(r"steps (\d+): loss ([\d.]+)  accuracy ([\d.]+)", out)
    assert [int(s) for s, _, _ in loops] == [20, 40, 60]
    assert float(loops[2][1]) < float(loops[0][1])
    assert '"microbatches": 2' in out and '"zero": 2' in out and "steps applied: 60" in out
    state = re.search(r"optimizer state bytes per device: (.*)", out)[1]
    sizes = [int(v.replace(",", "")) for v in re.findall(r"CPU:\d=([\d,]+)", state)]
    # Adam's two slots, half on each device (and the counter and learning rate).
    weights = int(re.search(r"trainable weight bytes: ([\d,]+)", out)[1].replace(",", ""))
    assert len(sizes) == 2 and all(weights <= size < weights + 4096 for size in sizes)


def test_plan_example_ranks_gpt2_plans_and_prints_the_best_config():
    out = run_example("plan_gpt2.py", "--devices=4", "--memory_per_device=128MiB",
                      "--batch_size=8", "--sequence_length=16")
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["rank", "config", "peak", "step"]
    assert re.search(r"\d+ configurations weighed, \d+ fit in 128.00 MiB \(15% of it kept "
                     r"free: 108.80 MiB\) per device", out)
    config = json.loads(lines[-1])
    assert config["data"] * config["pipeline"] * config["tensor"] == 4
    first = lines[1].split()
    assert first[0] == "1" and first[-1] == "fits"
