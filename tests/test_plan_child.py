"""The plan built by a child process while the shards are written with a plan guessed from the
tensor names (convert/plan_child.py, convert/guess.py): the artifact is byte for byte the one
the in-process plan writes, whichever way the guess and the child go, and the manifest says
which path ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mpsconvert import convert
from mpsconvert.convert import guess, plan_child, quantize, quantize_plan
from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.errors import SourceError
from mpsconvert.format.schemes import Scheme
from mpsconvert.source.snapshot import resolve

from . import models


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return models.tiny("llama", tmp_path_factory.mktemp("plan-child") / "bf16", dtype=torch.bfloat16, tie=False)


def _convert(src, out, **kw):
    quantize_snapshot(resolve(str(src)), out, Options(scheme=Scheme.make("fp8-dynamic", "row"), force=True, **kw))
    manifest = json.loads((out / "mpsconvert.json").read_text())
    shards = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}
    return manifest, shards


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    """The artifact as the in-process plan writes it (a checkpoint below plan_child.MIN_BYTES)."""
    manifest, shards = _convert(src, tmp_path_factory.mktemp("ref") / "out")
    assert "plan" not in manifest["created"]
    return manifest, shards


@pytest.fixture
def child_path(monkeypatch):
    monkeypatch.setattr(plan_child, "MIN_BYTES", 0)
    monkeypatch.setattr(plan_child, "MIN_CPUS", 1)


@pytest.mark.slow  # 2 min on 2 cores
def test_the_guess_agrees_with_the_child_and_the_bytes_are_the_in_process_ones(src, reference, tmp_path, child_path):
    manifest, shards = _convert(src, tmp_path / "out")
    assert (
        manifest["created"]["plan"]
        == "guessed from the tensor names while a child process read the model definition; the two agreed"
    )
    assert shards == reference[1]
    assert manifest["tensors"] == reference[0]["tensors"]


def test_a_wrong_guess_is_caught_and_the_shards_written_again(src, reference, tmp_path, child_path, monkeypatch):
    real = guess.guess

    def short(config, headers, ignore):  # misses one Linear
        found = real(config, headers, ignore)
        found.pop(sorted(found)[0])
        return found

    monkeypatch.setattr(guess, "guess", short)
    manifest, shards = _convert(src, tmp_path / "out")
    assert manifest["created"]["plan"].startswith(
        "the model definition, read by a child process (the guess from the tensor names differed"
    )
    assert shards == reference[1]
    assert manifest["tensors"] == reference[0]["tensors"]


def test_a_failed_child_leaves_the_plan_to_this_process_and_says_so(src, reference, tmp_path, child_path, monkeypatch):
    monkeypatch.setattr(
        plan_child.PlanChild, "command", [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"]
    )
    manifest, shards = _convert(src, tmp_path / "out")
    assert "while this process (the child exited with 3: boom) read the model definition" in manifest["created"]["plan"]
    assert shards == reference[1]


def test_a_checkpoint_that_does_not_fit_its_config_is_refused_as_without_a_child(src, tmp_path, child_path):
    """The child's shape check fails; the parent builds the plan itself and raises the real error."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="shape"):
        _convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_child_reports_the_plan_it_built(src):
    child = plan_child.PlanChild(src, [], ["model.safetensors"])
    plan = child.result()
    assert child.why_not is None and child.built_by == "a child process"
    from mpsconvert.model.plan import plan_for

    here = plan_for(src, [])
    assert (plan.architecture, plan.quantize, plan.ignored, plan.skipped, plan.prefix) == (
        here.architecture,
        here.quantize,
        here.ignored,
        here.skipped,
        here.prefix,
    )


def test_the_parent_never_imports_transformers_on_the_child_path(src, tmp_path):
    code = f"""
import sys, torch
from mpsconvert.convert import quantize
from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.format.schemes import Scheme
from mpsconvert.source.snapshot import resolve
from mpsconvert.convert import plan_child; plan_child.MIN_BYTES = 0; plan_child.MIN_CPUS = 1
out = __import__('pathlib').Path({str(tmp_path / "out")!r})
quantize_snapshot(resolve({str(src)!r}), out, Options(scheme=Scheme.make('fp8-dynamic', 'row')))
print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "size", ["1GB", "500MB", "2GiB", "3MiB", "7KiB", "10KB", "8Gb", "16mb", "100kB", "5gib", 123456]
)
def test_shard_sizes_read_as_transformers_reads_them(size):
    from transformers.utils.hub import convert_file_size_to_int

    assert convert.shard_size_bytes(size) == convert_file_size_to_int(size)


@pytest.mark.parametrize("size", ["1TB", "GB", "-1GB", "1.5GB", "0MB", 0, True, None, "１GB"])
def test_sizes_transformers_would_not_read_are_refused_in_one_line(size):
    from mpsconvert.errors import QuantizationError

    with pytest.raises(QuantizationError, match="cannot read .* as a shard size"):
        convert.shard_size_bytes(size)


def test_the_cli_starts_the_child_before_it_imports_torch(src, tmp_path):
    """`mpsconvert quantize` starts the plan's child at the top of the conversion, so that the
    child's imports run beside the parent's own (torch's), not after them."""
    code = f"""
import sys, runpy
from mpsconvert.convert import plan_child
plan_child.MIN_BYTES = 0
plan_child.MIN_CPUS = 1
init = plan_child.PlanChild.__init__
def spy(self, *a, **kw):
    print("torch imported when the child started:", "torch" in sys.modules, file=sys.stderr)
    init(self, *a, **kw)
plan_child.PlanChild.__init__ = spy
sys.argv = ["mpsconvert", "quantize", {str(src)!r}, "-o", {str(tmp_path / "out")!r}]
runpy.run_module("mpsconvert.cli", run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("torch imported when the child started: False") == 1
    manifest = json.loads((tmp_path / "out" / "mpsconvert.json").read_text())
    assert manifest["created"]["plan"].startswith(
        "guessed from the tensor names while a child process read the model definition"
    )


def test_a_child_that_imports_another_mpsconvert_says_so_and_builds_nothing(src):
    from mpsconvert.infra import child

    request = {"path": str(src), "ignore": [], "weight_files": ["model.safetensors"]}
    body = child.answer_for(plan_child._main, request | {"package": "/elsewhere"})
    assert body == {"error": f"the child imported the mpsconvert in {child.package_root()}, not the one in /elsewhere"}
    assert (
        child.answer_for(plan_child._main, request | {"package": str(child.package_root())})["architecture"]
        == "LlamaForCausalLM"
    )


def test_a_child_plans_only_big_checkpoints_on_machines_with_cores_to_spare(monkeypatch):
    monkeypatch.setattr(plan_child.os, "cpu_count", lambda: 16)
    assert plan_child.worth_it(plan_child.MIN_BYTES) and not plan_child.worth_it(plan_child.MIN_BYTES - 1)
    monkeypatch.setattr(plan_child.os, "cpu_count", lambda: 2)
    assert not plan_child.worth_it(16 << 30)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_guess_is_the_real_plan_for_every_architecture_it_knows(arch, tmp_path):
    """A guess that differed would cost a second write of every shard: for each architecture in
    guess.RULES it names exactly the tensors, with their modules, that the model's own plan does."""
    from mpsconvert.infra.safetensors_io import read_header

    path = models.tiny(arch, tmp_path / arch, dtype=torch.bfloat16, tie=False)
    snap = resolve(str(path))
    headers = {f: read_header(snap.path / f) for f in snap.weight_files}
    opts = Options(scheme=Scheme.make("fp8-dynamic", "row"))
    _, _, tensor_module, expert_tensors = quantize_plan.prepare(snap, opts, headers)
    assert guess.guess(snap.config, headers, []) == tensor_module and expert_tensors == {}
    ignored = sorted(tensor_module)[0][: -len(".weight")]
    _, _, tensor_module, _ = quantize_plan.prepare(snap, Options(scheme=opts.scheme, ignore=[ignored]), headers)
    assert guess.guess(snap.config, headers, [ignored]) == tensor_module


def test_a_conversion_that_fails_while_writing_leaves_no_child_and_no_output(src, tmp_path, child_path, monkeypatch):
    started = []
    init = plan_child.PlanChild.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        started.append(self)

    def broken(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(plan_child.PlanChild, "__init__", spy)
    monkeypatch.setattr(quantize, "_write_shards", broken)
    from mpsconvert.errors import MpsconvertError

    with pytest.raises(MpsconvertError, match="failed: disk full"):
        _convert(src, tmp_path / "out")
    assert len(started) == 1 and started[0]._proc.poll() is not None  # killed, or done: not left running
    assert not (tmp_path / "out").exists()
