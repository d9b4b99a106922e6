"""What the parts of tests/gpu/device_check.py share: the part protocol, sizes, models,
data, timing and comparisons.

A part is one function ``part(ctx)`` in a ``_check_*.py`` module, run by the driver as
``python tests/gpu/_check_<module>.py PART... --work DIR [--dry-run] [--budget S]``
(one part per process on a GPU; a module's parts share one in a dry run). It reports
through ``ctx.rec`` (`Recorder`): one JSON line per record, appended to
``DIR/records.jsonl`` and flushed at once, so that whatever a part recorded before it
hung or crashed reaches the report. Record kinds, each with the ``part`` it came from:

* ``check``: ``{"name", "status": "passed" | "failed: why" | "skipped: why", ...}``;
* ``figure``: a measurement with its baseline (never asserted);
* ``info``: anything else worth keeping (versions, compile counts);
* ``done``: the part returned (``seconds``, ``ok``); a part without one did not end.

An exception escaping a part is printed (traceback) and recorded as a failed check
named after the part; the next part still runs, and the process exits 1.

Sizes: on CUDA the real ones; in a dry run (``--dry-run``: CPU only, the same code)
tiny ones: the whole rehearsal costs about 30 CPU-seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _timing: the benchmarks' interleaving

from _timing import interleaved, quartiles  # noqa: E402

import distribute as ds  # noqa: E402

#: Parity tolerance asked by issue #26: same losses and weights within 1e-4.
ATOL = RTOL = 1e-4
CLASSES = 10


# -- the part protocol ----------------------------------------------------------------------


class Recorder:
    """Appends one JSON line per record to ``path`` (flushed), and echoes it to stdout.

    Every record carries ``part``: the part running when it was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.part = ""

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"part": self.part, **record}, default=str)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    def check(self, name: str, status: str, **fields: Any) -> None:
        """A check's outcome: ``passed``, ``failed: why`` or ``skipped: why``."""
        self.write({"kind": "check", "name": name, "status": status, **fields})

    def figure(self, name: str, **fields: Any) -> None:
        """A measurement, with its baseline in ``fields``."""
        self.write({"kind": "figure", "name": name, **fields})

    def info(self, name: str, **fields: Any) -> None:
        self.write({"kind": "info", "name": name, **fields})


@dataclass(frozen=True)
class Sizes:
    """How big and how long: the real run on a GPU, a rehearsal on the CPU."""

    parity_steps: int
    parity_batch: int
    resnet_width: int  # 64 is ResNet-18
    resnet_image: int  # 32: CIFAR-sized images
    resnet_batch: int
    mlp_layers: tuple[int, ...]  # the compile figure's MLP
    mlp_batch: int
    reps: int  # timed repetitions per case
    rep_seconds: float  # a repetition's target length (steps per repetition follow)
    max_steps_per_rep: int
    warmup_steps: int
    input_batches: int  # batches in the input figure's dataset
    sync_steps: int  # profiled steady-state steps


GPU_SIZES = Sizes(
    parity_steps=10,
    parity_batch=16,
    resnet_width=64,
    resnet_image=32,
    resnet_batch=128,
    mlp_layers=(512, 1024, 1024, 512, 10),
    mlp_batch=256,
    reps=21,
    rep_seconds=0.04,
    max_steps_per_rep=200,
    warmup_steps=5,
    input_batches=64,
    sync_steps=5,
)
DRY_SIZES = Sizes(
    parity_steps=4,
    parity_batch=8,
    resnet_width=4,
    resnet_image=8,
    resnet_batch=8,
    mlp_layers=(32, 64, 10),
    mlp_batch=16,
    reps=3,
    rep_seconds=0.005,
    max_steps_per_rep=3,
    warmup_steps=1,
    input_batches=8,
    sync_steps=3,
)


@dataclass
class Context:
    """What a part gets: where it runs, how big, where to report, until when."""

    dry_run: bool
    device: torch.device
    rec: Recorder
    sizes: Sizes
    deadline: float  # time.monotonic() by which the part should be done
    work: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def no_cuda_reason(self) -> str:
        """Why a CUDA-only check is skipped here."""
        if torch.cuda.is_available():
            return "skipped: no CUDA (dry run on the CPU)"
        return "skipped: no CUDA"

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        """Waits for the device (every stream), so a host clock read after it is honest."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def run_part(
    parts: Mapping[str, Callable[[Context], None]], argv: Sequence[str] | None = None
) -> int:
    """The command line of a ``_check_*.py`` module: runs the parts named, in turn, in
    this process (the driver names one per process on a GPU, several in a dry run);
    returns the exit code (1 when a part raised)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("parts", nargs="+", choices=sorted(parts))
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for each part")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.work / "records.jsonl")
    cuda = torch.cuda.is_available() and not args.dry_run
    if args.dry_run:
        torch.set_num_threads(1)  # 2 shared cores: more threads only spin against each other
    rec.info("environment", **environment())
    code = 0
    for name in args.parts:
        rec.part = name
        ctx = Context(
            dry_run=args.dry_run,
            device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
            rec=rec,
            sizes=DRY_SIZES if args.dry_run else GPU_SIZES,
            deadline=time.monotonic() + args.budget,
            work=args.work,
        )
        start = time.monotonic()
        ok = True
        try:
            parts[name](ctx)
        except Exception as exc:
            traceback.print_exc()
            rec.check(name, f"failed: {type(exc).__name__}: {exc}"[:2000])
            ok, code = False, 1
        rec.write({"kind": "done", "seconds": round(time.monotonic() - start, 1), "ok": ok})
    return code


def failure(what: str, exc: BaseException) -> str:
    """A failed status for ``what``, with the exception's type and message (traceback
    printed to the log)."""
    traceback.print_exc()
    return f"failed: {what}: {type(exc).__name__}: {exc}"[:2000]


# -- numerics ------------------------------------------------------------------------------


@contextlib.contextmanager
def exact_math() -> Iterator[None]:
    """No TF32, deterministic cuDNN (parity runs the same kernels as its reference)."""
    saved = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        (
            torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved


def math_settings() -> dict[str, Any]:
    """The precision settings in effect (recorded beside every figure)."""
    return {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def max_difference(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> tuple[float, list[str]]:
    """The largest absolute difference over every tensor, and the names outside
    ``ATOL + RTOL * |expected|`` (or of another shape or set of names)."""
    worst, bad = 0.0, []
    for name in sorted(set(actual) | set(expected)):
        if name not in actual or name not in expected:
            bad.append(f"{name} (missing on one side)")
            continue
        a = actual[name].detach().cpu().double()
        e = expected[name].detach().cpu().double()
        if a.shape != e.shape:
            bad.append(f"{name} (shape {tuple(a.shape)} vs {tuple(e.shape)})")
            continue
        if a.numel() == 0:
            continue
        diff = (a - e).abs()
        worst = max(worst, float(diff.max()))
        if not bool((diff <= ATOL + RTOL * e.abs()).all()) or not bool(torch.isfinite(a).all()):
            bad.append(f"{name} (max |diff| {float(diff.max()):.3g})")
    return worst, bad


def losses_difference(actual: Sequence[float], expected: Sequence[float]) -> tuple[float, bool]:
    """The largest absolute difference between two loss curves, and whether they agree."""
    if len(actual) != len(expected):
        return float("inf"), False
    diffs = [abs(a - e) for a, e in zip(actual, expected)]
    ok = all(d <= ATOL + RTOL * abs(e) for d, e in zip(diffs, expected))
    return max(diffs, default=0.0), ok


def two_workers_problems(
    results: Sequence[Mapping[str, Any]], key: str, expected: Mapping[str, Any]
) -> tuple[float, float, list[str]]:
    """Two workers' ``results[rank][key]`` (``losses``, ``state``) against one
    process's: the largest weight and loss differences, and what is wrong (rank 0
    away from one process, the ranks apart, a backend other than gloo)."""
    first, second = results[0][key], results[1][key]
    weights, bad = max_difference(first["state"], expected["state"])
    losses, losses_ok = losses_difference(first["losses"], expected["losses"])
    problems = []
    if bad:
        problems.append(f"weights differ from one process beyond 1e-4: {bad[:5]}")
    if not losses_ok:
        problems.append(f"losses {first['losses']} vs {expected['losses']}")
    differ = [n for n, t in first["state"].items() if not torch.equal(t, second["state"][n])]
    if differ:
        problems.append(f"ranks 0 and 1 differ in {differ[:5]}")
    if any(r["backend"] != "gloo" for r in results):
        problems.append(f"backends {[r['backend'] for r in results]}, expected gloo")
    return weights, losses, problems


def component(strategy: ds.Strategy, value: Any) -> torch.Tensor:
    """This process's first component of a variable or value (a tensor on its device)."""
    return torch.as_tensor(strategy.experimental_local_results(value)[0])


def module_state(strategy: ds.Strategy, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as CPU tensors, by name (replica 0's copies)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {n: component(strategy, v).detach().cpu().clone() for n, v in named}


# -- models --------------------------------------------------------------------------------


def bn_cnn() -> torch.nn.Module:
    """A small CNN with two BatchNorm2d layers, for 3x8x8 images (parity runs)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, CLASSES),
    )


def mlp(layers: Sequence[int]) -> torch.nn.Module:
    """Linear layers of the given widths with ReLU between (the benchmarks' MLPs)."""
    modules: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(layers)):
        if i:
            modules.append(torch.nn.ReLU())
        modules.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*modules)


#: The small model of the step figures: bench_mirrored.py's TINY (about 0.3 ms a step).
SMALL_LAYERS = (32, 64, 10)
SMALL_BATCH = 32


class BasicBlock(torch.nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut: torch.nn.Module = torch.nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet18(width: int = 64, classes: int = CLASSES) -> torch.nn.Module:
    """ResNet-18 (CIFAR stem: one 3x3 convolution, no max-pool), in plain torch since
    torchvision is not installed everywhere; ``width=64`` has 11.2M parameters."""
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, width, 3, 1, 1, bias=False),
        torch.nn.BatchNorm2d(width),
        torch.nn.ReLU(),
    ]
    cin = width
    for i, blocks in enumerate((2, 2, 2, 2)):
        cout = width * 2**i
        for b in range(blocks):
            layers.append(BasicBlock(cin, cout, 2 if (b == 0 and i > 0) else 1))
            cin = cout
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, classes)]
    return torch.nn.Sequential(*layers)


def parameters_m(module: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in module.parameters()) / 1e6, 3)


# -- data ----------------------------------------------------------------------------------


def batches(
    steps: int, batch: int, features: Sequence[int], seed: int = 7
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU batches of random features and class labels, a function of the seed only."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, *features, generator=g),
            torch.randint(0, CLASSES, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def loader(
    data: Sequence[tuple[torch.Tensor, torch.Tensor]], pin: bool
) -> torch.utils.data.DataLoader[Any]:
    """A DataLoader that yields exactly ``data``'s batches, in order (one gather each)."""
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=len(data[0][1]), pin_memory=pin
    )


# -- training ------------------------------------------------------------------------------


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {"sgd_momentum": sgd, "adam": adam}


def train_step(
    model: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    global_batch: int,
    autocast: torch.dtype | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The one training step every strategy and every baseline runs: cross-entropy
    scaled by the global batch, backward, step, zero_grad; returns the loss (no sync)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cast = (
            torch.autocast(x.device.type, dtype=autocast)
            if autocast is not None
            else contextlib.nullcontext()
        )
        with cast:
            per_example = F.cross_entropy(model(x), y, reduction="none")
            loss = ds.compute_average_loss(per_example.float(), global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: int,
    global_batch: int,
) -> float:
    """One step on one device that computes what ``replicas`` synchronous replicas do.

    BatchNorm normalizes each replica's own part of the batch (as in tf.distribute and
    DDP without SyncBatchNorm), so each part goes through the model on its own from the
    same running statistics; gradients accumulate (the sum over replicas); the running
    statistics become the mean of what each part left (integer buffers: the first
    part's), which is what the strategies' buffer sync does. Same as the helper of
    tests/gpu/test_mirrored_gpu.py.
    """
    buffers = dict(model.named_buffers())
    start = {k: b.detach().clone() for k, b in buffers.items()}
    ends: list[dict[str, torch.Tensor]] = []
    total = 0.0
    for xs, ys in zip(x.tensor_split(replicas), y.tensor_split(replicas)):
        with torch.no_grad():
            for k, b in buffers.items():
                b.copy_(start[k])
        loss = F.cross_entropy(model(xs), ys, reduction="none").sum() / global_batch
        loss.backward()
        total += float(loss.detach())
        ends.append({k: b.detach().clone() for k, b in buffers.items()})
    with torch.no_grad():
        for k, b in buffers.items():
            parts = [e[k] for e in ends]
            b.copy_(torch.stack(parts).mean(0) if b.is_floating_point() else parts[0])
    optimizer.step()
    optimizer.zero_grad()
    return total


def one_worker_strategy(comm: str = "auto") -> ds.MultiWorkerMirroredStrategy:
    """`MultiWorkerMirroredStrategy` as one worker of a torchrun cluster of one (NCCL
    asked for where ``comm="nccl"``). A world of one starts no process group: there
    is no other worker to reach."""
    from distribute import launch
    from distribute.cluster_resolver import TorchrunClusterResolver

    port = str(launch.free_ports(1)[0])
    resolver = TorchrunClusterResolver(
        environ={
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
    )
    impl = ds.experimental.CommunicationImplementation
    options = ds.experimental.CommunicationOptions(
        implementation=impl.NCCL if comm == "nccl" else impl.AUTO
    )
    return ds.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)


# -- timing --------------------------------------------------------------------------------


def steps_per_rep(ctx: Context, fns: Sequence[Callable[[], Any]]) -> int:
    """Steps per timed repetition so that the slowest case's repetition lasts about
    ``sizes.rep_seconds`` (each case is first run ``warmup_steps`` times, then timed
    three times, step by step)."""
    slowest = 0.0
    for fn in fns:
        for _ in range(ctx.sizes.warmup_steps):
            fn()
        ctx.sync()
        times = []
        for _ in range(3):  # the median of three: one hiccup does not set the length
            start = time.perf_counter()
            fn()
            ctx.sync()
            times.append(time.perf_counter() - start)
        slowest = max(slowest, statistics.median(times))
    wanted = int(ctx.sizes.rep_seconds / max(slowest, 1e-6))
    return max(1, min(ctx.sizes.max_steps_per_rep, wanted))


def time_cases(ctx: Context, cases: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Seconds per step of each case: repetitions of a fixed number of steps, the cases
    interleaved (order alternating), the device synchronized at the end of every
    repetition before the host clock is read (METHOD.md: a host clock is honest only
    after a synchronize). Returns ``{"samples": {name: [s/step, ...]}, "steps_per_rep"}``."""
    n = steps_per_rep(ctx, list(cases.values()))

    def chunk(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                fn()
            ctx.sync()

        return run

    ctx.sync()
    seconds = interleaved(
        {name: chunk(fn) for name, fn in cases.items()},
        ctx.sizes.reps,
        1,
        collect_each=not ctx.dry_run,  # a collection takes longer than a dry run's steps
    )
    return {"samples": {k: [t / n for t in v] for k, v in seconds.items()}, "steps_per_rep": n}


def ratio_fields(
    base: Sequence[float], cand: Sequence[float], higher_is_better: bool = False
) -> dict[str, Any]:
    """Medians (ms), the ratio of medians and the paired ratio with its quartiles.

    Time ratio (candidate / baseline, lower is better) by default; with
    ``higher_is_better`` a throughput ratio (baseline time / candidate time)."""
    b, c = statistics.median(base), statistics.median(cand)
    paired = [(x / y) if higher_is_better else (y / x) for x, y in zip(base, cand)]
    return {
        "baseline_ms": round(b * 1e3, 4),
        "distribute_ms": round(c * 1e3, 4),
        "ratio": round(b / c if higher_is_better else c / b, 4),
        "paired_ratio": round(statistics.median(paired), 4),
        "paired_ratio_iqr": [round(q, 4) for q in quartiles(paired)],
        "overhead_us": round((c - b) * 1e6, 1),
        "reps": len(paired),
    }


def environment() -> dict[str, Any]:
    """Versions and the device, for the report."""
    torchdata = importlib.util.find_spec("torchdata")
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "distribute_from": str(Path(ds.__file__).resolve().parent),
        "torchdata_from": torchdata.origin if torchdata is not None else None,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["device_name"] = "cpu"
    return info
