"""The two examples of tf.distribute.TPUStrategy's reference page, in PyTorch.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .xla-venv/bin/python examples/tpu_seed_examples.py

On a TPU host, drop the two variables (torch_xla finds the TPU). Prints one JSON line
per example.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

import distribute as ds


def custom_training_loop() -> dict[str, Any]:
    """TPUStrategy with a custom loop over `distribute_datasets_from_function`."""
    tpu_cluster_resolver = ds.cluster_resolver.TPUClusterResolver()
    ds.tpu.initialize_tpu_system(tpu_cluster_resolver)
    strategy = ds.TPUStrategy(tpu_cluster_resolver)

    def dataset_fn(ctx: ds.InputContext) -> Any:
        x = np.random.default_rng(ctx.input_pipeline_id).random((2, 5)).astype(np.float32)
        y = np.random.default_rng(1).integers(2, size=(2, 1))
        pairs = list(zip(torch.from_numpy(x), torch.from_numpy(y).float()))

        def repeat_batch_1() -> Any:  # dataset.repeat().batch(1, drop_remainder=True)
            while True:
                for features, labels in pairs:
                    yield features[None], labels[None]

        return repeat_batch_1()

    dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(dist_dataset)

    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(5, 1), torch.nn.Sigmoid())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(iterator: Any) -> Any:
        def step_fn(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            features, labels = inputs
            logits = model(features)
            loss = torch.nn.functional.binary_cross_entropy(logits, labels, reduction="none")
            loss = ds.compute_average_loss(loss.mean(dim=1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        return strategy.run(step_fn, args=(next(iterator),))

    losses = [float(strategy.reduce("sum", train_step(iterator), axis=None)) for _ in range(20)]
    return {"example": "custom_training_loop", "first_loss": losses[0], "last_loss": losses[-1]}


def logical_devices() -> dict[str, Any]:
    """A device assignment of 2 logical devices per replica, and an op placed on one."""
    resolver = ds.cluster_resolver.TPUClusterResolver(tpu="")
    topology = ds.tpu.initialize_tpu_system(resolver)
    device_assignment = ds.tpu.DeviceAssignment.build(
        topology,
        computation_shape=[1, 1, 1, 2],
        num_replicas=topology.num_tpus_per_task // 2,  # 4 on a v3-8; 2 on 4 CPU devices
    )
    strategy = ds.TPUStrategy(resolver, experimental_device_assignment=device_assignment)
    inputs = [torch.ones(strategy.num_replicas_in_sync, 3)]
    iterator = iter(strategy.experimental_distribute_dataset(inputs))

    def step_fn(inputs: torch.Tensor) -> torch.Tensor:
        output = torch.add(inputs, inputs)
        # Add operation will be executed on logical device 0.
        output = strategy.experimental_assign_to_logical_device(output, 0)
        return output

    result = strategy.run(step_fn, args=(next(iterator),))
    local = strategy.experimental_local_results(result)
    return {
        "example": "logical_devices",
        "num_replicas": device_assignment.num_replicas,
        "devices": [str(t.device) for t in local],
        "values": [t.cpu().tolist() for t in local],
    }


if __name__ == "__main__":
    for example in (custom_training_loop, logical_devices):
        print(json.dumps(example()))
