"""The same custom loop and the same `fit`, through TensorFlow and through `distribute`.

TensorFlow lives in another environment (it pins its own NumPy and protobuf), so
this script runs each side in its own process: this one with `distribute`, the TF
side with the interpreter given by ``--tf-python``, which runs this same file with
``--side tf``. Both read the same data and initial weights from one ``.npz``.

    python -m venv ~/.cache/distribute/tf-venv
    ~/.cache/distribute/tf-venv/bin/pip install tensorflow-cpu==2.21.0
    python benchmarks/bench_vs_tensorflow.py --tf-python ~/.cache/distribute/tf-venv/bin/python

What runs on each side, `MirroredStrategy` over 2 logical CPU devices (TF:
``tf.config.set_logical_device_configuration``; here ``["cpu:0", "cpu:1"]``), SGD
(learning rate 0.05, momentum 0.9: Keras's and torch's formulas give the same
steps), global batch 64, 7,040 examples (110 batches), one of two models
(``--model``):

    mlp    an MLP 64-256-256-10 on random inputs (the default);
    digits the guide's MLP 64-32-10 on scikit-learn's digits (1,797 images scaled
           to [-1, 1], repeated to 7,040): the figure issue 40 names.

    loop   the tf.distribute custom loop: the dataset distributed by the strategy,
           ``strategy.run(step)`` computing ``compute_average_loss`` and stepping
           the optimizer, ``strategy.reduce("SUM", ...)``; TF's step is a
           ``tf.function``. 10 warm-up steps (TF traces), then 100 timed.
    fit    ``model.fit(x, y, batch_size=64, epochs=2, shuffle=False)``; the second
           epoch is timed (Keras's ``fit`` compiles its step in the first).

Prints JSON lines: steps per second of each side (median over ``--runs`` runs, the
sides alternating), their ratio (distribute / TensorFlow, > 1 is faster); the loop
once more on MirroredStrategy's design in plain PyTorch with no library (two replica
threads, a model copy each: ``_plain_replicas.py``), the floor of a threaded design,
against TensorFlow and against the library, and with the replicas in turn on one
thread (``plain_threads``; run after the library's loop in the same process, not
interleaved with it); and how
far apart the numbers are (largest difference of the losses over the steps and of
the final weights, first run). Timings are a side-by-side ratio on one machine,
never a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODELS = {"mlp": (64, 256, 256, 10), "digits": (64, 32, 10)}
GLOBAL_BATCH = 64
LR, MOMENTUM = 0.05, 0.9
WARMUP, TIMED = 10, 100
EXAMPLES = GLOBAL_BATCH * (WARMUP + TIMED)  # one pass of the loop: 7,040


def make_inputs(path: Path, model: str) -> None:
    """Data, the widths and initial weights (torch's layout: weight ``(out, in)``)."""
    rng = np.random.default_rng(0)
    widths = MODELS[model]
    if model == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        repeats = -(-EXAMPLES // len(digits.target))
        x = np.tile(digits.data / 8.0 - 1.0, (repeats, 1))[:EXAMPLES]
        y = np.tile(digits.target, repeats)[:EXAMPLES]
    else:
        x = rng.standard_normal((EXAMPLES, widths[0]))
        y = rng.integers(0, widths[-1], EXAMPLES)
    arrays: dict[str, np.ndarray] = {
        "x": x.astype(np.float32),
        "y": y.astype(np.int64),
        "widths": np.asarray(widths, dtype=np.int64),
    }
    for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        bound = 1.0 / np.sqrt(n_in)
        arrays[f"w{i}"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32)
        arrays[f"b{i}"] = rng.uniform(-bound, bound, n_out).astype(np.float32)
    np.savez(path, **arrays)


# -- distribute ------------------------------------------------------------------------


def run_distribute(data: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    import distribute as ds

    torch.set_num_threads(1)
    widths = [int(w) for w in data["widths"]]
    layers = len(widths) - 1

    def build() -> torch.nn.Sequential:
        modules: list[torch.nn.Module] = []
        for i in range(layers):
            linear = torch.nn.Linear(widths[i], widths[i + 1])
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(data[f"w{i}"]))
                linear.bias.copy_(torch.from_numpy(data[f"b{i}"]))
            modules += [linear, torch.nn.ReLU()] if i < layers - 1 else [linear]
        return torch.nn.Sequential(*modules)

    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])

    # The custom loop.
    with strategy.scope():
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH, shuffle=False
    )

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses: list[float] = []
    batches = iter(strategy.experimental_distribute_dataset(loader))
    for _ in range(WARMUP):
        xb, yb = next(batches)
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(xb, yb)), axis=None)))
    began = time.perf_counter()
    timed = [strategy.reduce("sum", strategy.run(step, args=next(batches)), axis=None)]
    for _ in range(TIMED - 1):
        timed.append(strategy.reduce("sum", strategy.run(step, args=next(batches)), axis=None))
    losses += [float(v) for v in timed]  # read after the clock: TF's loop returns tensors too
    loop_seconds = time.perf_counter() - began
    weights = {
        name: parameter.detach().numpy().copy() for name, parameter in model.named_parameters()
    }

    # The same loop on MirroredStrategy's design in plain PyTorch, no library: two
    # replica threads with a model copy each (`_plain_replicas.py`), the floor of any
    # threaded replica design on this machine.
    from _plain_replicas import PlainReplicas, cross_entropy

    plain = PlainReplicas(
        build(),
        lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
        cross_entropy(GLOBAL_BATCH),
        2,
    )
    plain_losses: list[float] = []
    # Batches sliced from the tensors, as the library's read of a TensorDataset does
    # (NOTE [batched tensor datasets]), not DataLoader's default example by example.
    plain_batches = (
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, EXAMPLES, GLOBAL_BATCH)
    )
    for _ in range(WARMUP):
        xb, yb = next(plain_batches)
        plain_losses.append(float(plain.step(xb.chunk(2), yb.chunk(2))))
    began = time.perf_counter()
    plain_timed = []
    for _ in range(TIMED):
        xb, yb = next(plain_batches)
        plain_timed.append(plain.step(xb.chunk(2), yb.chunk(2)))
    plain_losses += [float(v) for v in plain_timed]
    plain_seconds = time.perf_counter() - began
    # And with no threads at all: the two replicas in turn on this thread.
    in_turn = []
    began = time.perf_counter()
    for i in range(WARMUP * GLOBAL_BATCH, EXAMPLES, GLOBAL_BATCH):  # the timed batches
        xb, yb = x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]
        in_turn.append(plain.step_in_turn(xb.chunk(2), yb.chunk(2)))
    in_turn_seconds = time.perf_counter() - began
    plain.close()

    # fit.
    with strategy.scope():
        keras_like = ds.Model(build())
        keras_like.compile(
            optimizer=torch.optim.SGD(keras_like.parameters(), lr=LR, momentum=MOMENTUM),
            loss=ds.training.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    epochs: list[float] = []

    class Clock(ds.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            epochs.append(time.perf_counter() - self.began)

    history = keras_like.fit(
        data["x"],
        data["y"],
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[Clock()],
    )
    return {
        "loop_steps_per_s": TIMED / loop_seconds,
        "loop_losses": losses,
        "plain_threads_steps_per_s": TIMED / plain_seconds,
        "plain_in_turn_steps_per_s": TIMED / in_turn_seconds,
        "plain_threads_losses_max_abs_diff": max(abs(a - b) for a, b in zip(losses, plain_losses)),
        "weights": [weights[k].tolist() for k in sorted(weights)],
        "fit_steps_per_s": (EXAMPLES // GLOBAL_BATCH) / epochs[1],
        "fit_losses": [float(v) for v in history.history["loss"]],
    }


# -- TensorFlow ------------------------------------------------------------------------


def run_tensorflow(data: dict[str, np.ndarray]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    widths = [int(w) for w in data["widths"]]
    layers = len(widths) - 1

    def build() -> Any:
        model = tf.keras.Sequential(
            [tf.keras.Input((widths[0],))]
            + [
                tf.keras.layers.Dense(widths[i + 1], activation="relu" if i < layers - 1 else None)
                for i in range(layers)
            ]
        )
        model.set_weights([a for i in range(layers) for a in (data[f"w{i}"].T, data[f"b{i}"])])
        return model

    # The custom loop.
    with strategy.scope():
        model = build()
        optimizer = tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        optimizer.build(model.trainable_variables)  # Keras 3: its slots made in the scope
    dataset = tf.data.Dataset.from_tensor_slices((data["x"], data["y"])).batch(GLOBAL_BATCH)
    batches = iter(strategy.experimental_distribute_dataset(dataset))

    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            per_example = tf.keras.losses.sparse_categorical_crossentropy(
                yb, logits, from_logits=True
            )
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(xb: Any, yb: Any) -> Any:
        return strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)

    losses: list[float] = []
    for _ in range(WARMUP):
        losses.append(float(train_step(*next(batches))))
    began = time.perf_counter()
    timed = [train_step(*next(batches)) for _ in range(TIMED)]
    losses += [float(v) for v in timed]
    loop_seconds = time.perf_counter() - began
    kernels = model.get_weights()
    # In torch's names' sorted order: 0.bias, 0.weight, 2.bias, 2.weight, 4.bias, ...
    weights = [a for i in range(layers) for a in (kernels[2 * i + 1], kernels[2 * i].T)]

    # fit.
    with strategy.scope():
        keras_model = build()
        keras_model.compile(
            optimizer=tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    epochs: list[float] = []

    class Clock(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            epochs.append(time.perf_counter() - self.began)

    history = keras_model.fit(
        data["x"],
        data["y"],
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[Clock()],
    )
    return {
        "loop_steps_per_s": TIMED / loop_seconds,
        "loop_losses": losses,
        "weights": [np.asarray(w).tolist() for w in weights],
        "fit_steps_per_s": (EXAMPLES // GLOBAL_BATCH) / epochs[1],
        "fit_losses": [float(v) for v in history.history["loss"]],
        "tensorflow": tf.__version__,
    }


# -- the driver ------------------------------------------------------------------------


def _side(python: str, side: str, data: Path, out: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [python, __file__, "--side", side, "--data", str(data), "--out", str(out)],
        env=env,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _largest_difference(a: list[Any], b: list[Any]) -> float:
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf-python", help="an interpreter with tensorflow installed")
    parser.add_argument("--runs", type=int, default=3, help="runs per side, alternating")
    parser.add_argument(
        "--model", choices=tuple(MODELS), default="mlp", help="mlp: 64-256-256-10; digits: 64-32-10"
    )
    parser.add_argument("--side", choices=("tf", "distribute"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:  # one side, in its own process
        data = dict(np.load(args.data))
        run = run_tensorflow if args.side == "tf" else run_distribute
        Path(args.out).write_text(json.dumps(run(data)))
        return
    if not args.tf_python:
        parser.error("--tf-python is required (an interpreter with tensorflow-cpu 2.21)")
    if args.model == "digits":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            parser.error("--model digits reads scikit-learn's digits: pip install scikit-learn")
    with tempfile.TemporaryDirectory(prefix="bench-vs-tf-") as tmp:
        data = Path(tmp, "inputs.npz")
        make_inputs(data, args.model)
        results: dict[str, list[dict[str, Any]]] = {"distribute": [], "tf": []}
        for run in range(args.runs):
            order = ("distribute", "tf") if run % 2 == 0 else ("tf", "distribute")
            for side in order:
                python = sys.executable if side == "distribute" else args.tf_python
                results[side].append(_side(python, side, data, Path(tmp, f"{side}-{run}.json")))
    ours, theirs = results["distribute"], results["tf"]
    config = (
        f"MirroredStrategy over 2 logical CPU devices, MLP {'-'.join(map(str, MODELS[args.model]))}"
        f"{' on digits' if args.model == 'digits' else ''}, "
        f"SGD lr {LR} momentum {MOMENTUM}, global batch {GLOBAL_BATCH}, "
        f"TensorFlow {theirs[0]['tensorflow']}, {args.runs} runs per side"
    )
    for figure in ("loop_steps_per_s", "fit_steps_per_s"):
        mine = statistics.median(r[figure] for r in ours)
        tf_side = statistics.median(r[figure] for r in theirs)
        print(
            json.dumps(
                {
                    "bench": figure.replace("_steps_per_s", ""),
                    "distribute_steps_per_s": round(mine, 1),
                    "tensorflow_steps_per_s": round(tf_side, 1),
                    "ratio": round(mine / tf_side, 3),
                    "runs": {
                        "distribute": [round(r[figure], 1) for r in ours],
                        "tensorflow": [round(r[figure], 1) for r in theirs],
                    },
                    "config": config,
                }
            )
        )
    floor = statistics.median(r["plain_threads_steps_per_s"] for r in ours)
    in_turn = statistics.median(r["plain_in_turn_steps_per_s"] for r in ours)
    tf_loop = statistics.median(r["loop_steps_per_s"] for r in theirs)
    tf_fit = statistics.median(r["fit_steps_per_s"] for r in theirs)
    print(
        json.dumps(
            {
                "bench": "plain_threads",
                "what": "the loop on two replica threads in plain PyTorch, no library "
                "(benchmarks/_plain_replicas.py): the threaded design's floor",
                "plain_threads_steps_per_s": round(floor, 1),
                "tensorflow_steps_per_s": round(tf_loop, 1),
                "ratio": round(floor / tf_loop, 3),
                "distribute_over_floor": round(
                    floor / statistics.median(r["loop_steps_per_s"] for r in ours), 3
                ),
                "runs": [round(r["plain_threads_steps_per_s"], 1) for r in ours],
                "in_turn_steps_per_s": round(in_turn, 1),
                "in_turn_vs_tensorflow": round(in_turn / tf_loop, 3),
                "floor_vs_keras_fit": round(floor / tf_fit, 3),
                "losses_max_abs_diff_to_distribute": max(
                    r["plain_threads_losses_max_abs_diff"] for r in ours
                ),
                "config": config,
            }
        )
    )
    print(
        json.dumps(
            {
                "bench": "agreement",
                "loop_losses_max_abs_diff": _largest_difference(
                    [ours[0]["loop_losses"]], [theirs[0]["loop_losses"]]
                ),
                "loop_final_weights_max_abs_diff": _largest_difference(
                    ours[0]["weights"], theirs[0]["weights"]
                ),
                "fit_epoch_losses": {
                    "distribute": ours[0]["fit_losses"],
                    "tensorflow": theirs[0]["fit_losses"],
                },
                "steps": WARMUP + TIMED,
            }
        )
    )


if __name__ == "__main__":
    main()
