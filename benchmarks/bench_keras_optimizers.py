"""Every Keras optimizer through TensorFlow's Keras 3 and through `ds.optimizers`, from
the same numbers: how far apart they end.

TensorFlow lives in its own environment (see `bench_vs_tensorflow.py`), so each side
runs in its own process, this file again with ``--side``; both read one ``.npz``.

    python -m venv ~/.cache/distribute/tf-venv
    ~/.cache/distribute/tf-venv/bin/pip install tensorflow-cpu==2.21.0
    python benchmarks/bench_keras_optimizers.py --tf-python ~/.cache/distribute/tf-venv/bin/python

Each optimizer by its Keras name (Keras's defaults), float32, on the CPU, one thread:

    update  the same 300 gradient pairs (a 32x16 kernel and a 16-bias, drawn once)
            applied by ``apply_gradients`` in a ``tf.function`` (as Keras's ``fit``
            runs it) and by ``optimizer.step()``: only the optimizers' arithmetic
            can differ. ``update_vs_eager``: against ``apply_gradients`` run
            eagerly (no Grappler rewriting the graph).
    fit     ``model.fit`` of an MLP 64-32-10 on scikit-learn's digits (1,797 images
            scaled to [-1, 1], batch 32, 5 epochs: 285 steps, unshuffled) from the
            same initial weights: the forward and backward passes differ too.

Prints one JSON line per optimizer: ``update``'s largest absolute difference of the
final variables, the largest distance in units in the last place, the share of
elements equal bit for bit; ``fit``'s largest absolute difference of the final
weights and of the logits on the 1,797 images. Never a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

NAMES = (
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "ftrl",
    "lion",
    "nadam",
    "rmsprop",
    "sgd",
)
STEPS = 300
KERNEL = (32, 16)
WIDTHS = (64, 32, 10)
BATCH, EPOCHS = 32, 5


def make_inputs(path: Path) -> None:
    """Gradients and variables for ``update``; digits and initial weights (torch's
    layout, ``(out, in)``) for ``fit``."""
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(0)
    digits = load_digits()
    arrays: dict[str, np.ndarray] = {
        "kernel": rng.normal(size=KERNEL).astype(np.float32),
        "bias": rng.normal(size=KERNEL[1]).astype(np.float32),
        "grad_kernel": (rng.normal(size=(STEPS, *KERNEL)) * 0.1).astype(np.float32),
        "grad_bias": (rng.normal(size=(STEPS, KERNEL[1])) * 0.1).astype(np.float32),
        # [-1, 1]: no pixel is 0 in every image (Keras's Adafactor divides 0 by 0
        # where an always-zero input meets a dead unit, and then TF's ReLU turns the
        # NaN into 0 where torch's keeps it).
        "x": (digits.data / 8.0 - 1.0).astype(np.float32),
        "y": digits.target.astype(np.int64),
    }
    for i, (n_in, n_out) in enumerate(itertools.pairwise(WIDTHS)):
        bound = 1.0 / np.sqrt(n_in)
        arrays[f"w{i}"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32)
        arrays[f"b{i}"] = rng.uniform(-bound, bound, n_out).astype(np.float32)
    np.savez(path, **arrays)


# -- distribute ------------------------------------------------------------------------


def run_distribute(data: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    import distribute as ds

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in NAMES:
        params = [torch.nn.Parameter(torch.from_numpy(data[k].copy())) for k in ("kernel", "bias")]
        optimizer = ds.optimizers.get(name, params)
        for t in range(STEPS):
            params[0].grad = torch.from_numpy(data["grad_kernel"][t])
            params[1].grad = torch.from_numpy(data["grad_bias"][t])
            optimizer.step()
        update = [p.detach().numpy().tolist() for p in params]

        layers: list[torch.nn.Module] = []
        for i in range(len(WIDTHS) - 1):
            linear = torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1])
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(data[f"w{i}"]))
                linear.bias.copy_(torch.from_numpy(data[f"b{i}"]))
            layers += [linear, torch.nn.ReLU()]
        model = ds.Model(torch.nn.Sequential(*layers[:-1]))
        model.compile(
            optimizer=name,
            loss=ds.training.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(data["x"], data["y"], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        with torch.no_grad():
            logits = model.module(torch.from_numpy(data["x"])).numpy()
        weights = [
            a.detach().numpy().tolist()
            for i in range(0, len(layers) - 1, 2)
            for a in (layers[i].weight, layers[i].bias)  # type: ignore[union-attr]
        ]
        out[name] = {"update": update, "weights": weights, "logits": logits.tolist()}
    return out


# -- TensorFlow ------------------------------------------------------------------------


def run_tensorflow(data: dict[str, np.ndarray]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    grad_kernel, grad_bias = tf.constant(data["grad_kernel"]), tf.constant(data["grad_bias"])
    out: dict[str, Any] = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for name in NAMES:
        update: dict[str, Any] = {}
        for mode in ("function", "eager"):
            variables = [keras.Variable(data[k], name=k) for k in ("kernel", "bias")]
            optimizer = keras.optimizers.get(name)
            optimizer.build(variables)  # its slots made outside the tf.function
            apply = _apply(tf, optimizer, variables, compiled=mode == "function")
            for t in range(STEPS):
                apply(grad_kernel[t], grad_bias[t])
            update[mode] = [np.asarray(v).tolist() for v in variables]

        model = keras.Sequential(
            [keras.Input((WIDTHS[0],))]
            + [
                keras.layers.Dense(w, activation="relu" if i < len(WIDTHS) - 2 else None)
                for i, w in enumerate(WIDTHS[1:])
            ]
        )
        model.set_weights(
            [a for i in range(len(WIDTHS) - 1) for a in (data[f"w{i}"].T, data[f"b{i}"])]
        )
        model.compile(
            optimizer=name,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(data["x"], data["y"], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        logits = model.predict(data["x"], verbose=0)
        kernels = model.get_weights()
        weights = [
            a.tolist()
            for i in range(len(WIDTHS) - 1)
            for a in (kernels[2 * i].T, kernels[2 * i + 1])
        ]
        out[name] = {"update": update, "weights": weights, "logits": logits.tolist()}
    return out


def _apply(tf: Any, optimizer: Any, variables: list[Any], compiled: bool) -> Any:
    """``optimizer.apply_gradients`` of a kernel's and a bias's gradient, in a
    ``tf.function`` (as Keras's ``fit`` runs it) or eagerly."""

    def apply(grad_kernel: Any, grad_bias: Any) -> None:
        optimizer.apply_gradients(zip((grad_kernel, grad_bias), variables))

    return tf.function(apply) if compiled else apply


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


def _apart(ours: list[Any], theirs: list[Any]) -> dict[str, float]:
    """Largest absolute difference, largest distance in float32 units in the last
    place, and the share of elements equal bit for bit."""
    a = np.concatenate([np.asarray(x, np.float32).ravel() for x in ours])
    b = np.concatenate([np.asarray(x, np.float32).ravel() for x in theirs])
    ulps = np.abs(a.astype(np.float64) - b) / np.spacing(np.abs(b)).astype(np.float64)
    return {
        "max_abs_diff": float(np.max(np.abs(a - b))),
        "max_ulps": float(np.max(ulps)),
        "bitwise_equal": round(float(np.mean(a == b)), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tf-python", help="an interpreter with tensorflow installed")
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
    with tempfile.TemporaryDirectory(prefix="bench-optimizers-") as tmp:
        data = Path(tmp, "inputs.npz")
        make_inputs(data)
        ours = _side(sys.executable, "distribute", data, Path(tmp, "distribute.json"))
        theirs = _side(args.tf_python, "tf", data, Path(tmp, "tf.json"))
    versions = f"TensorFlow {theirs['tensorflow']}, Keras {theirs['keras']}"
    for name in NAMES:
        update = _apart(ours[name]["update"], theirs[name]["update"]["function"])
        eager = _apart(ours[name]["update"], theirs[name]["update"]["eager"])
        weights = _apart(ours[name]["weights"], theirs[name]["weights"])
        logits = _apart([ours[name]["logits"]], [theirs[name]["logits"]])
        print(
            json.dumps(
                {
                    "bench": "optimizer_vs_keras",
                    "optimizer": name,
                    "update": {"steps": STEPS, **update},
                    "update_vs_eager": eager,
                    "fit": {
                        "steps": EPOCHS * -(-len(ours[name]["logits"]) // BATCH),
                        "weights_max_abs_diff": weights["max_abs_diff"],
                        "logits_max_abs_diff": logits["max_abs_diff"],
                    },
                    "versions": versions,
                }
            )
        )


if __name__ == "__main__":
    main()
