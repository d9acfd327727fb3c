"""Model sources: local folders, the HF cache layout in offline mode, and every way it can fail."""

import hashlib
import shutil

import pytest

from mpsconvert.errors import SourceError
from mpsconvert.source import snapshot as source

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


def make_hf_cache(cache, repo_id, folder, commit="0123456789abcdef0123456789abcdef01234567", extra=()):
    """Lay `folder`'s files out as huggingface_hub does: blobs named by hash, snapshot symlinks."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in list(folder.iterdir()) + [p for p in extra]:
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(f"../../blobs/{blob}")
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_local_folder(tiny_models):
    snap = source.resolve(str(tiny_models["llama"]))
    assert snap.kind == "local" and snap.weight_files == ["model.safetensors"]
    assert snap.config["model_type"] == "llama"


def test_sharded_folder_reads_the_index(tiny_models):
    snap = source.resolve(str(tiny_models["llama_sharded"]))
    assert len(snap.weight_files) > 1 and "model.embed_tokens.weight" in snap.weight_map


def test_repo_id_from_offline_hf_cache_records_commit_and_lfs_hashes(tiny_models, offline_cache):
    snap_dir = make_hf_cache(offline_cache, "tiny/llama", tiny_models["llama"])
    snap = source.resolve("tiny/llama")
    assert snap.kind == "hub" and snap.repo_id == "tiny/llama"
    assert snap.commit == snap_dir.name and snap.path == snap_dir
    want = hashlib.sha256((tiny_models["llama"] / "model.safetensors").read_bytes()).hexdigest()
    assert snap.known_sha256("model.safetensors") == want
    assert snap.known_sha256("config.json") is None  # a git blob, not sha256: must be hashed


def test_cache_snapshot_folder_passed_as_path_keeps_provenance(tiny_models, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    snap_dir = make_hf_cache(tmp_path, "org/model", tiny_models["llama"])
    # outside huggingface_hub's own cache the layout is only a folder name: no provenance
    snap = source.resolve(str(snap_dir))
    assert snap.kind == "local" and snap.repo_id is None and snap.commit is None
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))  # inside it, the snapshot keeps its repo and commit
    snap = source.resolve(str(snap_dir))
    assert snap.kind == "local" and snap.repo_id == "org/model" and snap.commit == snap_dir.name


def test_repo_not_cached_offline_is_one_clear_error(offline_cache):
    with pytest.raises(SourceError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        source.resolve("nobody/nothing")


def _hub_error(name: str):
    """An instance of huggingface_hub's error class without its HTTP-response constructor (which
    takes an httpx or a requests response depending on the huggingface_hub version)."""
    from huggingface_hub import errors

    cls = getattr(errors, name)
    err = cls.__new__(cls)
    Exception.__init__(err, "boom")
    return err


@pytest.mark.parametrize(
    "err,match",
    [
        ("GatedRepoError", "is gated"),
        ("RepositoryNotFoundError", "was not found on the Hugging Face hub"),
        ("RevisionNotFoundError", "has no revision 'v9'"),
    ],
)
def test_hub_errors_become_one_line_errors(monkeypatch, err, match):
    import huggingface_hub

    def fake(*a, **k):
        raise _hub_error(err)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(SourceError, match=match) as e:
        source.resolve("org/model", revision="v9")
    assert "\n" not in str(e.value)


def test_token_and_revision_and_patterns_reach_huggingface_hub(monkeypatch, tiny_models, tmp_path):
    import huggingface_hub

    seen = {}
    snap_dir = make_hf_cache(tmp_path, "org/model", tiny_models["llama"], commit="c" * 40)

    def fake(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(snap_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    snap = source.resolve("org/model", revision="v1")
    assert seen["token"] == "hf_env" and seen["revision"] == "v1" and snap.commit == "c" * 40
    assert "*.safetensors" in seen["allow_patterns"] and not any(
        p.endswith((".bin", ".pt")) for p in seen["allow_patterns"]
    )
    source.resolve("org/model", token="hf_flag")
    assert seen["token"] == "hf_flag"


def test_missing_path_and_file_and_non_hf_folder(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        source.resolve(str(tmp_path / "nope"))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(SourceError, match="is a file"):
        source.resolve(str(tmp_path / "f.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        source.resolve(str(tmp_path / "empty"))


def test_pickle_only_checkpoint_is_refused_without_unpickling(tmp_path, tiny_models):
    d = tmp_path / "pkl"
    d.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", d)
    # A pickle that would run code if anything loaded it.
    (d / "pytorch_model.bin").write_bytes(
        b"\x80\x04cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR."
    )
    with pytest.raises(SourceError, match="only pickle weights.*never unpickles"):
        source.resolve(str(d))
    assert not (tmp_path / "pwned").exists()


def test_already_quantized_source_is_refused(tmp_path, tiny_models):
    import json

    d = tmp_path / "q"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="already quantized"):
        source.resolve(str(d))


@pytest.mark.parametrize("target", ["../evil.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors", "x.bin"])
def test_index_entries_must_be_plain_names_inside_the_snapshot(tmp_path, tiny_models, target):
    import json

    d = tmp_path / "m"
    shutil.copytree(tiny_models["llama_sharded"], d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = target
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match="not a plain .safetensors file name"):
        source.resolve(str(d))
