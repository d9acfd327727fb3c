"""The Apple targets are one protocol behind one registry: a third target is one module (a
`Target` subclass, its options and record) and one `register` call, and everything that names a
target follows: the API's export / check, the CLI's `export-<key>` and `quantize --<key>`, the
renderer, `--backend`, the model card, inspect and validate's Apple part."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert.apple import registry
from mpsconvert.apple.protocol import Option, Target
from mpsconvert.cli import main
from mpsconvert.manifests.manifest import Manifest
from mpsconvert.manifests.records import AppleExport, RuntimeResult

from .models import tree_hashes

pytestmark = pytest.mark.core


@dataclass
class FakeOptions:
    lanes: int = 4
    force: bool = False


@dataclass
class FakeChecks:
    strict: bool = False


@dataclass(kw_only=True)
class FakeExport(AppleExport):
    KEY: ClassVar[str] = "fake"
    NAME: ClassVar[str] = "Fake ML"
    lanes: int
    package: str

    def card_lines(self, name: str, causal: bool) -> list[str]:
        return [f"Fake ML: `{self.package}` with {self.lanes} lanes.", ""]

    def summary(self) -> str:
        return f"{self.package}: {self.task}, {self.lanes} lanes, " + (
            "checks ok" if self.check and self.check.ok else "not checked"
        )


@dataclass(kw_only=True)
class FakeRuntime(RuntimeResult):
    KEY: ClassVar[str] = "fake_runtime"
    NAME: ClassVar[str] = "Fake ML"


class Fake(Target):
    """A target whose package is a JSON file of the artifact's FP8 tensor names: a real build (it
    reads the artifact it is given) and a real check (it reads the package back)."""

    key, name, package, noun = "fake", "Fake ML", "model.fakepkg", "package"
    module, extra = "json", "coreml"
    record, runtime_record = FakeExport, FakeRuntime
    options, check_options = FakeOptions, FakeChecks
    export_flags = (
        Option(
            "lanes",
            "--lanes",
            "SIMD lanes of the fake runtime.",
            kind="int",
            default=4,
            minimum=1,
            quantize="--fake-lanes",
        ),
    )
    check_flags = (Option("strict", "--strict", "Fail on any difference.", kind="flag", default=False),)
    quantize_help = "Also export a fake package."
    backend_help = "the fake runtime"
    help = "Export ARTIFACT to a fake package (a test target)."
    check_fix = "re-export it"
    calls: ClassVar[list] = []

    def build(self, folder, manifest, opts, progress):
        self.calls.append(("build", opts.lanes))
        pkg = Path(folder) / self.package
        pkg.mkdir()
        (pkg / "tensors.json").write_text(json.dumps(sorted(manifest.tensors)))
        return FakeExport(package=self.package, task="causal-lm", lanes=opts.lanes, max_len=16)

    def check(self, folder, record, opts, progress):
        from mpsconvert.infra.safetensors_io import read_header
        from mpsconvert.manifests.layout import weight_files

        self.calls.append(("check", opts.strict))
        names = json.loads((Path(folder) / self.package / "tensors.json").read_text())
        fp8 = sorted(
            n
            for f in weight_files(folder)
            for n, i in read_header(Path(folder) / f).tensors.items()
            if i.dtype == "F8_E4M3"
        )
        ok = names == fp8 and not opts.strict
        return {"ok": ok, "weights": {"all_ok": ok, "tensors": {n: {"ok": ok} for n in names}, "checked": len(names)}}

    def latency(self, artifact, record, settings, progress):
        return {"status": "ran", "rows": [{"engine": "fake runtime", "latency_ms": 1.0}], "inputs": "none"}

    def rows(self, artifact, record, check):
        return (
            [("lanes", str(record["lanes"]), None), ("tensors", str(check["weights"]["checked"]), check["ok"])],
            None,
            "",
        )

    def written(self, record):
        return f"Fake ML: {record['package']} written ({record['lanes']} lanes)"


@pytest.fixture
def fake():
    Fake.calls = []
    registry.register(Fake())
    yield Fake
    registry.unregister("fake")


def test_a_registered_target_gets_its_commands_options_and_backend(fake):
    r = CliRunner().invoke(main, ["--help"])
    assert "export-fake" in r.output and "export-coreml" in r.output and "export-coreai" in r.output
    r = CliRunner().invoke(main, ["export-fake", "--help"])
    assert r.exit_code == 0 and "--lanes" in r.output and "--strict" in r.output and "--check-only" in r.output
    assert "a fake package (a test target)" in r.output
    r = CliRunner().invoke(main, ["quantize", "--help"])
    assert "--fake " in r.output and "--fake-lanes" in r.output and "--coreml-weights" in r.output
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert "fake" in r.output.split("--backend", 1)[1].split("\n")[0]
    assert "fake" in mpsconvert.targets()


def test_the_command_disappears_with_the_target(fake):
    registry.unregister("fake")
    r = CliRunner().invoke(main, ["--help"])
    assert "export-fake" not in r.output
    registry.register(Fake())


def test_export_check_record_card_and_inspect_of_a_new_target(fake, art_copy):
    r = CliRunner().invoke(main, ["export-fake", str(art_copy), "--lanes", "8"])
    assert r.exit_code == 0, r.output
    assert "Fake ML: model.fakepkg written (8 lanes)" in r.output and "lanes" in r.output
    assert fake.calls == [("build", 8), ("check", False)]
    m = Manifest.read(art_copy)
    rec = m.get(FakeExport)
    assert (
        rec.lanes == 8 and rec.check.ok and "weights" in rec.check.more and "tensors" not in rec.check.more["weights"]
    )
    assert "model.fakepkg/tensors.json" in m.files and mpsconvert.verify(art_copy).ok
    card = (art_copy / "README.md").read_text()
    assert "Fake ML: `model.fakepkg` with 8 lanes." in card and "- fake" in card  # its paragraph and its tag
    r = CliRunner().invoke(main, ["inspect", str(art_copy)], env={"COLUMNS": "200"})
    assert "Fake ML" in r.output and "8 lanes, checks ok" in r.output
    before = tree_hashes(art_copy)
    r = CliRunner().invoke(main, ["export-fake", str(art_copy)])
    assert r.exit_code == 2 and "--force" in r.output and tree_hashes(art_copy) == before
    r = CliRunner().invoke(main, ["export-fake", str(art_copy), "--check-only", "--strict"])
    assert r.exit_code == 2 and "failed its checks" in r.output and "re-export it" in r.output
    assert Manifest.read(art_copy).get(FakeExport).check.ok is False  # recorded before the error


def test_quantize_exports_to_a_new_target(fake, tmp_path):
    from .models import tiny

    src = tiny("llama", tmp_path / "src")
    res = mpsconvert.quantize(src, tmp_path / "out", exports={"fake": FakeOptions(lanes=2)})
    assert res.fake.record["lanes"] == 2 and res.apple["fake"].ok and res.coreml is None
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out2"), "--fake", "--fake-lanes", "3"])
    assert r.exit_code == 0, r.output
    assert Manifest.read(tmp_path / "out2").get(FakeExport).lanes == 3


def test_what_the_targets_share_names_none_of_them():
    """apple/flow.py, the protocol, the CLI, the card and the transaction go through the registry:
    a target's key in their code (not their prose) would be a second home for it."""
    import ast
    import re

    root = Path(mpsconvert.__file__).parent
    word = re.compile(r"\b(coreml|coreai)\b")
    for rel in (
        "apple/flow.py",
        "apple/protocol.py",
        "apple/registry.py",
        "cli/render.py",
        "cli/reports.py",
        "cli/options.py",
        "cli/convert_commands.py",
        "cli/check_commands.py",
        "cli/run_commands.py",
        "cli/apple_commands.py",
        "manifests/card.py",
        "manifests/transaction.py",
        "manifests/records.py",
    ):
        tree = ast.parse((root / rel).read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        found = [
            n.lineno
            for n in ast.walk(tree)
            if id(n) not in docs
            and (
                isinstance(n, ast.Constant)
                and isinstance(n.value, str)
                and word.search(n.value)
                or isinstance(n, ast.Name)
                and word.fullmatch(n.id)
                or isinstance(n, ast.Attribute)
                and word.fullmatch(n.attr)
            )
        ]
        if rel == "apple/registry.py":  # its one line per target: the imports and the list
            found = [ln for ln in found if "import" not in (root / rel).read_text().splitlines()[ln - 1]]
        assert not found, f"{rel} names a target at lines {found}"


def _counting(monkeypatch) -> dict:
    """Count every read and write of a manifest (Manifest.read / Manifest.write) from here on."""
    counts = {"read": 0, "write": 0}
    real_read, real_write = Manifest.read.__func__, Manifest.write

    def read(cls, folder):
        counts["read"] += 1
        return real_read(cls, folder)

    def write(self, folder):
        counts["write"] += 1
        return real_write(self, folder)

    monkeypatch.setattr(Manifest, "read", classmethod(read))
    monkeypatch.setattr(Manifest, "write", write)
    return counts


def test_an_export_with_its_check_reads_and_writes_the_manifest_once(fake, art_copy, monkeypatch):
    """Verify, build, check, record, card: one read of the manifest (under the lock) and one write
    (in the staged copy swapped in with the package and the card)."""
    counts = _counting(monkeypatch)
    res = mpsconvert.export(art_copy, "fake")
    assert res.ok and counts == {"read": 1, "write": 1}
    counts.update(read=0, write=0)
    mpsconvert.check(art_copy, "fake")
    assert counts == {"read": 1, "write": 1}
