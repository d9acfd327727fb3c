"""End-to-end smoke check of the merged package on a GPU machine (the H200 of the device tool).

Builds a small random Llama (4 layers, hidden 512), quantizes it with each data-free scheme,
loads it with `mpsconvert.runtime.load` on the GPU and on the CPU, compares their logits, and
runs `validate` (accuracy + latency, eager) on the GPU. Prints one line per check.

    python benchmarks/gpu_smoke.py [--eval-data FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _tokenizer(text_file: Path, vocab: int):
    """A byte-level BPE tokenizer trained on the eval text itself (offline, seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = text_file.read_text(encoding="utf-8").splitlines()[:30]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 4096), special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator((json.loads(line)["text"] for line in lines), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    import mpsconvert

    root = Path(args.workdir or tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    src = root / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    _tokenizer(Path(args.eval_data), cfg.vocab_size).save_pretrained(src)
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1))
    results = {}
    for scheme in ("fp8-dynamic", "fp8-weight-only"):
        out = root / scheme
        t = time.perf_counter()
        mpsconvert.quantize(src, out, scheme=scheme)
        gpu = mpsconvert.load(out, device=args.device)
        cpu = mpsconvert.load(out, device="cpu")
        with torch.no_grad():
            a = gpu(ids.to(args.device)).logits.float().cpu()
            b = cpu(ids).logits.float()
        rel = float((a - b).norm() / b.norm())
        kinds = sorted({type(m).__name__ for m in gpu.modules() if "FP8" in type(m).__name__ or "Fused" in type(m).__name__})
        fp8_params = sum(p.numel() for p in gpu.parameters() if p.dtype == torch.float8_e4m3fn) + \
            sum(b_.numel() for b_ in gpu.buffers() if b_.dtype == torch.float8_e4m3fn)
        v = mpsconvert.validate(out, options=mpsconvert.validate_options(
            baseline=str(src), eval_data=args.eval_data, device=args.device, seq_len=256, max_samples=4, prefill_len=256,
            decode_tokens=16, repeats=5, warmup=2, compile="off")).as_dict()
        results[scheme] = {"gpu_vs_cpu_rel_err": rel, "modules": kinds, "fp8_elements_on_gpu": fp8_params,
                           "accuracy": v.get("accuracy"), "speedup_eager": v.get("speedup"), "seconds": time.perf_counter() - t}
        print(f"{scheme}: GPU vs CPU logits rel err {rel:.4f}; modules {kinds}; FP8 elements on GPU {fp8_params}; "
              f"accuracy {json.dumps(v.get('accuracy'))[:300]}; eager speedup {v.get('speedup')}", flush=True)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
