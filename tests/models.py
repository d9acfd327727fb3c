"""Builders for tiny random models saved as Hugging Face folders (hidden sizes multiples of 16)."""

from __future__ import annotations

from pathlib import Path

import torch


def coreml_tiny_llama(path: Path, seed: int = 0, tie: bool = True) -> Path:
    """A 2-layer Llama (GQA, tied embeddings by default) saved as BF16 safetensors."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return Path(path)


def coreml_tiny_bert(path: Path, seed: int = 0) -> Path:
    """A 2-layer BERT encoder (BertModel) saved as F32 safetensors."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128,
    )
    cfg.architectures = ["BertModel"]
    model = transformers.BertModel(cfg)
    model.save_pretrained(path)
    return Path(path)
