"""FSDP2 applied by hand as `FullyShardedStrategy` applies it, without the library:
the baseline of `bench_sharded.py` and of the GPU check's sharded parts.

Imported, like `_timing`, with this directory first on ``sys.path``.
"""

from __future__ import annotations

import torch


def fsdp_by_hand(model: torch.nn.Sequential, device_type: str = "cpu") -> torch.nn.Module:
    """Shards ``model`` (a Sequential of Linear layers and activations) in place: the
    Linear layers and the root as units over the default group, ZeRO-3, gradients
    summed (NOTE [sharding]); FSDP's own collectives, not watched ones.

    Example::

        model = fsdp_by_hand(torch.nn.Sequential(torch.nn.Linear(8, 8)), "cpu")
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_reduce_scatter_unused_params"):  # as the strategy
                module.set_reduce_scatter_unused_params(True, recurse=False)
    return model
