"""Every code block of the guides (docs/guide/*.md) and of the README runs.

How the blocks are found and treated is in `_blocks.py` (and docs/README.md for
writers): python blocks run page by page, those of pages that start processes as a
script in a new interpreter; commands, YAML and JSON are checked without running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _blocks import Block, needs_new_interpreter, page_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "README.md"]
IDS = [p.stem if p.parent.name == "guide" else p.name for p in PAGES]
SCRIPT_TIMEOUT = 180


def _starts_processes(page: Path) -> bool:
    code = "\n".join(b.code for b in page_blocks(page) if b.language in ("python", "py"))
    return "launch.run(" in code or "LocalCluster(" in code or "subprocess" in code


#: Pages whose code starts worker processes carry the suite's ``distributed`` mark and run
#: only with ``DISTRIBUTE_DOCS_PROCESSES=1`` (.ci/run's docs step sets it): together they
#: take about two minutes on 2 cores (interpreters importing torch, ParameterServerStrategy's
#: start-up), which the default suite, already near its 10 minutes, cannot spend.
PROCESSES_VARIABLE = "DISTRIBUTE_DOCS_PROCESSES"
PARAMS = [
    pytest.param(p, id=i, marks=[pytest.mark.distributed] if _starts_processes(p) else [])
    for p, i in zip(PAGES, IDS)
]


def _files(path: Path) -> list[Block]:
    """The page's blocks that are files to write (a ``title="name.py"``)."""
    return [b for b in page_blocks(path) if b.title and b.language in ("python", "py", "bash")]


def _python_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The page's python blocks to run, and why the others that could run here do not."""
    runnable, missing = [], []
    for block in page_blocks(path):
        if block.language not in ("python", "py") or block.title:
            continue
        if block.not_run_reason is not None or block.is_include:
            continue
        if block.needs is not None and importlib.util.find_spec(block.needs) is None:
            missing.append(f"line {block.line} needs {block.needs}")
            continue
        runnable.append(block)
    return runnable, missing


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PARAMS)
def test_the_python_blocks_of_the_page_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, missing = _python_blocks(page)
    if _starts_processes(page) and os.environ.get(PROCESSES_VARIABLE) != "1":
        pytest.skip(
            f"{page.name} starts worker processes: it runs in .ci/run's docs step, or here "
            f"with {PROCESSES_VARIABLE}=1"
        )
    if not python:
        pytest.skip(f"{page.name} has no python block to run here ({missing})")
    for file in _files(page):
        (tmp_path / file.title).write_text(file.code, encoding="utf-8")  # type: ignore[operator]
    monkeypatch.chdir(tmp_path)  # checkpoints and logs the examples write land here
    if needs_new_interpreter(python):
        _run_as_script(page, python, tmp_path)
    else:
        namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
        for block in python:
            code = compile(block.code, f"{_relative(page)}:{block.line}", "exec")
            exec(code, namespace)
    if missing:
        pytest.skip(
            f"{page.name}: the other blocks ran; not installed here, so not run: "
            f"{'; '.join(missing)} (they run where it is, e.g. the torch_xla environment)"
        )


def _run_as_script(page: Path, python: list[Block], tmp_path: Path) -> None:
    script = tmp_path / f"{page.stem}.py"
    script.write_text(
        "".join(f"# --- {_relative(page)}, line {b.line}\n{b.code}\n" for b in python),
        encoding="utf-8",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
    )
    assert proc.returncode == 0, (
        f"{_relative(page)} as a script (its blocks in order, {script}) exited "
        f"{proc.returncode}:\n{proc.stderr[-4000:]}"
    )


# -- commands, YAML and JSON -----------------------------------------------------------------


def _example_parser() -> object:
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples/train_digits.py")
    assert spec is not None and spec.loader is not None
    module = ModuleType("train_digits")
    spec.loader.exec_module(module)
    return module.make_parser()


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped,
    split at ``&&``, ``||``, ``;``, ``|`` and ``&``."""
    joined = code.replace("\\\n", " ")
    commands: list[list[str]] = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def test_the_commands_name_files_that_exist_and_flags_the_example_takes() -> None:
    parser = None
    checked = 0
    for page, block in ((p, b) for p in PAGES for b in page_blocks(p)):
        if block.language in ("yaml", "yml"):
            import yaml

            list(yaml.safe_load_all(block.code))
            checked += 1
        elif block.language == "json":
            json.loads(block.code)
            checked += 1
        if block.language not in ("bash", "sh", "shell", "console"):
            continue
        for command in _commands(block.code):
            for token in command:
                for prefix in ("examples/", "benchmarks/", "tests/", "docs/", ".ci/"):
                    if token.startswith(prefix) and "..." not in token:
                        assert (ROOT / token).exists(), f"{page.name} line {block.line}: {token}"
            if "-m" in command:
                module = command[command.index("-m") + 1]
                if module.startswith("distribute"):
                    assert importlib.util.find_spec(module) is not None, module
            if "examples/train_digits.py" in command:
                parser = parser or _example_parser()
                argv = command[command.index("examples/train_digits.py") + 1 :]
                argv = [a for a in argv if a != "[--spmd]"]
                if "--help" not in argv:
                    parser.parse_args(argv)  # type: ignore[attr-defined]
            checked += 1
    assert checked > 20, f"only {checked} commands, YAML and JSON blocks found in {PAGES}"
