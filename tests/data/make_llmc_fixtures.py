"""Re-create the llm-compressor FP8 fixtures under tests/data/llmc/ (needs llmcompressor 0.14).

  python tests/data/make_llmc_fixtures.py

bf16/: a 2-layer random Llama (hidden 64, vocab 256) in BF16; model_free/: llm-compressor's
`model_free_ptq(..., scheme="FP8_DYNAMIC")` of it (which also quantizes embed_tokens);
oneshot/: `oneshot(QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))`
then `save_pretrained(save_compressed=True)`. Committed so CI (no llmcompressor) tests loading them.

  python tests/data/make_llmc_fixtures.py block

fp8_block/: `model_free_ptq(..., scheme="FP8_BLOCK", ignore=["lm_head"])` of a 2-layer random
Llama with hidden 128 (FP8_BLOCK needs dimensions that 128 divides; the BF16 source is not
kept: the tests compare with the fixture's own dequantization): 128x128
block weight scales, dynamic per-group activations. Made with llmcompressor 0.14.0.1 and
compressed-tensors 0.19.0 installed with `pip install --no-deps --target DIR` beside the
project's environment (llmcompressor pins transformers <= 5.17; its model-free path does not
use transformers' model classes).
"""

import shutil
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).parent / "llmc"


def main():
    from llmcompressor import model_free_ptq, oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    shutil.rmtree(HERE, ignore_errors=True)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(HERE / "bf16")
    model_free_ptq(str(HERE / "bf16"), str(HERE / "model_free"), scheme="FP8_DYNAMIC", ignore=["lm_head"])
    m = transformers.AutoModelForCausalLM.from_pretrained(HERE / "bf16", dtype=torch.bfloat16)
    oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    m.save_pretrained(HERE / "oneshot", save_compressed=True)
    (HERE / "oneshot" / "recipe.yaml").unlink(missing_ok=True)


def block():
    import tempfile

    from llmcompressor import model_free_ptq

    shutil.rmtree(HERE / "fp8_block", ignore_errors=True)
    src = Path(tempfile.mkdtemp()) / "block_bf16"
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    model_free_ptq(str(src), str(HERE / "fp8_block"), scheme="FP8_BLOCK", ignore=["lm_head"])
    shutil.rmtree(src.parent)


if __name__ == "__main__":
    import sys

    block() if sys.argv[1:] == ["block"] else main()
