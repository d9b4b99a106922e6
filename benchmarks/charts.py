"""Charts of the benchmark figures for the documentation's performance page.

Reads the JSON lines the benchmarks print (stored under ``benchmarks/results/``; see
its README for where each file comes from) and draws two PNGs:

- ``speed.png``: speed against the baselines, as a ratio (> 1: faster):
  `MirroredStrategy`'s custom loop and ``ds.Model.fit`` against TensorFlow 2.21's
  (``bench_vs_tensorflow.py``: steps per second), and a `MultiWorkerMirroredStrategy`
  training step against ``DistributedDataParallel`` (``bench_multi_worker.py``: step
  time, inverted so that higher is faster here too);
- ``sharded_memory.png``: memory per worker of `FullyShardedStrategy` against
  `MultiWorkerMirroredStrategy` by world size (``bench_sharded.py --only memory``):
  the state kept (parameters, gradients, Adam), the peak of live tensors and the
  growth of the resident set.

One command redraws both (``pip install -c constraints.txt -e ".[docs]"`` first)::

    python benchmarks/charts.py                      # -> docs/assets/charts/*.png
    python benchmarks/charts.py --results DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "assets" / "charts"
COLORS = {"distribute": "#3f51b5", "baseline": "#9e9e9e", "state": "#7986cb"}


def read_lines(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every JSON object line of ``paths`` (other lines, warnings, are skipped)."""
    lines: list[dict[str, Any]] = []
    for path in paths:
        for text in path.read_text(encoding="utf-8").splitlines():
            text = text.strip()
            if text.startswith("{"):
                lines.append(json.loads(text))
    return lines


def speed_bars(lines: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(label, speed ratio) per figure; > 1 means distribute is faster."""
    bars: list[tuple[str, float]] = []
    for line in lines:
        if line.get("bench") == "loop" and "tensorflow_steps_per_s" in line:
            bars.append(
                (
                    "Custom loop vs TensorFlow 2.21\n(MirroredStrategy, 2 CPU devices)",
                    line["distribute_steps_per_s"] / line["tensorflow_steps_per_s"],
                )
            )
        elif line.get("bench") == "fit" and "tensorflow_steps_per_s" in line:
            bars.append(
                (
                    "Model.fit vs Keras fit, TF 2.21\n(MirroredStrategy, 2 CPU devices)",
                    line["distribute_steps_per_s"] / line["tensorflow_steps_per_s"],
                )
            )
    ddp = [line for line in lines if line.get("bench") == "train_step_vs_ddp"]
    if ddp:
        median = statistics.median(line["distribute_ms"] / line["baseline_ms"] for line in ddp)
        bars.append(("Training step vs DDP\n(MultiWorkerMirrored, 2 gloo workers)", 1.0 / median))
    return bars


def memory_table(lines: list[dict[str, Any]]) -> dict[int, dict[str, tuple[float, float]]]:
    """{workers: {figure: (MultiWorkerMirrored MiB, FullySharded MiB)}} (medians)."""
    table: dict[int, dict[str, tuple[float, float]]] = {}
    names = {"state_vs_mirrored": "state", "peak_vs_mirrored": "peak", "rss_vs_mirrored": "rss"}
    for line in lines:
        figure = names.get(str(line.get("bench")))
        if figure is None:
            continue
        table.setdefault(int(line["workers"]), {})[figure] = (
            float(line["baseline_mib"]["median"]),
            float(line["distribute_mib"]["median"]),
        )
    return table


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "svg.hashsalt": "distribute", "figure.dpi": 100})
    return plt


def draw_speed(bars: list[tuple[str, float]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.9 * len(bars)))
    labels = [label for label, _ in bars]
    values = [value for _, value in bars]
    positions = list(range(len(bars)))[::-1]
    ax.barh(positions, values, color=COLORS["distribute"], height=0.55)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(positions, labels)
    for y, value in zip(positions, values):
        ax.text(value + 0.04, y, f"{value:.2f}x", va="center")
    ax.set_xlim(0, max([*values, 1.0]) * 1.18)
    ax.set_xlabel("speed relative to the baseline (1.0 = the same; higher is faster)")
    ax.set_title("distribute against TensorFlow and DDP (2-core CPU)")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def draw_memory(table: dict[int, dict[str, tuple[float, float]]], path: Path) -> None:
    plt = _pyplot()
    figures = [("state", "state kept"), ("peak", "peak live tensors"), ("rss", "RSS growth")]
    worlds = sorted(table)
    fig, axes = plt.subplots(1, len(figures), figsize=(10, 3.6), sharey=True)
    width = 0.38
    for ax, (key, title) in zip(axes, figures):
        xs = list(range(len(worlds)))
        mirrored = [table[w].get(key, (0.0, 0.0))[0] for w in worlds]
        sharded = [table[w].get(key, (0.0, 0.0))[1] for w in worlds]
        ax.bar(
            [x - width / 2 for x in xs],
            mirrored,
            width,
            color=COLORS["baseline"],
            label="MultiWorkerMirroredStrategy",
        )
        ax.bar(
            [x + width / 2 for x in xs],
            sharded,
            width,
            color=COLORS["distribute"],
            label="FullyShardedStrategy",
        )
        for x, base, ours in zip(xs, mirrored, sharded):
            if base:
                ax.text(x + width / 2, ours + 3, f"{ours / base:.2f}", ha="center", fontsize=9)
        ax.set_xticks(xs, [f"{w} workers" for w in worlds])
        ax.set_title(title)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("MiB per worker (median)")
    axes[0].legend(loc="upper right", fontsize=8, frameon=False)
    fig.suptitle("Memory per worker, 8 x Linear(1024, 1024) with Adam (ratio above the bars)")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of *.jsonl files")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    args = parser.parse_args(argv)
    lines = read_lines(sorted(args.results.glob("*.jsonl")))
    bars, table = speed_bars(lines), memory_table(lines)
    if not bars or not table:
        raise SystemExit(
            f"{args.results}: expected bench_vs_tensorflow / bench_multi_worker lines and "
            f"bench_sharded memory lines, found speed figures {len(bars)}, memory "
            f"world sizes {sorted(table)}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "speed.png", args.out / "sharded_memory.png"]
    draw_speed(bars, written[0])
    draw_memory(table, written[1])
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
