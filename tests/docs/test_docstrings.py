"""A docstring lint: the Args, Raises and Returns sections parse as the API pages show them.

The API reference renders Google-style sections as tables (mkdocstrings with griffe's
Google parser, as mkdocs.yml configures it). Mistakes there do not fail the strict build
and render wrong: a parameter listed under ``Raises`` becomes an exception row, a
``Returns`` continuation line not indented becomes a second return row. This parses every
docstring of the package as the site does (with docs/hooks/griffe_examples.py's rewrite)
and fails naming each docstring that has:

- a griffe warning (an ``Args`` name the signature lacks, an item without ``name:``...);
- a ``Raises`` item that is not an exception class (``ValueError``, ``ds.errors.X``,
  ``RuntimeError, ValueError``);
- a ``Returns`` or ``Yields`` section of more than one item (this project describes one
  value; indent continuation lines by four spaces).

Ruff's pydocstyle rules (google convention) were tried first: they catch none of these.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="griffe (the docs extra) parses the docstrings")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
from griffe_examples import rewrite  # noqa: E402

_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Warning|Exit|Interrupt|Iteration)$")


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)  # type: ignore[arg-type]


def problems() -> list[str]:
    """One line per docstring mistake in the ``distribute`` package."""
    warnings: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = _Collect()
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    found: list[str] = []
    try:
        package = griffe.load("distribute", search_paths=[str(ROOT)], docstring_parser="google")
        for obj in _objects(package):
            if obj.docstring is None:
                continue
            obj.docstring.value = rewrite(obj.docstring.value)
            for section in obj.docstring.parse("google"):
                kind = section.kind.value
                if kind == "raises":
                    for item in section.value:
                        text = str(item.annotation)
                        names = [n.strip(" ()") for n in text.split(",")]
                        if not all(_EXCEPTION.match(n) for n in names):
                            found.append(f"{obj.path}: Raises lists {text!r}")
                elif kind in ("returns", "yields") and len(section.value) > 1:
                    found.append(
                        f"{obj.path}: {kind.title()} splits into {len(section.value)} items "
                        "(indent the continuation lines)"
                    )
    finally:
        logger.removeHandler(handler)
    return found + warnings


def test_the_docstrings_args_raises_and_returns_parse_as_rendered() -> None:
    found = problems()
    assert not found, "\n".join(found)


def test_the_lint_catches_a_parameter_under_raises_and_a_split_returns() -> None:
    sample = griffe.Function(
        "f",
        docstring=griffe.Docstring(
            "Does f.\n\nRaises:\n    ValueError: bad.\n    devices: the devices.\n\n"
            "Returns:\n    The value, or\n    None.\n"
        ),
    )
    sections = {s.kind.value: s for s in sample.docstring.parse("google")}  # type: ignore[union-attr]
    assert [str(i.annotation) for i in sections["raises"].value] == ["ValueError", "devices"]
    assert not _EXCEPTION.match("devices")
    assert len(sections["returns"].value) == 2
