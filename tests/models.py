"""Tiny model builders for the tests (random weights, real tokenizers trained on the spot)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DATA = Path(__file__).parents[2] / "shared" / "data"


def runtime_texts(n: int = 20) -> list[str]:
    """Real English prose from ../shared/data/wiki_eval.jsonl."""
    lines = (DATA / "wiki_eval.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(l)["text"] for l in lines[:n]]


def runtime_tokenizer(vocab: int = 512):
    """A byte-level BPE tokenizer trained on wiki_calib text (offline, < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = (DATA / "wiki_calib.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator((json.loads(l)["text"] for l in lines), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def runtime_tiny_llama(folder: Path, tie: bool = True, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads) with a tokenizer, saved as BF16 safetensors."""
    import transformers

    tok = runtime_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


def runtime_tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer BERT encoder (hidden 64) with a WordPiece-free BPE tokenizer, BF16 safetensors."""
    import transformers

    tok = runtime_tokenizer()
    tok.pad_token = tok.eos_token
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=tok.eos_token_id)
    cfg.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)
