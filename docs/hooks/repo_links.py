"""MkDocs hook: a repository path in inline code links to the file in the repository.

The guides name files outside the site (`` `benchmarks/README.md` ``,
`` `tests/gpu/README.md` ``, `` `tests/unit/test_seams.py` ``). Outside fenced code
blocks and existing links, an inline code span whose text is a path under one of
``ROOTS`` that exists in the checkout becomes a link to it under ``repo_url``
(mkdocs.yml): ``blob/main/<path>`` for a file, ``tree/main/<path>`` for a folder.
A span with arguments or a path that does not exist is left as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOTS = ("benchmarks/", "tests/", "examples/", ".ci/")
BRANCH = "main"
REPOSITORY = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~)")
#: `path` not already the text of a link ([`path`](...)).
_SPAN = re.compile(r"(?<!\[)`((?:" + "|".join(re.escape(r) for r in ROOTS) + r")[\w./-]*)`")


def link(path: str, repo_url: str) -> str | None:
    """The repository URL of ``path``, or None when the checkout has no such path."""
    target = REPOSITORY / path
    if not target.exists():
        return None
    kind = "tree" if target.is_dir() else "blob"
    return f"{repo_url.rstrip('/')}/{kind}/{BRANCH}/{path.rstrip('/')}"


def rewrite(markdown: str, repo_url: str) -> str:
    """``markdown`` with its repository paths linked (see the module docstring)."""
    out = []
    fenced = False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced:

            def _sub(match: re.Match[str]) -> str:
                url = link(match.group(1), repo_url)
                return f"[`{match.group(1)}`]({url})" if url else match.group(0)

            line = _SPAN.sub(_sub, line)
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, config: Any, **kwargs: Any) -> str:
    repo_url = config.get("repo_url")
    return rewrite(markdown, repo_url) if repo_url else markdown
