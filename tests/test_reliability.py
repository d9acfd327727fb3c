"""Bad inputs, interrupted runs and faults: nothing crashes outside our clear errors, nothing is lost."""

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.errors import ArtifactError, MpsconvertError, SourceError
from mpsconvert.infra import atomic, safetensors_io, safetensors_writer
from mpsconvert.manifests.hashing import BackgroundHasher, sha256_file
from mpsconvert.manifests.manifest import MANIFEST_NAME
from mpsconvert.source import snapshot as source

FUZZ_EXAMPLES = 400


def _st_file(tmp, header: dict | bytes, data: bytes = b"", hlen: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    p = tmp / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)
    return p


entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "F8_E4M3", "I64", "F99", "", "U8", "bogus"]),
        "shape": st.one_of(st.lists(st.integers(-2, 40), max_size=4), st.text(max_size=3), st.none()),
        "data_offsets": st.one_of(st.lists(st.integers(-5, 300), min_size=0, max_size=3), st.none(), st.booleans()),
    }
)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tensors=st.dictionaries(st.text(min_size=0, max_size=8), entry, max_size=4),
    meta=st.one_of(
        st.none(), st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), st.integers())), st.integers()
    ),
    data=st.binary(max_size=300),
    hlen_delta=st.sampled_from([0, 0, 0, 1, -1, 10**6, 2**63]),
)
def test_fuzzed_safetensors_headers_give_valid_files_or_our_error(tmp_path, tensors, meta, data, hlen_delta):
    header = dict(tensors)
    if meta is not None:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    p = _st_file(tmp_path, raw, data, hlen=max(0, min(len(raw) + hlen_delta, 2**64 - 1)))
    try:
        h = safetensors_io.read_header(p)
    except ArtifactError as e:
        assert "x.safetensors" in str(e)
        return
    # Accepted: then every tensor must read back through our reader and the safetensors library.
    from safetensors import safe_open

    with safetensors_io.ShardReader(h) as r, safe_open(p, "pt") as f:
        for name, info in h.tensors.items():
            t = safetensors_io.as_tensor(r.read(info), info)
            assert torch.equal(
                t.view(torch.uint8) if t.numel() else t, f.get_tensor(name).view(torch.uint8) if t.numel() else t
            )
    assert BackgroundHasher([p]).sha256(p) == hashlib.sha256(p.read_bytes()).hexdigest()


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda wm: json.dumps({"weight_map": wm}).encode(),
            st.dictionaries(
                st.text(max_size=6),
                st.one_of(
                    st.text(max_size=12),
                    st.integers(),
                    st.none(),
                    st.sampled_from(
                        [
                            "../a.safetensors",
                            "/abs.safetensors",
                            "a/b.safetensors",
                            "ok.safetensors",
                            ".hidden.safetensors",
                        ]
                    ),
                ),
                max_size=4,
            ),
        ),
    )
)
def test_fuzzed_index_files_give_a_map_of_plain_names_or_our_error(tmp_path, body):
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(body)
    try:
        wm = source._read_index(p)
    except SourceError:
        return
    for f in wm.values():
        assert f.endswith(".safetensors") and "/" not in f and ".." not in Path(f).parts and not f.startswith(".")


def test_symlink_out_of_the_snapshot_is_refused(tmp_path, tiny_models):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], d)
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": 1}')
    (d / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(SourceError, match="outside the model folder"):
        quantize_snapshot(source.resolve(str(d)), tmp_path / "out", Options())
    (d / "tokenizer_config.json").unlink()
    outside = tmp_path / "w.safetensors"
    shutil.move(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(SourceError, match="outside the model folder"):
        source.resolve(str(d))
    assert not (tmp_path / "out").exists()


def test_tensor_stored_twice_or_index_disagreeing_is_refused(tmp_path, tiny_models):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["llama_sharded"], d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    save_file({"model.norm.weight": torch.ones(64)}, d / files[0].replace("00001", "00009"))
    idx["weight_map"]["model.norm.weight"] = files[0].replace("00001", "00009")
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match="stored in both"):
        quantize_snapshot(source.resolve(str(d)), tmp_path / "out", Options())
    assert not (tmp_path / "out").exists()


def test_identical_runs_give_identical_files(tiny_models, tmp_path):
    # same inputs and options, the output's name included (the card's commands name the folder)
    for o in ("a", "b"):
        quantize_snapshot(source.resolve(str(tiny_models["llama_sharded"])), tmp_path / o / "out", Options())
    names = sorted(p.name for p in (tmp_path / "a" / "out").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b" / "out").iterdir())
    for n in names:
        a, b = (tmp_path / "a" / "out" / n).read_bytes(), (tmp_path / "b" / "out" / n).read_bytes()
        if n == MANIFEST_NAME:
            ja, jb = json.loads(a), json.loads(b)
            ja.pop("created"), jb.pop("created")
            assert ja == jb
        else:
            assert a == b, n


def test_a_second_run_into_the_same_output_fails_clearly(tiny_models, tmp_path):
    out = tmp_path / "out"
    with atomic.locked(out.absolute()):
        with pytest.raises(MpsconvertError, match="another mpsconvert run is writing"):
            quantize_snapshot(source.resolve(str(tiny_models["llama"])), out, Options())
    assert not out.exists()
    quantize_snapshot(source.resolve(str(tiny_models["llama"])), out, Options())  # lock released
    assert (out / MANIFEST_NAME).is_file()


def test_disk_full_during_write_is_reported_and_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    real = safetensors_writer.ShardWriter._write
    written = {"n": 0}

    def full(self, data):
        written["n"] += memoryview(data).nbytes
        if written["n"] > 50_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(safetensors_writer.ShardWriter, "_write", full)
    with pytest.raises(MpsconvertError, match="is full"):
        quantize_snapshot(source.resolve(str(tiny_models["llama"])), tmp_path / "out", Options())
    assert sorted(os.listdir(tmp_path)) == []


def test_not_enough_free_space_is_refused_before_writing(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(MpsconvertError, match="not enough disk space"):
        quantize_snapshot(source.resolve(str(tiny_models["llama"])), tmp_path / "out", Options())
    assert sorted(os.listdir(tmp_path)) == []


def test_real_tiny_filesystem_runs_out_of_space(tiny_models, tmp_path):
    """A real 200 KiB tmpfs (root only): the preflight or the writer reports the full disk."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(MpsconvertError, match="not enough disk space|is full"):
            quantize_snapshot(source.resolve(str(tiny_models["llama_bf16"])), mnt / "out", Options())
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)])


def test_unwritable_output_location(tiny_models, tmp_path):
    if os.geteuid() == 0:
        target = Path("/proc/mpsconvert-out")  # even root cannot create folders in /proc
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        target = ro / "out"
    with pytest.raises(MpsconvertError, match="cannot write to|failed"):
        quantize_snapshot(source.resolve(str(tiny_models["llama"])), target, Options())


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory):
    """~100 MB checkpoint: a conversion slow enough (about a second) to be killed midway."""
    from .models import tiny_config

    d = tmp_path_factory.mktemp("medium") / "m"
    d.mkdir()
    cfg = tiny_config(
        "llama",
        vocab=4096,
        layers=8,
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    for shard in range(2):
        sd = {}
        for i in range(shard * 4, shard * 4 + 4):
            p = f"model.layers.{i}."
            for n, s in [
                ("self_attn.q_proj", (512, 512)),
                ("self_attn.k_proj", (256, 512)),
                ("self_attn.v_proj", (256, 512)),
                ("self_attn.o_proj", (512, 512)),
                ("mlp.gate_proj", (2048, 512)),
                ("mlp.up_proj", (2048, 512)),
                ("mlp.down_proj", (512, 2048)),
            ]:
                sd[p + n + ".weight"] = torch.randn(*s, generator=g)
            sd[p + "input_layernorm.weight"] = torch.ones(512)
            sd[p + "post_attention_layernorm.weight"] = torch.ones(512)
        if shard == 0:
            sd["model.embed_tokens.weight"] = torch.randn(4096, 512, generator=g)
            sd["model.norm.weight"] = torch.ones(512)
            sd["lm_head.weight"] = torch.randn(4096, 512, generator=g)
        save_file(sd, d / f"model-0000{shard + 1}-of-00002.safetensors", metadata={"format": "pt"})
    wm = {}
    for f in sorted(d.glob("*.safetensors")):
        wm.update({k: f.name for k in safetensors_io.read_header(f).tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


def _states(parent: Path, name: str):
    tmps = [p for p in parent.glob(f"{atomic.TMP_PREFIX}{name}-*")]
    files = []
    for t in tmps:
        try:
            files += [f.name for f in t.iterdir()]
        except (FileNotFoundError, NotADirectoryError):  # renamed into place (or a lock file) meanwhile
            pass
    return tmps, files


KILL_POINTS = {
    "starting": lambda tmps, files: False,  # killed after a fixed short delay, before any output
    "temp-folder-made": lambda tmps, files: bool(tmps),
    "first-shard-open": lambda tmps, files: any(f.endswith(".safetensors") for f in files),
    "second-shard-open": lambda tmps, files: sum(f.endswith(".safetensors") for f in files) >= 2,
    "config-written": lambda tmps, files: "config.json" in files,
}


def _quantize_proc(src, out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "mpsconvert.cli", "quantize", str(src), "-o", str(out), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _assert_complete_or_absent(out: Path):
    if out.exists():  # only ever the finished artifact
        m = json.loads((out / MANIFEST_NAME).read_text())
        for name, f in m["files"].items():
            assert sha256_file(out / name) == f["sha256"]


@pytest.mark.parametrize(
    "sig,points",
    [
        (signal.SIGKILL, list(KILL_POINTS)),
        (signal.SIGTERM, ["first-shard-open", "config-written"]),
        (signal.SIGINT, ["second-shard-open"]),
    ],
)
@pytest.mark.slow  # a real process killed at several points: 4 min on 2 cores
def test_killing_a_real_conversion_at_several_points_then_rerunning(medium_model, tmp_path, sig, points):
    out = tmp_path / "out"
    hit = []
    for point in points:
        ready = KILL_POINTS[point]
        proc = _quantize_proc(medium_model, out)
        t0 = time.monotonic()
        while proc.poll() is None:
            tmps, files = _states(tmp_path, "out")
            if ready(tmps, files) or (point == "starting" and time.monotonic() - t0 > 0.3):
                proc.send_signal(sig)
                hit.append(point)
                break
            time.sleep(0.001)
        proc.wait(timeout=120)
        _assert_complete_or_absent(out)
        tmps, _ = _states(tmp_path, "out")
        if sig != signal.SIGKILL:
            assert tmps == [], f"{sig.name} at {point} left {tmps}"  # cleanup ran
            # 130/143: our handler removed the partial output; 1: click's "Aborted!" before it started
            assert proc.returncode in (1, 130, 143, -sig), proc.returncode
        if out.exists():
            shutil.rmtree(out)
    assert len(hit) >= min(3, len(points)), hit  # the kill points were reached before the run finished
    proc = _quantize_proc(medium_model, out)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    _assert_complete_or_absent(out)
    assert _states(tmp_path, "out")[0] == []  # the re-run removed what the killed runs left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("where", ["weights", "scale_region", "config"])
def test_one_flipped_byte_is_caught_by_verify_and_by_load(tiny_models, tmp_path, where):
    from click.testing import CliRunner

    from mpsconvert.cli import main
    from mpsconvert.runtime import load

    out = tmp_path / "out"
    quantize_snapshot(source.resolve(str(tiny_models["llama"])), out, Options())
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    f = out / ("config.json" if where == "config" else "model.safetensors")
    data = bytearray(f.read_bytes())
    pos = {"weights": len(data) // 2, "scale_region": len(data) - 3, "config": len(data) // 2}[where]
    data[pos] ^= 0x01
    f.write_bytes(bytes(data))
    res = CliRunner().invoke(main, ["verify", str(out)])
    assert res.exit_code == 1 and f"{f.name} does not match the sha256" in res.output
    with pytest.raises(ArtifactError, match="failed verification"):
        load(out, device="cpu")


def test_an_output_is_never_published_after_a_stop_was_requested(tmp_path):
    """The KeyboardInterrupt of a signal can be lost in a finalizer; the commit checks the flag."""
    target = tmp_path / "out"
    atomic.stop_requested.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic.output_dir(target) as tmp:
                (tmp / "x").write_text("x")
    finally:
        atomic.stop_requested.clear()
    assert sorted(os.listdir(tmp_path)) == []
