"""The fenced code blocks of a Markdown page, and how the docs tests treat each.

Why a small block runner and not doctest: the guides show code as a user writes it
in a script (no ``>>>`` prompts, no printed reprs to keep in step with torch's), the
blocks of one page build on each other like the cells of a notebook, and a page
whose code starts worker processes must run as a script (``ds.launch.run`` pickles
the worker function by reference, so it must live in an importable ``__main__``).
Doctest fits none of that; the docstrings' ``>>>`` examples are doctests already.

Conventions a guide follows (docs/README.md says the same for writers):

- ```` ```python ```` blocks run, in page order, in one namespace per page.
- A python block whose first line is ``# not run: <reason>`` is skipped; the
  reason shows in the rendered page. Only for what needs hardware (a GPU, a TPU) or
  a real cluster.
- A python block with a file name for title (```` ```python title="train.py" ````)
  is a file: it is written under that name in the page's working directory before
  the page's other blocks run (they start it: ``torchrun train.py``, ...), and is
  not run by itself.
- A python block that only includes a file (``--8<-- "examples/train_digits.py"``,
  the examples page) is not run here: tests/examples runs those files.
- A python block whose first line is ``# needs: <module>`` runs only where
  ``<module>`` imports (torch_xla lives in its own environment); elsewhere the
  test skips it, saying so.
- A page whose code calls ``launch.run`` (it has an ``if __name__ == "__main__":``
  guard, as such a script must) or builds a ``ParameterServerStrategy`` (rpc is one
  per process) runs as a script in a new interpreter; other pages run in the test's
  process.
- ```` ```bash ```` blocks are commands: every ``examples/...`` or
  ``benchmarks/...`` path they name must exist, and the flags given to
  ``examples/train_digits.py`` must parse. ```` ```yaml ```` and ```` ```json ````
  blocks must parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, code (dedented) and first line number."""

    language: str
    code: str
    line: int
    title: str | None = None

    @property
    def first_line(self) -> str:
        return self.code.lstrip().split("\n", 1)[0].strip()

    @property
    def not_run_reason(self) -> str | None:
        match = re.match(r"#\s*not run:\s*(.+)", self.first_line)
        return match.group(1) if match else None

    @property
    def is_include(self) -> bool:
        """A block that only includes a file (``--8<-- "examples/x.py"``): the file
        has its own tests (tests/examples)."""
        lines = [line.strip() for line in self.code.splitlines() if line.strip()]
        return bool(lines) and all(line.startswith("--8<--") for line in lines)

    @property
    def needs(self) -> str | None:
        match = re.match(r"#\s*needs:\s*([\w.]+)", self.first_line)
        return match.group(1) if match else None


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, nested in lists or admonitions too."""
    found: list[Block] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match.group("indent"), match.group("fence")
        info = match.group("info").strip()
        language = info.split()[0].lstrip(".").lower() if info else ""
        body: list[str] = []
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        title = re.search(r'title="([^"]+)"', info)
        code = "\n".join(body) + "\n"
        found.append(Block(language, code, start + 1, title.group(1) if title else None))
    return found


def page_blocks(path: Path) -> list[Block]:
    return blocks(path.read_text(encoding="utf-8"))


def needs_new_interpreter(python: list[Block]) -> bool:
    """Whether the page's code must run as a script: it launches workers with
    ``launch.run`` (which imports the worker function from ``__main__``), or it is a
    parameter-server chief (``torch.distributed.rpc`` is one per process)."""
    code = "\n".join(b.code for b in python)
    chief = re.search(r"(?<!v1\.)ParameterServerStrategy\(", code) is not None
    return "launch.run(" in code or chief
