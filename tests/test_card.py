"""The model card: YAML front matter whose figures are the manifest's, rewritten by validate
(atomically, its new sha256 in the manifest), the source's card kept below, deterministic."""

import shutil

import torch
import yaml
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main
from mpsconvert.manifests import card
from mpsconvert.manifests.manifest import Manifest

from . import models

SOURCE_CARD = """---
license: apache-2.0
language: [en]
tags: [text-generation]
---

# Tiny Llama

Trained on nothing at all. Citation: none.
"""


def front(folder):
    meta, body = card.split_front_matter((folder / "README.md").read_text())
    assert meta, "no YAML front matter"
    return meta, body


def test_card_front_matter_is_the_manifests(tmp_path, text_data):
    src = models.tiny("llama", tmp_path / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    (src / "README.md").write_text(SOURCE_CARD)
    art = mpsconvert.quantize(src, tmp_path / "a").output
    text = (art / "README.md").read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])  # the front matter parses as YAML on its own
    m = Manifest.read(art)
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert {"fp8", "compressed-tensors", "mpsconvert"} <= set(meta["tags"])
    f = meta["mpsconvert"]
    assert f["scheme"] == m.recipe["name"] == "fp8-dynamic" and f["weights"] == m.recipe["weights"]
    assert f["tensors_quantized"] == m.summary["tensors_quantized"]
    assert (
        f["weight_bytes_before"] == m.summary["weight_bytes_before"]
        and f["weight_bytes_after"] == m.summary["weight_bytes_after"]
    )
    assert f["worst_sqnr_db"] == round(m.summary["worst_sqnr_db"], 2) and f["validation"] == []
    assert "base_model" not in meta  # a local folder is not a hub model to point at
    # the source's card is kept below, attributed, without its own front matter
    body = text.split(card.SOURCE_MARKER, 1)[1]
    assert "# Tiny Llama" in body and "Trained on nothing at all." in body and "license: apache-2.0" not in body
    # "How to load" names the folder the artifact is in (-o a), not quantize's default name (src-fp8-dynamic)
    assert (
        "lm_head" in text
        and "Not validated yet" in text
        and "mpsconvert generate a " in text
        and "src-fp8-dynamic" not in text
    )
    assert (
        m.files["README.md"]["sha256"] != m.source["files"]["README.md"]
    )  # the card, recorded; the source's own hash kept
    assert mpsconvert.verify(art).ok
    again = mpsconvert.quantize(src, tmp_path / "elsewhere" / "a").output  # deterministic: same inputs, same bytes
    assert (again / "README.md").read_text() == text


def test_hub_source_gets_base_model(tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(
        c, "HF_HUB_CACHE", str(tmp_path / "hub")
    )  # provenance only for a snapshot in huggingface_hub's own cache
    src = models.tiny(
        "llama",
        tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("c" * 40),
        tokenizer="bpe",
        dtype=torch.bfloat16,
        tie=True,
    )
    art = mpsconvert.quantize(src, tmp_path / "a").output
    meta, _ = front(art)
    # a snapshot in huggingface_hub's own cache keeps its provenance (source.resolve): the card points at the hub model
    m = Manifest.read(art)
    assert meta["base_model"] == "org/tiny" and meta["base_model_relation"] == "quantized"
    assert (
        meta["mpsconvert"]["source"] == m.source["id"] == "org/tiny" and meta["mpsconvert"]["source_commit"] == "c" * 40
    )
    # the same layout anywhere else is a plain local folder: no hub model, no commit is claimed
    fake = tmp_path / "elsewhere" / "models--org--tiny" / "snapshots" / ("c" * 40)
    shutil.copytree(src, fake)
    meta, _ = front(mpsconvert.quantize(fake, tmp_path / "b").output)
    assert "base_model" not in meta and "source_commit" not in meta["mpsconvert"] and "org/tiny" not in str(meta)


def test_validate_rewrites_the_card(tmp_path, text_data):
    src = models.tiny("llama", tmp_path / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    art = mpsconvert.quantize(src, tmp_path / "a").output
    res = CliRunner().invoke(
        main,
        [
            "validate",
            str(art),
            "--device",
            "cpu",
            "--max-samples",
            "1",
            "--seq-len",
            "64",
            "--prefill-len",
            "32",
            "--decode-tokens",
            "2",
            "--repeats",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--eval-data",
            str(text_data / "wiki_eval.jsonl"),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    meta, body = front(art)
    m = Manifest.read(art)
    (run,) = m.extra["validation"].values()
    (v,) = meta["mpsconvert"]["validation"]
    a = run["accuracy"]
    assert v["perplexity_bf16"] == round(a["perplexity_bf16"], 4) and v["perplexity_fp8"] == round(
        a["perplexity_fp8"], 4
    )
    assert v["mean_kl"] == round(a["mean_kl"], 6) and v["top1_agreement"] == round(a["top1_agreement"], 4)
    assert v["decode_speedup"] == round(run["speedup"]["decode"], 3) and v["device"] == "cpu"
    assert "Not validated yet" not in body and f"{v['perplexity_fp8']}" in body
    assert mpsconvert.verify(art).ok  # the rewritten card's sha256 is the manifest's
