"""The layering the README and docs/architecture.md describe, checked on the source itself:
dependencies go one way, cli -> api -> workflows -> (convert, calibrate, runtime, apple) ->
(manifests, source, publish) -> model -> format -> infra (apple's one crossing: the runtime's
engine), the CLI uses only the API, the error types and its own rendering, and no module is part
of an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "mpsconvert"
ROOT = {"errors", "version"}  # the package's root modules below everything (api and __main__ aside)
INFRA = ROOT | {"infra"}
FORMAT = INFRA | {"format"}
MODEL = FORMAT | {"model"}
STORAGE = MODEL | {"manifests"}  # source and publish read and write artifacts through manifests
MIDDLE = {"convert", "apple", "calibrate", "runtime"}
WORK = STORAGE | {"source", "publish"}
# what each layer may import from the package (by the first component of the module path)
ALLOWED = {
    "cli": ROOT | {"api", "cli"},
    "api": WORK | MIDDLE | {"workflows", "api"},
    "workflows": WORK | MIDDLE | {"workflows"},
    **{m: WORK | {m} for m in MIDDLE},
    "manifests": STORAGE,
    "source": STORAGE | {"source"},
    "publish": STORAGE | {"publish"},
    "model": MODEL,
    "format": FORMAT,
    "infra": INFRA,
    **{r: ROOT for r in ROOT},
    "__main__": {"cli"},  # `python -m mpsconvert`: the program, nothing else
}
# Crossings by module. The Apple checks' PyTorch reference, their generation and latency run
# through the runtime's one generation engine (one loop for every decoder). The CLI shows sizes
# and untrusted text by the same rules as the model card (one size formatter, one printable rule).
CROSSINGS = {"apple": {"runtime.engine"}, "cli": {"infra.units", "infra.untrusted"}}


def _imports(path: Path) -> set[str]:
    """The package modules a file imports (relative imports resolved), as dotted paths."""
    rel = path.relative_to(PKG).with_suffix("")
    here = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
                if not node.module:  # `from . import x`: a module, or a name of the package (`__version__`)
                    out |= {
                        ".".join([*base, a.name]) if not a.name.startswith("__") else ".".join(base) for a in node.names
                    }
                    continue
            elif node.module and node.module.startswith("mpsconvert"):
                mod = node.module.removeprefix("mpsconvert").lstrip(".")
            else:
                continue
            out.add(mod)
        elif isinstance(node, ast.Import):
            out |= {
                a.name.removeprefix("mpsconvert").lstrip(".") for a in node.names if a.name.startswith("mpsconvert")
            }
    return out


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else ""


FILES = sorted(p for p in PKG.rglob("*.py") if p.relative_to(PKG).as_posix() != "__init__.py")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_dependencies_go_one_way(path):
    layer = _layer(path)
    allowed = ALLOWED[layer]
    crossing = CROSSINGS.get(layer, set())
    bad = sorted(
        m
        for m in _imports(path)
        if m.split(".")[0] not in allowed and not any(m == c or m.startswith(c + ".") for c in crossing)
    )
    assert not bad, f"{path.relative_to(PKG)} ({layer}) imports {bad}; allowed: {sorted(allowed)}"


def test_the_checker_sees_a_violation(tmp_path):
    """Negative control: the import parser resolves relative imports (else the test above is empty)."""
    assert "api" in _imports(PKG / "cli" / "convert_commands.py")
    assert "manifests.layout" in _imports(PKG / "convert" / "quantize_plan.py")
    assert "errors" in _imports(PKG / "format" / "fp8.py")


def test_importing_the_api_loads_no_torch():
    """`mpsconvert --help` and the start of a conversion (hashing the source) come before torch."""
    import subprocess
    import sys

    code = "import sys, mpsconvert, mpsconvert.cli; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_the_public_api_is_documented():
    import inspect as pyinspect

    import mpsconvert

    for name in (
        "quantize",
        "calibrate",
        "validate",
        "verify",
        "inspect",
        "export",
        "check",
        "export_coreml",
        "check_coreml",
        "export_coreai",
        "check_coreai",
        "coreai_latency",
        "load",
    ):
        fn = getattr(mpsconvert, name)
        doc = pyinspect.getdoc(fn) or ""
        assert doc and ("Returns" in doc or name == "inspect"), name
        params = [p for p in pyinspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for p in params:
            assert p.annotation is not pyinspect.Parameter.empty, f"{name}({p.name}) has no type"


TRITON_HOME = PKG / "runtime" / "ops" / "triton" / "__init__.py"


def _triton_imports(path: Path) -> list[int]:
    """Lines of `path` that import triton (at any depth: a guarded import inside a function is
    still a second owner of the optional dependency)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if any(n == "triton" or n.startswith("triton.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_one_module_owns_the_triton_import():
    """Triton has no macOS wheels: runtime/ops/triton/__init__.py imports it (guarded) and every kernel
    module takes `triton` / `tl` from there, so a base install imports every module."""
    bad = {p.relative_to(PKG).as_posix(): lines for p in FILES if p != TRITON_HOME and (lines := _triton_imports(p))}
    assert not bad, f"import triton only in runtime/ops/triton/__init__.py; also imported in {bad}"
    assert _triton_imports(TRITON_HOME), "ops/triton/__init__.py no longer imports triton: update this test"


def test_the_triton_check_sees_an_import(tmp_path):
    """Negative control for the scan above."""
    f = tmp_path / "m.py"
    f.write_text(
        "def f():\n    try:\n        import triton.language as tl\n    except ImportError:\n        pass\n"
        "from triton import jit\n"
    )
    assert _triton_imports(f) == [3, 6]


def test_every_module_imports_in_this_environment():
    """Every module of the package imports here (CI runs this in the base install too: no Triton,
    no extras), in a fresh interpreter so that nothing imported by other tests hides a failure.
    `__main__` modules run the CLI when imported and are left out."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, mpsconvert\n"
        "names = [m.name for m in pkgutil.walk_packages(mpsconvert.__path__, 'mpsconvert.')\n"
        "         if not m.name.endswith('__main__')]\n"
        "bad = []\n"
        "for n in names:\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{n}: {type(e).__name__}: {e}')\n"
        "print(len(names)); print('\\n'.join(bad))\n"
    )
    env = dict(__import__("os").environ, PYTHONPATH=str(PKG.parent))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    count, *bad = r.stdout.strip().splitlines()
    assert int(count) == len([p for p in FILES if p.name != "__main__.py"]), (
        "the walk missed modules"
    )  # a subpackage's __init__ is its entry
    assert not bad, "\n".join(bad)


# The runtime's own layers, bottom first (hf_compat: transformers' private names, read by the engine and
# the patches): a module may import runtime modules of its own layer and
# the layers below it, never above (runtime/__init__.py, the package's face, re-exports `load`).
RUNTIME_LAYERS = ("hf_compat", "ops.triton", "ops", "engine", "patches", "load", "evaluate")


def _runtime_layer(dotted: str) -> int | None:
    """The index in RUNTIME_LAYERS of a module path under runtime ('runtime.ops.triton.gemv'), or
    None for runtime itself."""
    rest = dotted.removeprefix("runtime").lstrip(".")
    for i, layer in sorted(enumerate(RUNTIME_LAYERS), key=lambda x: -len(x[1])):  # ops.triton before ops
        if rest == layer or rest.startswith(layer + "."):
            return i
    return None


RUNTIME_FILES = [
    p
    for p in FILES
    if p.relative_to(PKG).parts[0] == "runtime" and p.relative_to(PKG).as_posix() != "runtime/__init__.py"
]


@pytest.mark.parametrize("path", RUNTIME_FILES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_the_runtime_layers_go_one_way(path):
    rel = path.relative_to(PKG).with_suffix("")
    here = _runtime_layer(".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1]))
    assert here is not None, f"{rel} is in no runtime layer; RUNTIME_LAYERS = {RUNTIME_LAYERS}"
    above = sorted(m for m in _imports(path) if m.startswith("runtime") and (_runtime_layer(m) or 0) > here)
    assert not above, f"{rel} ({RUNTIME_LAYERS[here]}) imports {above} from a runtime layer above it"


def test_the_runtime_layer_check_sees_a_violation():
    """Negative control: an engine module importing a patch would be caught."""
    assert _runtime_layer("runtime.ops.triton.gemv") == 1 and _runtime_layer("runtime.ops.kernels") == 2
    assert _runtime_layer("runtime.engine") == 3 and _runtime_layer("runtime.evaluate.validate") == 6
    assert "runtime.engine" in _imports(PKG / "runtime" / "evaluate" / "validate.py")  # what the test above compares


def _module_of(dotted: str) -> str | None:
    """The package module a dotted import names: `manifests.layout.MANIFEST_NAME` -> `manifests.layout`
    (the longest prefix that is a module or a package), "" for the package root."""
    parts = dotted.split(".") if dotted else []
    while parts:
        base = PKG.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return ""


def _name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Every module -> the package modules it imports anywhere in its text (a function-level import
    is a dependency too: it only runs later). `from . import x` names the module x when there is
    one; importing `a.b` is counted as an edge to `a.b` alone (Python also runs `a/__init__`, but
    every module has that edge to its parents, which are no choice of the code)."""
    files = sorted(PKG.rglob("*.py"))
    graph = {}
    for path in files:
        me = _name(path)
        graph[me] = {m for m in (_module_of(d) for d in _imports(path)) if m is not None and m != me}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """No module imports (directly or through others, at module level or inside a function) a
    module that imports it back: each concept has one home and dependencies go one way."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle():
    """Negative control: a circle of three, and a function-level import counted as an edge."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "manifests.manifest" in _import_graph()["manifests.card"]
    assert _module_of("manifests.layout.MANIFEST_NAME") == "manifests.layout" and _module_of("") == ""
