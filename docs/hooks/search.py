"""MkDocs hook: the search index ranks guides and the API's own entries first.

Material's search indexes one entry per section; an API entry's title is its heading,
which mkdocstrings writes as the dotted path for a class (``distribute.Strategy``) and
as the short name for a member (``run``). After the build, this rewrites
``search/search_index.json``:

- every API entry (an anchor ``#distribute.…``) is titled by its dotted path, so
  ``Strategy.run`` matches both words and a result says which ``run`` it is (the
  separator in mkdocs.yml, ``[\\s\\-\\.]+``, splits it: ``run`` still finds it);
- entries get a boost (Material's per-entry ``boost``) by what they are:
  guides and the top-level namespace ``ds`` (the names readers look up most) 2,
  the other API pages 1, the design notes 0.5, and a method documented again where a
  subclass overrides it (``TPUStrategy.run``) 0.5, so that ``run`` reaches
  ``Strategy.run`` before its overrides.

tests/docs/test_site.py searches for three names in headless Chromium and checks the
first result.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from pathlib import Path
from typing import Any

#: Boost by the page's path under the site (the first prefix that matches wins).
PAGE_BOOST: list[tuple[str, float]] = [
    ("guide/", 2.0),
    ("api/distribute/", 2.0),
    ("api/", 1.0),
    ("concepts/", 0.5),
    ("architecture/", 0.5),
    ("torch_xla_notes/", 0.5),
]
#: A method whose class inherits it from a documented base class: the base's entry is
#: the one to find first.
OVERRIDE_BOOST = 0.5

_TAGS = re.compile(r"<[^>]+>")
log = logging.getLogger("mkdocs.hooks.search")


def _resolve(dotted: str) -> Any:
    """The object at a public dotted path (``distribute.Strategy.run``), or None."""
    parts = dotted.split(".")
    try:
        obj: Any = importlib.import_module(parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def _overridden(anchor: str, documented: dict[int, str]) -> bool:
    """Whether ``anchor`` (``distribute.TPUStrategy.run``) is a method of a class whose
    base class is documented with a method of the same name."""
    owner_path, _, name = anchor.rpartition(".")
    owner = _resolve(owner_path)
    if not isinstance(owner, type):
        return False
    for base in owner.__mro__[1:]:
        base_path = documented.get(id(base))
        if base_path is not None and name in vars(base):
            return True
    return False


def rank(docs: list[dict[str, Any]]) -> None:
    """Retitles and boosts the index's entries in place (see the module docstring)."""
    anchors = {
        doc["location"].split("#", 1)[1] for doc in docs if "#distribute." in doc["location"]
    }
    documented = {
        id(obj): anchor for anchor in anchors if isinstance(obj := _resolve(anchor), type)
    }
    for doc in docs:
        page, _, anchor = doc["location"].partition("#")
        boost = next((b for prefix, b in PAGE_BOOST if page.startswith(prefix)), 1.0)
        if anchor.startswith("distribute."):
            kind = _TAGS.sub("", doc["title"]).split()
            suffix = f" ({kind[-1]})" if len(kind) > 1 else ""  # "(property)"
            doc["title"] = anchor + suffix
            if _overridden(anchor, documented):
                boost = OVERRIDE_BOOST
        if boost != 1.0:
            doc["boost"] = boost


def on_post_build(config: Any, **kwargs: Any) -> None:
    path = Path(config["site_dir"]) / "search" / "search_index.json"
    if not path.is_file():
        return
    index = json.loads(path.read_text(encoding="utf-8"))
    rank(index["docs"])
    path.write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")
