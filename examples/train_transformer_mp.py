"""Train a small transformer with model parallelism: Keras 3's layout map, on DTensor.

The attention and MLP projections of every block are split along the mesh's "model"
axis (column-parallel, then row-parallel: one all-reduce per pair); the batch is split
along its "batch" axis. The training step is one device's:

    python examples/train_transformer_mp.py                                # one CPU
    torchrun --nproc_per_node=2 examples/train_transformer_mp.py           # mesh (1, 2)
    torchrun --nproc_per_node=4 examples/train_transformer_mp.py           # mesh (1, 4)
    torchrun --nproc_per_node=4 examples/train_transformer_mp.py --mesh 2,2
    torchrun --nproc_per_node=4 examples/train_transformer_mp.py --mesh 2,2 --fully-shard

(or one process per device with a ``TF_CONFIG`` each, or under SLURM's ``srun``.)

The task is synthetic (nothing is downloaded): each sequence counts up from a random
token by a random stride, modulo the vocabulary, and the model predicts the next token.
The chief prints one JSON line: the losses, and the share of the weights each worker
holds.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

import distribute as ds

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 32, 64, 4, 2, 16


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.k = torch.nn.Linear(WIDTH, WIDTH)
        self.v = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            proj(x).view(b, t, HEADS, d // HEADS).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.norm2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Embedding(SEQ, WIDTH)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def layout_map(shape: tuple[int, int]) -> ds.experimental.LayoutMap:
    """Attention and MLP projections split along "model"; everything else whole."""
    layouts = ds.experimental.LayoutMap(ds.experimental.DeviceMesh(shape, ("batch", "model")))
    layouts[r"blocks\.\d+\.attn\.(q|k|v)\.weight"] = ("model", None)  # torch Linear weight: (out, in)
    layouts[r"blocks\.\d+\.attn\.(q|k|v)\.bias"] = ("model",)
    layouts[r"blocks\.\d+\.attn\.out\.weight"] = (None, "model")
    layouts[r"blocks\.\d+\.mlp\.up\.weight"] = ("model", None)
    layouts[r"blocks\.\d+\.mlp\.up\.bias"] = ("model",)
    layouts[r"blocks\.\d+\.mlp\.down\.weight"] = (None, "model")
    return layouts


def dataset(examples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (examples, 1), generator=g)
    stride = torch.randint(1, 4, (examples, 1), generator=g)
    sequences = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return torch.utils.data.TensorDataset(sequences[:, :-1], sequences[:, 1:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default=None, help="batch,model sizes; default 1,<workers>")
    parser.add_argument("--fully-shard", action="store_true", help="FSDP2 along the batch axis")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--examples", type=int, default=512)
    args = parser.parse_args(argv)
    resolver = ds.cluster_resolver.resolve_cluster()  # torchrun, TF_CONFIG or SLURM
    workers = resolver.world_size if resolver is not None else 1
    shape = tuple(int(n) for n in args.mesh.split(",")) if args.mesh else (1, workers)
    strategy = ds.experimental.ModelParallelStrategy(
        layout_map((shape[0], shape[1])), cluster_resolver=resolver, fully_shard=args.fully_shard
    )

    torch.manual_seed(0)  # the chief's initial values are every worker's
    with strategy.scope():
        model = Transformer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(dataset(args.examples), batch_size=args.batch_size)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(tokens)
        per_example = (
            F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
            .view(len(tokens), -1)
            .mean(dim=1)
        )
        loss = ds.compute_average_loss(per_example, global_batch_size=args.batch_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for _ in range(args.epochs):
        total, steps = 0.0, 0
        for tokens, targets in strategy.experimental_distribute_dataset(loader):
            total += float(strategy.reduce("sum", strategy.run(step, args=(tokens, targets))))
            steps += 1
        losses.append(total / steps)

    held = sum(p.to_local().numel() for p in model.parameters())
    result = {
        "losses": losses,
        "final_loss": losses[-1],
        "mesh": list(shape),
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "weights_held": round(held / sum(p.numel() for p in model.parameters()), 3),
    }
    if strategy.is_chief:
        print(json.dumps(result), flush=True)
    strategy.shutdown()
    return result


if __name__ == "__main__":
    main()
