"""Griffe extension: the project's ``Example:`` sections as Google-style examples.

STYLE.md's docstrings end with ``Example:`` (doctest lines) or ``Example::`` (an
indented block of code, reST style). Griffe's Google parser knows only
``Examples:``; any other title becomes an admonition whose ``>>>`` lines render as
nested block quotes. Before a docstring is parsed, this rewrites ``Example:`` to
``Examples:`` (so doctest lines become highlighted code) and the body of
``Example::`` to a fenced ``python`` block, and escapes an argument description that
starts with ``>`` (``>= 0``), which Markdown would quote. The source files are not
touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DOCTEST_TITLE = re.compile(r"^(\s*)Example:\s*$")
_LITERAL_TITLE = re.compile(r"^(\s*)Example::\s*$")
#: An ``Args:`` item whose description starts with ``>`` (``x: >= 0; ...``): Markdown
#: would make it a block quote.
_QUOTE_LIKE_ITEM = re.compile(r"^(\s+[\w*]+(?: \([^)]*\))?: )>")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rewrite(text: str) -> str:
    """The docstring ``text`` with its example sections in griffe's spelling."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        line = _QUOTE_LIKE_ITEM.sub(r"\1\\>", line)
        if match := _DOCTEST_TITLE.match(line):
            out.append(f"{match.group(1)}Examples:")
            i += 1
            continue
        match = _LITERAL_TITLE.match(line)
        if match is None:
            out.append(line)
            i += 1
            continue
        base = len(match.group(1))
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        margin = min((_indent(b) for b in body if b.strip()), default=base + 4)
        pad = " " * (base + 4)
        out.append(f"{' ' * base}Examples:")
        out.append(f"{pad}```python")
        out.extend(f"{pad}{b[margin:]}" if b.strip() else "" for b in body)
        out.append(f"{pad}```")
        if i < len(lines):
            out.append("")
    return "\n".join(out)


class ExampleSections(griffe.Extension):
    """Rewrites every loaded object's docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
