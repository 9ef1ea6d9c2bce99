"""The README and the documentation site: the README stays short, every relative link and picture points
at a file (and heading) that exists, every page is in the site's nav, the site builds with ``mkdocs build
--strict`` where mkdocs is installed, and the README's quick start runs as written.

What ``tests/test_cli_help.py`` (help texts, a bare ``pipefisher schedule``) and
``tests/test_packaging.py`` (the demo from an installed wheel) check is not repeated here.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MAX_README_LINES = 200
QUICK_START = "<!-- tests/test_docs.py runs every command of the next block"

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans: brackets in code are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: markup dropped, ASCII, lower case, dashes."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)\s*$", FENCE.sub("", page.read_text()), re.M)}


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move text into docs/ instead"
    # .ci/run runs the second command; the first is the set-up every page assumes
    assert "## Two commands" in text
    assert "python3 -m pip install -c constraints.txt -e '.[test]' && pipefisher demo" in text
    assert "\nbash scripts/test.sh\n" in text and (ROOT / "scripts" / "test.sh").is_file()


@pytest.mark.parametrize("page", [README, *PAGES, *sorted((ROOT / "configs").glob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_from_a_clone_takes_the_pinned_versions(page: Path) -> None:
    """Without the constraints an extra takes the newest releases (transformers 5.24 warned on every
    Llama run); in a clone every install line says ``-c constraints.txt``."""
    unpinned = [line.strip() for line in page.read_text().splitlines()
                if re.search(r"pip install (?!-c constraints\.txt )[^`\n]*-e '\.", line)]
    assert not unpinned, f"{page.relative_to(ROOT)}: " + "; ".join(unpinned)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_picture_points_at_what_exists(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _nav_pages(entries: list) -> list[str]:
    out: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = [p.relative_to(DOCS).as_posix() for p in PAGES]
    assert sorted(nav) == sorted(pages)


def _mkdocs_missing() -> str | None:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None or importlib.util.find_spec(m) is None]
    return ", ".join(missing) or None


@pytest.mark.skipif(_mkdocs_missing() is not None,
                    reason=f"the docs extra is not installed (missing: {_mkdocs_missing()}): pip install -c constraints.txt -e '.[docs]'")
def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    # the API reference was rendered from the docstrings, not left as `::: module` lines
    kfac = (site / "reference" / "kfac" / "index.html").read_text()
    assert "KFAC" in kfac and ":::" not in kfac
    # ... with the docstrings' Sphinx roles shown as plain names (docs/hooks/roles.py), and the hook
    # itself left out of the site
    for page in (site / "reference").glob("*/index.html"):
        assert not re.search(r":(class|func|meth|attr|data|mod):<code>", page.read_text()), page
    assert not (site / "hooks").exists()


def test_the_roles_hook_keeps_the_name_and_drops_the_role() -> None:
    spec = importlib.util.spec_from_file_location("roles", DOCS / "hooks" / "roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert roles.plain("see :class:<code>~pipefisher.cost.objective.Candidate</code> and "
                       ":func:<code>pipefisher.cost.measure.lay_out</code>") == \
        "see <code>Candidate</code> and <code>pipefisher.cost.measure.lay_out</code>"
    assert roles.plain("<code>a.b</code> stays") == "<code>a.b</code> stays"


def _quick_start() -> list[list[str]]:
    """The commands of the README's block marked for this test, one argument list per command."""
    text = README.read_text()
    at = text.index(QUICK_START)
    block = re.search(r"^```sh\n(.*?)^```", text[at:], re.S | re.M)
    assert block, "the quick-start marker must come right before a ```sh block"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def _as_run_here(argv: list[str]) -> list[str]:
    """A README command with this interpreter and this checkout: ``pipefisher`` as ``python -m pipefisher``."""
    head, rest = argv[0], argv[1:]
    if head == "pipefisher":
        return [sys.executable, "-m", "pipefisher", *rest]
    assert head in ("python", "python3"), f"the quick start runs pipefisher or python, not {head}"
    return [sys.executable, *(str(ROOT / a) if a.startswith("scripts/") else a for a in rest)]


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    commands = _quick_start()
    assert len(commands) >= 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for argv in commands:
        res = subprocess.run(_as_run_here(argv), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert res.returncode == 0, f"{shlex.join(argv)}: exit {res.returncode}\n{res.stderr[-3000:]}"


def test_the_api_reference_shows_no_restructuredtext_literal_markers() -> None:
    """The reference pages render docstrings as Markdown, where a line ending in '::' (reST's literal
    block) shows its two colons: each module a page names says 'does:' and indents the block."""
    modules = [m for page in (DOCS / "reference").glob("*.md")
               for m in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M)]
    assert "pipefisher.runtime.api" in modules
    marked = []
    for module in modules:
        base = ROOT / module.replace(".", "/")
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        marked += [f"{module}: {line.strip()}" for line in source.read_text().splitlines() if line.rstrip().endswith("::")]
    assert not marked, marked
