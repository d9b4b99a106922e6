"""Train a small classifier on scikit-learn's digits, tf.distribute style.

The training step is written once; only the strategy object changes:

    python examples/train_digits.py                          # MirroredStrategy, 2 CPU replicas
    python examples/train_digits.py --strategy default        # no distribution at all
    python examples/train_digits.py --strategy one_device --device cpu
    python examples/train_digits.py --strategy mirrored --replicas 4  # 4 logical CPU replicas
    python examples/train_digits.py --strategy central_storage --replicas 2
    torchrun --nproc_per_node=2 examples/train_digits.py --strategy multi_worker
    torchrun --nproc_per_node=2 examples/train_digits.py --strategy fully_sharded  # FSDP2
    python examples/train_digits.py --checkpoint-dir /tmp/digits  # stop it, run again: resumes
    python examples/train_digits.py --api fit                # Keras-style model.fit
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .xla-venv/bin/python examples/train_digits.py \
        --strategy tpu [--spmd]           # TPUStrategy on torch_xla (see the README)
    python examples/train_digits.py --strategy parameter_server   # starts 2 workers + 1 ps here
    python -m distribute.coordinator.launch --workers 2 --ps 1 -- \
        examples/train_digits.py --strategy parameter_server     # the cluster from TF_CONFIG
    python examples/train_digits.py --strategy parameter_server_v1  # compat.v1: 2 workers' loops

The data (1,797 8x8 images) ships with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import distribute as ds

STRATEGIES = (
    "default",
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker",
    "fully_sharded",
    "tpu",
    "parameter_server",
    "parameter_server_v1",
)


def make_strategy(name: str, replicas: int | None, device: str, spmd: bool = False) -> ds.Strategy:
    """The only line that differs between one CPU, several replicas and several workers."""
    if replicas is None:  # several logical replicas in one process; one per worker process
        replicas = 1 if name in ("multi_worker", "fully_sharded") else 2
    logical = [f"{device}:{i}" for i in range(replicas)] if device == "cpu" else None
    if name == "default":
        return ds.get_strategy()
    if name == "one_device":
        return ds.OneDeviceStrategy(device)
    if name == "mirrored":
        return ds.MirroredStrategy(logical)
    if name == "central_storage":
        return ds.CentralStorageStrategy(logical)
    if name == "multi_worker":
        return ds.MultiWorkerMirroredStrategy(devices=logical if replicas > 1 else None)
    if name == "fully_sharded":  # one replica per process; each holds 1/N of the weights
        return ds.experimental.FullyShardedStrategy()
    if name == "tpu":  # every XLA device: one replica each, or one SPMD program
        return ds.TPUStrategy(experimental_spmd_xla_partitioning=spmd)
    raise SystemExit(f"unknown --strategy {name!r}; choose from {', '.join(STRATEGIES)}")


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class Progress:
    """A tqdm bar per epoch on a terminal; one plain line per epoch elsewhere.

    tqdm redraws its bar with carriage returns, which a log file keeps as one line
    of every intermediate bar; so when stderr is not a terminal the bar is off and
    the epoch's summary is written once, at its end.
    """

    def __init__(self, epoch: int, epochs: int, steps: int) -> None:
        self.label = f"epoch {epoch + 1}/{epochs}"
        self.steps = steps
        self.done = 0
        self.loss = float("nan")
        self.start = time.perf_counter()
        self.bar = tqdm(
            total=steps,
            desc=self.label,
            unit="step",
            file=sys.stderr,
            leave=True,
            disable=not sys.stderr.isatty(),
        )

    def update(self, step: int, loss: float) -> None:
        self.bar.update(step - self.done)
        self.done, self.loss = step, loss
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self, accuracy: float, examples: int) -> None:
        summary = f"test accuracy {accuracy:.2%} ({examples} examples)"
        if self.bar.disable:
            seconds = time.perf_counter() - self.start
            sys.stderr.write(
                f"{self.label} - {self.done}/{self.steps} steps - loss {self.loss:.4f} - "
                f"{summary} - {seconds:.1f}s\n"
            )
        else:
            self.bar.set_postfix_str(f"loss={self.loss:.4f}, {summary}")
            self.bar.close()


def make_parser() -> argparse.ArgumentParser:
    """The example's command line (the docs tests check the guides' commands with it)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--strategy",
        default="mirrored",
        choices=STRATEGIES,
        help="mirrored (the default): 2 logical CPU replicas in this process",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="logical CPU replicas per process (default: 2, or 1 with multi_worker "
        "and fully_sharded)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--spmd", action="store_true", help="with --strategy tpu: one SPMD program over the devices"
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save here every --checkpoint-every steps and at each epoch's end; "
        "started again, training resumes from the latest checkpoint",
    )
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument(
        "--api",
        default="loop",
        choices=("loop", "fit"),
        help="loop: the custom training loop below; fit: ds.Model's Keras-style fit",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    if args.strategy == "parameter_server":
        return main_parameter_server(args)
    if args.strategy == "parameter_server_v1":
        return main_parameter_server_v1(args, argv)
    if args.api == "fit":
        return main_fit(args)

    strategy = make_strategy(args.strategy, args.replicas, args.device, args.spmd)
    resolver = strategy.cluster_resolver
    is_chief = resolver is None or resolver.rank == 0
    show = is_chief and not args.quiet
    train_set, test_set = load_data(args.seed)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    torch.manual_seed(args.seed)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        correct = ds.Variable(
            0,
            synchronization=ds.VariableSynchronization.ON_READ,
            aggregation=ds.VariableAggregation.SUM,
        )
        seen = ds.Variable(
            0,
            synchronization=ds.VariableSynchronization.ON_READ,
            aggregation=ds.VariableAggregation.SUM,
        )

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=args.batch_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def test_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        with torch.no_grad():
            correct.assign_add((model(x).argmax(dim=1) == y).sum())
            seen.assign_add(y.numel())

    train_dist = strategy.experimental_distribute_dataset(train_loader)
    test_dist = strategy.experimental_distribute_dataset(test_loader)
    steps = len(train_loader)
    # What a resumed run needs: the weights, the optimizer's moments, where the
    # input is (epoch, batch, shuffle), the random generators, and the epoch.
    checkpoint = ds.Checkpoint(model=model, optimizer=optimizer, rng=ds.RNGState(), epoch=0)
    manager = None
    if args.checkpoint_dir:
        manager = ds.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)
        if manager.latest_checkpoint:
            checkpoint.restore(manager.latest_checkpoint)  # `data` is placed when attached
            if show:
                sys.stderr.write(f"resumed from {manager.latest_checkpoint}\n")
    history = []
    start = time.perf_counter()
    checkpoint.data = batches = iter(train_dist)  # at the saved batch after a resume
    for epoch in range(checkpoint.epoch, args.epochs):
        total, n = 0.0, 0
        bar = Progress(epoch, args.epochs, steps) if show else None
        for batch in batches:
            loss = strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None)
            total, n = total + float(loss), n + 1
            if manager is not None and batches.steps % args.checkpoint_every == 0:
                manager.save()
            if bar is not None:
                bar.update(batches.steps, total / n)
        checkpoint.epoch = epoch + 1
        checkpoint.data = batches = iter(train_dist)  # saved at the next epoch's start
        if manager is not None:
            manager.save()
        with strategy.scope():
            correct.assign(0)
            seen.assign(0)
        for batch in test_dist:
            strategy.run(test_step, args=(batch,))
        with strategy.scope():
            accuracy = float(correct.read_value()) / max(float(seen.read_value()), 1.0)
            examples = int(seen.read_value())
        history.append({"epoch": epoch + 1, "loss": total / max(n, 1), "test_accuracy": accuracy})
        if bar is not None:
            bar.close(accuracy, examples)
    if not history:
        raise SystemExit(f"nothing to train: the checkpoint already finished {args.epochs} epochs")
    result = {
        "strategy": args.strategy,
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "final_loss": history[-1]["loss"],
        "test_accuracy": history[-1]["test_accuracy"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    if is_chief:
        print(json.dumps(result))
    return result


def main_fit(args: argparse.Namespace) -> dict[str, Any]:
    """The same training with `ds.Model.fit` instead of the custom loop."""
    strategy = make_strategy(args.strategy, args.replicas, args.device, args.spmd)
    resolver = strategy.cluster_resolver
    is_chief = resolver is None or resolver.rank == 0
    train_set, test_set = load_data(args.seed)
    x, y = train_set.tensors
    torch.manual_seed(args.seed)
    with strategy.scope():
        model = ds.Model(
            torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        )
    model.compile(
        optimizer=lambda params: torch.optim.Adam(params, lr=args.lr),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
    )
    callbacks = []
    if args.checkpoint_dir:
        callbacks.append(ds.callbacks.BackupAndRestore(args.checkpoint_dir))
    start = time.perf_counter()
    history = model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=test_set.tensors,
        callbacks=callbacks,
        verbose=0 if args.quiet else "auto",
    )
    result = {
        "strategy": args.strategy,
        "api": "fit",
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "final_loss": history.history["loss"][-1],
        "test_accuracy": history.history["val_accuracy"][-1],
        "seconds": round(time.perf_counter() - start, 2),
    }
    if is_chief:
        print(json.dumps(result))
    return result


def main_parameter_server(args: argparse.Namespace) -> dict[str, Any]:
    """Asynchronous training: the chief schedules steps, workers run them, ps tasks
    hold the variables. The cluster comes from TF_CONFIG, else starts here."""
    import os

    cluster = None
    if "TF_CONFIG" in os.environ:
        resolver: Any = ds.cluster_resolver.TFConfigClusterResolver()
    else:
        cluster = ds.coordinator.LocalCluster(num_workers=2, num_ps=1)
        resolver = cluster.resolver
    strategy = ds.ParameterServerStrategy(resolver)
    train_set, test_set = load_data(args.seed)
    torch.manual_seed(args.seed)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    coordinator = ds.coordinator.ClusterCoordinator(strategy)
    batch_size = args.batch_size

    def dataset_fn() -> Any:  # runs on each worker: its own shuffled stream of batches
        loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True)
        while True:
            yield from loader

    iterators = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def train_step(iterator: Any) -> float:
        x, y = next(iterator)
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=batch_size)
        loss.backward()
        optimizer.step()  # the update is applied on the ps
        optimizer.zero_grad()
        return float(loss.detach())

    steps = len(train_set) // batch_size
    start = time.perf_counter()
    history = []
    for epoch in range(args.epochs):
        losses = [coordinator.schedule(train_step, args=(iterators,)) for _ in range(steps)]
        coordinator.join()  # also refreshes the chief's copies of the variables
        loss = sum(coordinator.fetch(losses)) / steps
        x, y = test_set.tensors
        with torch.no_grad():
            accuracy = float((model(x).argmax(dim=1) == y).float().mean())
        history.append({"epoch": epoch + 1, "loss": loss, "test_accuracy": accuracy})
        if not args.quiet:
            sys.stderr.write(
                f"epoch {epoch + 1}/{args.epochs} loss {loss:.4f} acc {accuracy:.2%}\n"
            )
    strategy.shutdown()
    if cluster is not None:
        cluster.wait()
    result = {
        "strategy": "parameter_server",
        "workers": len(resolver.cluster_spec().as_dict()["worker"]),
        "final_loss": history[-1]["loss"],
        "test_accuracy": history[-1]["test_accuracy"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(result))
    return result


def main_parameter_server_v1(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """The compat.v1 style: every worker runs this loop on its share of the data,
    its 2 local replicas in sync, the workers asynchronous; ps tasks hold the
    variables. Without TF_CONFIG, starts 2 workers (this script) and 1 ps here."""
    import os

    if "TF_CONFIG" not in os.environ:
        from distribute.coordinator.local import main as launch

        own = list(sys.argv[1:] if argv is None else argv)
        code = launch(["--v1", "--workers", "2", "--ps", "1", "--", __file__, *own])
        raise SystemExit(code)
    strategy = ds.compat.v1.ParameterServerStrategy(devices=["cpu:0", "cpu:1"])
    resolver = strategy.cluster_resolver
    index, workers = resolver.task_id, len(resolver.cluster_spec().as_dict()["worker"])
    train_set, test_set = load_data(args.seed)
    mine = torch.utils.data.Subset(train_set, range(index, len(train_set), workers))
    loader = DataLoader(
        mine,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed + index),
    )
    torch.manual_seed(args.seed)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        global_step = ds.Variable(
            0, trainable=False, aggregation=ds.VariableAggregation.ONLY_FIRST_REPLICA
        )

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ds.compute_average_loss(per_example, global_batch_size=args.batch_size)
        loss.backward()
        optimizer.step()  # the local replicas' sum, applied on the ps
        optimizer.zero_grad()
        global_step.assign_add(1)  # once per step of this worker (its first replica)
        return loss.detach()

    start = time.perf_counter()
    dataset = strategy.experimental_distribute_dataset(loader)
    for _ in range(args.epochs):
        for batch in dataset:
            loss = float(strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None))
    x, y = test_set.tensors
    accuracy = strategy.run(
        lambda: float((model(x).argmax(dim=1) == y).float().mean())
    )  # run reads the latest values first
    result = {
        "strategy": "parameter_server_v1",
        "worker": index,
        "final_loss": loss,
        "test_accuracy": strategy.experimental_local_results(accuracy)[0],
        "global_step": int(global_step.read_value()),
        "seconds": round(time.perf_counter() - start, 2),
    }
    strategy.shutdown()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
