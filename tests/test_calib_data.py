"""Calibration data sources and deterministic drawing."""

import json

import pytest

from mpsconvert.calibrate import data

from .models import TEXT_DATA, minilm_dir

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def test_builtin_set_ships_varied_text_and_draws_deterministically(tok):
    corpus = data.load(None)
    kinds = {json.loads(line)["kind"] for line in data.BUILTIN.read_text(encoding="utf-8").splitlines()}
    assert {"prose", "code", "dialogue"} <= kinds
    assert corpus.source["kind"] == "builtin" and corpus.source["documents"] == len(corpus.texts) >= 12
    a = data.draw(corpus, tok, 10, 64, seed=3)
    b = data.draw(data.load(None), tok, 10, 64, seed=3)
    c = data.draw(corpus, tok, 10, 64, seed=4)
    assert a.input_ids == b.input_ids and a.drawn == b.drawn
    assert a.drawn != c.drawn  # the seed changes what is drawn
    assert len(a.input_ids) == 10 and all(16 <= len(s) <= 64 for s in a.input_ids)
    # What was drawn is recorded exactly: re-tokenizing the named document reproduces each window.
    for ids, d in zip(a.input_ids, a.drawn):
        full = tok(corpus.texts[d["doc"]])["input_ids"]
        assert full[d["start"] : d["start"] + d["tokens"]] == ids


def test_more_samples_than_documents_takes_several_windows_per_document(tok):
    corpus = data.load(str(TEXT_DATA / "wiki_calib.jsonl"))
    s = data.draw(corpus, tok, 100, 128, seed=0)
    assert len(s.input_ids) == 100
    assert len({d["doc"] for d in s.drawn}) == corpus.source["documents"]  # every document used
    assert any(d["start"] > 0 for d in s.drawn)
    assert len({(d["doc"], d["start"]) for d in s.drawn}) == 100  # no window twice


def test_text_that_falls_short_is_warned_with_what_to_do(tok, tmp_path):
    own = tmp_path / "notes.jsonl"  # the user's own text: a short one is warned about
    own.write_text("".join(json.dumps({"text": t}) + "\n" for t in data.load(None).texts), encoding="utf-8")
    corpus = data.load(str(own))
    n = corpus.source["documents"]
    enough = data.draw(corpus, tok, 4, 32, seed=0)  # short windows that the documents fill
    assert not data.short(enough, 4, 32) and data.short_text(enough, 4, 32, corpus.source) is None
    few = data.draw(corpus, tok, n + 5000, 32, seed=0)  # more windows than the text holds
    assert len(few.input_ids) < n + 5000 and data.short(few, n + 5000, 32)
    said = data.short_text(few, n + 5000, 32, corpus.source)
    assert said.startswith(f"the calibration text gave {len(few.input_ids)} windows of the {n + 5000} asked for")
    assert str(own) in said and "--calib-data" in said
    long = data.draw(corpus, tok, 4, 4096, seed=0)  # every window asked for, each far shorter than --seq-len
    assert len(long.input_ids) == 4 and long.tokens < 4 * 4096 // 2 and data.short(long, 4, 4096)
    assert f"{long.tokens} tokens of the {4 * 4096}" in data.short_text(long, 4, 4096, corpus.source)
    # the built-in set is small by design: short, but not warned (calibrate's summary line says it)
    builtin = data.load(None)
    assert data.short(data.draw(builtin, tok, 4, 4096, seed=0), 4, 4096)
    assert data.short_text(data.draw(builtin, tok, 4, 4096, seed=0), 4, 4096, builtin.source) is None


def test_text_and_jsonl_files(tmp_path, tok):
    txt = tmp_path / "notes.txt"
    txt.write_text(
        "first document, about rivers and lakes.\n\nsecond document about mountains.\n\n\n", encoding="utf-8"
    )
    c = data.load(str(txt))
    assert c.texts == ["first document, about rivers and lakes.", "second document about mountains."]
    assert c.source["kind"] == "file" and len(c.source["sha256"]) == 64
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "alpha beta"}\n\n{"text": "gamma", "id": 2}\n', encoding="utf-8")
    assert data.load(str(jl)).texts == ["alpha beta", "gamma"]
    # The hash names the bytes: changing the data changes it.
    h1 = data.load(str(jl)).source["sha256"]
    jl.write_text('{"text": "alpha beta!"}\n', encoding="utf-8")
    assert data.load(str(jl)).source["sha256"] != h1


@pytest.mark.extra("data")
def test_parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two", "three"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    assert data.load(str(tmp_path / "d.parquet")).texts == ["one", "two", "three"]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    """A base install has no pyarrow: one line naming the extra, not an ImportError."""
    from mpsconvert.errors import MissingExtraError

    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    for name in ("pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # what `import` finds for a missing module
    with pytest.raises(MissingExtraError, match=r"pip install 'mpsconvert\[data\]'"):
        data.load(str(tmp_path / "d.parquet"))


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"text": "ok"}\n{"body": "no text"}\n', "record 2"),
        ('{"text": "ok"}\nnot json\n', ":2 is not valid JSON"),
        ("\n\n", "no non-empty text"),
    ],
)
def test_bad_jsonl_is_a_one_line_error(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(data.DataError, match=match):
        data.load(str(p))


def test_neither_file_nor_repo_id(tmp_path):
    with pytest.raises(data.DataError, match="neither a file"):
        data.load(str(tmp_path / "missing.jsonl"))


def _fake_dataset_cache(root, repo="acme/tiny-text", commit="0123456789abcdef0123456789abcdef01234567"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = root / f"datasets--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    (snap / "data").mkdir(parents=True)
    pq.write_table(
        pa.table({"text": [f"training document number {i}, with some words in it." * 3 for i in range(6)]}),
        snap / "data" / "train-00000-of-00001.parquet",
    )
    pq.write_table(pa.table({"text": ["held-out test document"]}), snap / "data" / "test-00000-of-00001.parquet")
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    return repo, commit


def _offline(monkeypatch, cache):
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)


@pytest.mark.extra("data")  # a hub dataset ships parquet files
def test_dataset_repo_id_from_the_hf_cache_offline(tmp_path, monkeypatch, tok):
    repo, commit = _fake_dataset_cache(tmp_path / "hub")
    _offline(monkeypatch, tmp_path / "hub")
    corpus = data.load(repo)
    assert corpus.source["kind"] == "dataset" and corpus.source["id"] == repo and corpus.source["commit"] == commit
    assert list(corpus.source["files"]) == ["data/train-00000-of-00001.parquet"]  # train split only
    assert len(corpus.texts) == 6 and all(t.startswith("training document") for t in corpus.texts)
    s = data.draw(corpus, tok, 4, 16, seed=0)
    assert len(s.input_ids) == 4


def test_dataset_missing_offline_says_so(tmp_path, monkeypatch):
    (tmp_path / "hub").mkdir()
    _offline(monkeypatch, tmp_path / "hub")
    with pytest.raises(data.DataError, match="not in the local Hugging Face cache"):
        data.load("acme/absent")
