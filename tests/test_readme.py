"""The README's front door: CI runs exactly its test command, its quick start writes outside
the checkout, and its Documentation list links every docs/ page."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# written by other engineers in parallel; remove from this set once merged (then they must exist)
PENDING: set[str] = set()  # pages linked before they exist (none now)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def joined(block: str) -> str:
    """A command split over lines with `\\` as one line (what the shell runs)."""
    return re.sub(r"\\\n\s*", "", block).strip()


def test_ci_runs_exactly_the_readmes_test_command():
    convert, test = bash_blocks(README)[:2]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test.strip() in ci  # the same lines, continuation backslashes included
    assert joined(test).endswith("python -m pytest -q") and "pip install -e '.[test]'" in joined(test)
    assert "-o ~/mpsconvert-out/" in joined(convert)  # output outside the checkout
    assert all(len(line) <= 120 for line in convert.splitlines() + test.splitlines())


def test_readme_is_short_and_links_every_doc():
    quick_and_usage = README.split("## Documentation")[0]
    assert len(quick_and_usage.splitlines()) <= 160
    links = set(re.findall(r"\]\((docs/[\w.-]+\.md)", README))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages <= links, f"not linked from the README: {sorted(pages - links)}"
    assert links - pages <= PENDING, f"broken links: {sorted(links - pages - PENDING)}"
    for page in pages:  # links between the docs pages resolve
        for target in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", (ROOT / page).read_text(encoding="utf-8")):
            assert (ROOT / "docs" / target).is_file() or f"docs/{target}" in PENDING, f"{page} links {target}"
