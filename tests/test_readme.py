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
    assert joined(test).endswith('python -m pytest -q -n auto -m "not slow"') and "pip install -e '.[test]'" in joined(test)
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
    return [n for alt in m.group(1).split(",") for n in _expand(token[: m.start()] + alt + token[m.end():])]


def test_benchmark_results_kept_are_the_ones_the_docs_cite():
    """benchmarks/results/ keeps what a claim rests on: every file there is cited (by its name, a
    brace family or a glob, the .json or the .log of the same run) from the README, docs/ or a
    benchmark, and every `results/<name>` cited exists."""
    import fnmatch

    results = ROOT / "benchmarks" / "results"
    texts = [README, *(p.read_text(encoding="utf-8") for p in [*(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.py")])]
    corpus = "\n".join(texts)
    # `..._run3.json`: a name abbreviated after a full one nearby, matched by its end
    refs = {re.sub(r"^\.\.\.", "*", n) for tok in re.findall(r"(?:\.\.\.)?[\w{},*-][\w.{},*-]*", corpus) if "_" in tok
            for n in _expand(tok.rstrip(".,"))}
    kept = sorted(p.name for p in results.iterdir())
    uncited = [f for f in kept if not any(fnmatch.fnmatch(f, r) or fnmatch.fnmatch(f.split(".")[0], s) for r in refs for s in [r.split(".")[0]])]
    assert not uncited, f"kept but cited nowhere (cite or delete): {uncited}"
    for tok in re.findall(r"results/([\w.{},*-]+)", corpus):
        for name in _expand(tok.rstrip(".,")):
            if name.endswith("_"):  # a template (`generate_<device>_<model>.json`)
                continue
            assert any(fnmatch.fnmatch(f, name) for f in kept), f"cited but missing: results/{name}"
