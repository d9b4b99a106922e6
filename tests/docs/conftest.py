"""The built documentation site, for the tests that read it.

``DISTRIBUTE_DOCS_SITE=DIR`` points at a site already built (CI builds ``site/``
with ``mkdocs build --strict`` first); otherwise the site is built once per session
into a temporary folder, when mkdocs is installed (the ``docs`` extra). Without
either, the tests that need the site skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE_VARIABLE = "DISTRIBUTE_DOCS_SITE"


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(SITE_VARIABLE)
    if given:
        path = Path(given).resolve()
        if not (path / "index.html").is_file():
            pytest.skip(f"{SITE_VARIABLE}={given} holds no built site (no index.html)")
        return path
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip(
            "no built site: mkdocs is not installed (pip install -c constraints.txt -e "
            f'".[docs]"), and {SITE_VARIABLE} does not point at a built site'
        )
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out
