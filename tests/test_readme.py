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
    assert joined(test).endswith('python -m pytest -q -n auto -m "not slow"') and "pip install -e '.[test]'" in joined(
        test
    )
    assert "-m slow" in ci  # what the README's command leaves out still runs in CI
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


def _expand(token: str) -> list[str]:
    """`a_{x,y}.{json,log}` -> every name it stands for (how the docs cite a family of runs)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [n for alt in m.group(1).split(",") for n in _expand(token[: m.start()] + alt + token[m.end() :])]


def _doc_pages() -> list[Path]:
    """The README and every page under docs/ (docs/decisions/ included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_benchmark_results_kept_are_the_ones_the_docs_cite():
    """benchmarks/results/ keeps what a claim rests on: every file there is cited as
    `results/<name>` (its exact name, a brace family such as `a_{x,y}.{json,log}`, or a glob) by the
    README or a page under docs/, not by a script or a docstring; and every `results/<name>` a page
    cites exists."""
    import fnmatch

    results = ROOT / "benchmarks" / "results"
    kept = sorted(p.name for p in results.iterdir())
    cited: dict[str, set[str]] = {}
    for page in _doc_pages():
        for tok in re.findall(r"results/([\w.{},*-]+)", page.read_text(encoding="utf-8")):
            for name in _expand(tok.rstrip(".,")):
                if name.endswith("_"):  # a template (`generate_<device>_<model>.json`)
                    continue
                cited.setdefault(name, set()).add(page.relative_to(ROOT).as_posix())
    uncited = [f for f in kept if not any(fnmatch.fnmatch(f, name) for name in cited)]
    assert not uncited, f"kept but cited by no doc (cite it in docs/ or git rm it): {uncited}"
    missing = {name: sorted(pages) for name, pages in cited.items() if not any(fnmatch.fnmatch(f, name) for f in kept)}
    assert not missing, f"cited but missing from benchmarks/results/: {missing}"


def test_every_benchmark_script_is_named_by_a_doc():
    """A script in benchmarks/ backs a claim in the README or docs/ (or is the helper the others import)."""
    corpus = "\n".join(p.read_text(encoding="utf-8") for p in _doc_pages())
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    assert scripts and all(s in corpus for s in scripts), [s for s in scripts if s not in corpus]


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes for a page: lower case, punctuation dropped, spaces as '-'."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_between_docs_resolve():
    """Every relative link of a page under docs/ (decision records included) names a file that exists,
    and an anchor in it a heading of that file."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]*))?\)", page.read_text(encoding="utf-8")):
            linked = (page.parent / target).resolve()
            assert linked.is_file(), f"{page.relative_to(ROOT)} links {target}"
            assert not anchor or anchor in _anchors(linked), f"{page.relative_to(ROOT)} links {target}#{anchor}"
