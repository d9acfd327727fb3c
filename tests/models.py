"""Tiny random models of several architectures, saved with transformers (no downloads).

Sizes are multiples of 16 (what FP8 GEMMs want) and small enough that a conversion takes well
under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _save(model, path: Path, dtype=torch.float32, **kw) -> Path:
    model.to(dtype).save_pretrained(path, **kw)
    return path


def tiny_llama(path: Path, dtype=torch.float32, tie=False, **kw) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return _save(LlamaForCausalLM(cfg), path, dtype, **kw)


def tiny_qwen2_tied(path: Path, dtype=torch.float32) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM(cfg), path, dtype)


def tiny_mistral(path: Path, dtype=torch.float32) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    return _save(MistralForCausalLM(cfg), path, dtype)


def tiny_bert(path: Path, dtype=torch.float32) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(3)
    cfg = BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    return _save(BertModel(cfg), path, dtype)


def tiny_gpt2(path: Path, dtype=torch.float32) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return _save(GPT2LMHeadModel(cfg), path, dtype)


def tiny_llama_sharded(path: Path, dtype=torch.float32) -> Path:
    return tiny_llama(path, dtype=dtype, max_shard_size="100KB")
