"""The examples of the API reference run: every docstring's ``>>>`` lines, as doctests.

The API pages show each docstring's ``Example:`` section (docs/hooks/griffe_examples.py);
this keeps them true. One test per module; lines marked ``# doctest: +SKIP`` (a call
that needs a cluster or a model built elsewhere) are shown but not run.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import distribute

#: Entry points with side effects at import (they run a worker).
_NOT_IMPORTED = ("distribute._launch_child",)

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(distribute.__path__, "distribute.")
    if m.name not in _NOT_IMPORTED
)


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_of_the_module_run(name: str) -> None:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
