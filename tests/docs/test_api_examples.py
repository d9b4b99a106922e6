"""The examples of the API reference run as a reader pastes them.

The API pages show each docstring's ``Example:`` section (docs/hooks/griffe_examples.py);
this keeps them true. Each docstring's ``>>>`` lines run as a doctest in fresh globals
(only ``__name__``), not in the globals of the module that defines them: an example
imports what it uses, as a reader's session would. One test per module. No example
is skipped: ``# doctest: +SKIP`` is refused (a reader cannot see it), and an example
that needs a model builds a small one.
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


def examples(name: str) -> list[doctest.DocTest]:
    """The doctests of module ``name``, each with fresh globals."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = finder.find(module, name, globs={"__name__": "__main__"})
    for test in tests:
        test.globs = {"__name__": "__main__"}
    return tests


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_of_the_module_run_in_fresh_globals(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    skipped = []
    for test in examples(name):
        skipped += [
            f"{test.name}: {ex.source.strip()}"
            for ex in test.examples
            if ex.options.get(doctest.SKIP)
        ]
        runner.run(test)
    assert not skipped, f"examples skipped behind a hidden +SKIP: {skipped}"
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
