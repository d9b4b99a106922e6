"""The build's hooks (docs/hooks/), without building the site."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
REPO = "https://github.com/owner/name"


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repository_paths_in_inline_code_link_to_the_repository() -> None:
    hook = _hook("repo_links")
    page = "\n".join(
        [
            "See `benchmarks/README.md` and `tests/gpu/`.",
            "Not `tests/no_such_file.py`, not [`tests/conftest.py`](x), not `ds.run`.",
            "```bash",
            "python `benchmarks/charts.py`",
            "```",
        ]
    )
    lines = hook.rewrite(page, REPO).split("\n")
    assert lines[0] == (
        f"See [`benchmarks/README.md`]({REPO}/blob/main/benchmarks/README.md) "
        f"and [`tests/gpu/`]({REPO}/tree/main/tests/gpu)."
    )
    assert lines[1:] == page.split("\n")[1:]


def test_search_titles_api_entries_by_path_and_ranks_a_base_method_first() -> None:
    hook = _hook("search")
    docs = [
        {"location": "api/distribute/#distribute.Strategy.run", "title": "run", "text": ""},
        {"location": "api/distribute/#distribute.TPUStrategy.run", "title": "run", "text": ""},
        {"location": "api/distribute/#distribute.TPUStrategy", "title": "x", "text": ""},
        {"location": "api/distribute/#distribute.Strategy", "title": "x", "text": ""},
        {"location": "api/launch/#distribute.launch.run", "title": "run", "text": ""},
        {
            "location": "api/distribute/#distribute.Strategy.extended",
            "title": "extended  <code>property</code>",
            "text": "",
        },
        {"location": "guide/mirrored/", "title": "MirroredStrategy", "text": ""},
        {"location": "architecture/#engines", "title": "Engines", "text": ""},
    ]
    hook.rank(docs)
    titles = [d["title"] for d in docs]
    boosts = [d.get("boost", 1.0) for d in docs]
    assert titles[:2] == ["distribute.Strategy.run", "distribute.TPUStrategy.run"]
    assert titles[5] == "distribute.Strategy.extended (property)"
    assert boosts == [2.0, 0.5, 2.0, 2.0, 1.0, 2.0, 2.0, 0.5]
