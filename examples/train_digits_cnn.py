"""A small convolutional network on scikit-learn's digits, with the Keras-style API.

    python examples/train_digits_cnn.py                               # 2 logical CPU replicas
    python examples/train_digits_cnn.py --strategy one_device
    torchrun --nproc_per_node=2 examples/train_digits_cnn.py --strategy multi_worker

Build the model in the strategy's scope, compile, fit: the strategy splits every
global batch across its replicas and sums the gradients. The 8x8 images ship with
scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from sklearn.datasets import load_digits

import distribute as ds


def make_strategy(name: str) -> ds.Strategy:
    if name == "one_device":
        return ds.OneDeviceStrategy("cpu")
    if name == "multi_worker":
        return ds.MultiWorkerMirroredStrategy()
    return ds.MirroredStrategy(["cpu:0", "cpu:1"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--strategy", default="mirrored", choices=("mirrored", "one_device", "multi_worker")
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch size")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], labels[order]

    strategy = make_strategy(args.strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = ds.Model(
            torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1),
                torch.nn.BatchNorm2d(16),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),  # 4 x 4
                torch.nn.Conv2d(16, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(32, 10),
            )
        )
    model.compile(
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss=ds.training.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = model.fit(
        images,
        labels,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_split=0.2,
        verbose=0 if args.quiet else "auto",
    )
    result = {
        "strategy": args.strategy,
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "final_loss": history.history["loss"][-1],
        "validation_accuracy": history.history["val_accuracy"][-1],
        "seconds": round(time.perf_counter() - start, 2),
    }
    resolver = strategy.cluster_resolver
    if resolver is None or resolver.rank == 0:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
