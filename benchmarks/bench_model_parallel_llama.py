"""ModelParallelStrategy on a Llama-style decoder stack against the same tensor
parallelism written by hand with torch's ``parallelize_module`` (step time), and with
Keras's output layouts as sequence parallelism (activation bytes per worker), in CPU
worker processes (gloo on 127.0.0.1, one thread each).

    python benchmarks/bench_model_parallel_llama.py               # 2 workers: a (1, 2) mesh
    python benchmarks/bench_model_parallel_llama.py --quick       # smoke run (small)

The model is L Llama-style decoder blocks (RMSNorm, attention with q/k/v/o projections
and causal ``scaled_dot_product_attention``, RMSNorm, SwiGLU MLP gate/up/down, residual
adds; no biases), the input a (batch, sequence, width) tensor, AdamW, the mean square
of the output as the loss (summed over the batch and divided by the global batch).
ModelParallelStrategy lays it out on a (1, W) mesh ("batch", "model"): q, k, v, gate,
up column-parallel (weight ``("model", None)``), o and down row-parallel (weight
``(None, "model")``), torch's styles recognised from the map. By hand: the same plan
through ``parallelize_module(block, init_device_mesh("cpu", (W,)), {...:
ColwiseParallel(), ...: RowwiseParallel()})``, torch's defaults (local outputs, the
attention's ``view(b, t, -1, head_dim)`` taking the local heads), the step called
directly. With output layouts: the same map plus ``("batch", "model", None)`` for
``blocks.N/output`` and ``blocks.N.(o|down)/output`` (the residual stream split along the
sequence between and inside the blocks, the norms run on the split sequence: Megatron's
sequence-parallel regions; the row-parallel outputs are summed whole and then split,
where Megatron reduce-scatters).

Prints JSON lines, the baseline beside each figure:

    step_vs_by_hand          one step (forward, backward, AdamW, zero_grad): the
                             strategy's `run` against parallelize_module by hand.
                             Goal: <= 1.05.
    activations_sequence_parallel
                             bytes of the tensors autograd saves for backward (unique
                             storages of the local tensors, one forward pass), with the
                             output layouts against without. Goal: <= 0.6 at W = 2.
    block_outputs_sequence_parallel
                             bytes of the blocks' outputs (the residual stream handed
                             from block to block), with the output layouts against
                             without. Goal: <= 0.6 at W = 2.
    step_sequence_parallel   the step with output layouts against without (reported).

The models live in one set of processes; their steps are interleaved
(`_timing.interleaved`, order alternating) after warm-up, and the medians of the
per-repetition times are reported with the paired ratio and its quartiles. Figures
taken while ``loadavg_1m_before`` is well above 1 on a 2-core machine are suspect.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _timing import emit, interleaved, quartiles

import distribute as ds
from distribute import launch

MiB = 2**20
NAMES = {
    "model_parallel": "ModelParallelStrategy",
    "by_hand": "parallelize_module by hand",
    "sequence_parallel": "ModelParallelStrategy with output layouts",
}


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.attn_norm = RMSNorm(width)
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, width, bias=False)
        self.v = torch.nn.Linear(width, width, bias=False)
        self.o = torch.nn.Linear(width, width, bias=False)
        self.mlp_norm = RMSNorm(width)
        self.gate = torch.nn.Linear(width, hidden, bias=False)
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(torch.nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width, heads, hidden) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _layout_map(world: int, sequence_parallel: bool) -> ds.experimental.LayoutMap:
    mesh = ds.experimental.DeviceMesh((1, world), ("batch", "model"))
    layouts = ds.experimental.LayoutMap(mesh)
    layouts[r"blocks\.\d+\.(q|k|v|gate|up)\.weight"] = ("model", None)  # column-parallel
    layouts[r"blocks\.\d+\.(o|down)\.weight"] = (None, "model")  # row-parallel
    if sequence_parallel:  # the residual stream split along the sequence (Megatron's SP regions)
        layouts[r"blocks\.\d+/output"] = ("batch", "model", None)
        layouts[r"blocks\.\d+\.(o|down)/output"] = ("batch", "model", None)
    return layouts


def _by_hand(model: Decoder, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
    plan: dict[str, Any] = {name: ColwiseParallel() for name in ("q", "k", "v", "gate", "up")}
    plan.update({name: RowwiseParallel() for name in ("o", "down")})
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _saved_bytes(model: Decoder, x: torch.Tensor) -> tuple[int, int]:
    """Unique storage bytes of the tensors autograd saves in one forward pass (this
    worker's local parts), parameters excluded; and the bytes of the blocks' outputs
    (the residual stream handed from block to block)."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0
    between = []
    handles = [
        block.register_forward_hook(lambda m, a, out: between.append(_local(out).nbytes))
        for block in model.blocks
    ]

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).pow(2).mean().backward()
    for p in model.parameters():
        p.grad = None
    for handle in handles:
        handle.remove()
    return total, sum(between)


class _Side:
    """One side's model, optimizer and step."""

    def __init__(self, strategy: Any, build: Any, x: torch.Tensor, batch: int) -> None:
        self.strategy = strategy
        if strategy is not None:
            with strategy.scope():
                self.model = build()
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        else:
            self.model = build()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.batch = x, batch

    def _step(self) -> None:
        per_example = self.model(self.x).pow(2).mean(dim=(1, 2))
        ds.compute_average_loss(per_example, global_batch_size=self.batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self) -> None:
        if self.strategy is None:
            self._step()
        else:
            self.strategy.run(self._step)

    def saved_bytes(self) -> tuple[int, int]:
        if self.strategy is None:
            return _saved_bytes(self.model, self.x)
        saved, between = self.strategy.run(_saved_bytes, args=(self.model, self.x))
        return int(saved), int(between)


def _worker(shape: dict[str, int], reps: int, calls: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    plain = ds.experimental.ModelParallelStrategy(_layout_map(world, False))  # makes the group
    sequence = ds.experimental.ModelParallelStrategy(_layout_map(world, True))  # adopts it
    width, heads, hidden, layers = shape["width"], shape["heads"], shape["hidden"], shape["layers"]
    x = torch.randn(shape["batch"], shape["seq"], width, generator=torch.Generator().manual_seed(1))

    def build() -> Decoder:
        torch.manual_seed(0)
        return Decoder(width, heads, hidden, layers)

    sides = {
        "model_parallel": _Side(plain, build, x, shape["batch"]),
        "by_hand": _Side(None, lambda: _by_hand(build(), world), x, shape["batch"]),
        "sequence_parallel": _Side(sequence, build, x, shape["batch"]),
    }
    saved = {name: side.saved_bytes() for name, side in sides.items()}
    seconds = interleaved(
        {name: side.step for name, side in sides.items()}, reps, calls, warmup_calls=warmup
    )
    return {"ms": {n: [s * 1000 for s in v] for n, v in seconds.items()}, "saved": saved}


def _time_line(
    bench: str, base: str, other: str, ms: dict[str, list[float]], common: dict[str, Any], goal: str
) -> dict[str, Any]:
    b, o = statistics.median(ms[base]), statistics.median(ms[other])
    paired = [d / r for r, d in zip(ms[base], ms[other])]
    q = quartiles(paired)
    return {
        "bench": bench,
        "baseline": NAMES[base],
        "baseline_ms": round(b, 2),
        "distribute": NAMES[other],
        "distribute_ms": round(o, 2),
        "ratio": round(o / b, 3),
        "paired_ratio": round(statistics.median(paired), 3),
        "paired_ratio_iqr": [round(q[0], 3), round(q[1], 3)],
        "reps": len(paired),
        "goal": goal,
        **common,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: small")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        shape = {"width": 128, "heads": 4, "hidden": 384, "layers": 2, "batch": 4, "seq": 32}
        reps, calls, warmup = 3, 1, 1
    else:
        shape = {"width": 512, "heads": 8, "hidden": 1408, "layers": 4, "batch": 8, "seq": 128}
        reps, calls, warmup = 12, 2, 2
    config = (
        f"{shape['layers']} Llama-style blocks (width {shape['width']}, {shape['heads']} heads, "
        f"SwiGLU {shape['hidden']}), input ({shape['batch']}, {shape['seq']}, {shape['width']}), "
        "AdamW, gloo, 1 thread per worker"
    )
    here = str(Path(__file__).resolve().parent)
    load = os.getloadavg()[0]
    results = launch.run(
        _worker,
        args.workers,
        args=(shape, reps, calls, warmup),
        timeout=1800,
        env={"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])},
    )
    common = {"workers": args.workers, "config": config, "loadavg_1m_before": round(load, 2)}
    ms = {
        name: [statistics.median(r["ms"][name][i] for r in results) for i in range(reps)]
        for name in NAMES
    }  # per repetition, the median over the workers
    emit(_time_line("step_vs_by_hand", "by_hand", "model_parallel", ms, common, "<= 1.05"))
    for index, bench in enumerate(
        ("activations_sequence_parallel", "block_outputs_sequence_parallel")
    ):
        saved = {name: max(r["saved"][name][index] for r in results) for name in NAMES}
        emit(
            {
                "bench": bench,
                "baseline": NAMES["model_parallel"],
                "baseline_mib": round(saved["model_parallel"] / MiB, 3),
                "distribute_mib": round(saved["sequence_parallel"] / MiB, 3),
                "by_hand_mib": round(saved["by_hand"] / MiB, 3),
                "ratio": round(saved["sequence_parallel"] / saved["model_parallel"], 3),
                "goal": "<= 0.6" if args.workers == 2 else "reported",
                **common,
            }
        )
    emit(
        _time_line(
            "step_sequence_parallel", "model_parallel", "sequence_parallel", ms, common, "reported"
        )
    )


if __name__ == "__main__":
    main()
