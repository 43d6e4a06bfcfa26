"""The docs site builds with ``mkdocs build --strict`` (a dead link, a missing anchor or a page left out of the
nav fails it), and every relative link of the README points at a file of the repository."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (the Makefile installs it with the test extra)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_relative_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    links = [target for target in LINK.findall(readme) if not re.match(r"[a-z]+:", target)]
    assert links, "the README links to the docs"
    missing = [target for target in links
               if not target.startswith("#") and not (REPO / target.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_config_reference_is_generated_from_the_config_classes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """docs/reference/config.md is what ``jetrl config --markdown`` makes; ``--check`` fails on a stale page."""
    from jetrl import configref
    from jetrl.cli import main

    assert main(["config", "--markdown", "--check"]) == 0, capsys.readouterr().out
    page = capsys.readouterr().out
    assert "up to date" in page
    assert main(["config", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert text == configref.PAGE.read_text()
    assert "| `max_sessions` | `int` | `64` |" in text and "### `[env.db]`" in text
    stale = tmp_path / "config.md"
    stale.write_text(text.replace("| `max_sessions` | `int` | `64` |", "| `max_sessions` | `int` | `65` |"))
    assert configref.check(stale) == [f"{stale} is out of date"]
