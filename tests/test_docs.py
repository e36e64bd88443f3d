"""The README and the docs pages: every relative link resolves (file and heading), the README
fits on a screen or two, and no tracked file names a path of the machine that wrote it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The topic pages issue 23 asks for; each one is linked from the README.
TOPIC_PAGES = ["design", "benchmarks", "troubleshooting", "data-formats", "gpu", "serving", "tiny"]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# An absolute path on a machine (not a URL's path: the character before the slash is not part
# of a host or a word).
MACHINE_PATH = re.compile(r"(?<![\w.~:/-])/(tmp|work|root|home)/")


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where links are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = _slug(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text()))


def test_the_topic_pages_exist_and_the_readme_links_each():
    linked = {target.split("#")[0] for target in _links(README)}
    for name in TOPIC_PAGES:
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    for page in DOCS.glob("*.md"):
        assert f"docs/{page.name}" in linked, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_heading(page):
    problems = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of this repository
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if not dest.resolve().is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        if anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            problems.append(f"{target}: no heading #{anchor} in {dest.name} (has {sorted(_anchors(dest))})")
    assert not problems, f"{page.name}: " + "; ".join(problems)


def test_readme_fits_in_about_200_lines():
    assert len(README.read_text().splitlines()) <= 210


def test_readme_test_command_is_what_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in README.read_text() and "make demo" in README.read_text()


def test_readme_and_docs_hold_no_history_of_sessions():
    """History lives in git: no "Session 3" tables or session narratives in what users read."""
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.search(r"\bsessions?\b", line, re.I), f"{page.relative_to(ROOT)}:{n}: {line}"


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in out.decode().split("\0"):
        # Tests are left out: a test may name an absolute path as data (a path that must not
        # exist, or how an error message prints one), and no user reads it as an instruction.
        if not name or name.startswith("tests/"):
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (weights)
            continue
        files.append(path)
    return files


def test_no_tracked_file_names_a_path_of_the_machine_that_wrote_it():
    """README, docs, the assets' records (training.json), scripts and benchmarks: commands use
    relative or placeholder paths (`--work WORKDIR`), never /tmp/..., /work/..., /root/..., /home/...."""
    found = []
    for path in _tracked_text_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "absolute machine paths:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_meant_to(tmp_path):
    """The helpers above on known inputs, so a passing suite means something."""
    assert _slug("Memory: which command loads what") == "memory-which-command-loads-what"
    assert _slug("Errors and `flashdraft doctor`") == "errors-and-flashdraft-doctor"
    assert _slug("Hidden-state cache (`flashdraft cache --out DIR`)") == "hidden-state-cache-flashdraft-cache---out-dir"
    page = tmp_path / "p.md"
    page.write_text("# A\n\n[x](q.md#b) [y](https://e.org/a) `[z](no.md)`\n\n```sh\n[w](no.md)\n```\n")
    assert _links(page) == ["q.md#b", "https://e.org/a"]
    assert MACHINE_PATH.search("--work /tmp/run") and MACHINE_PATH.search('"/home/me/x"')
    assert not MACHINE_PATH.search("https://github.com/home/x") and not MACHINE_PATH.search("WORKDIR/tmp/x")
