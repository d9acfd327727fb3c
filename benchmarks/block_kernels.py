"""Block-scaled FP8 layers (128x128 weights, 1x128 activations) on one GPU: is the blockwise
`torch._scaled_mm` right, and how fast is each candidate kernel against BF16 and per-row FP8.

For Llama-8B shapes at decode (M=1) and prefill (M=2048): the FP8Linear kernels the policy
chooses among (`scaled_mm_block`, `dequant`; per-row layers: `scaled_mm_row`, `gemv`), each
checked against the layer's dequantized weight times its rounded activations (fp64), and timed
with `timing.per_call_us` as the policy times them. Ratios are BF16 time / kernel time.

    python benchmarks/block_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from mpsconvert import fp8, timing  # noqa: E402
from mpsconvert.runtime import kernels  # noqa: E402
from mpsconvert.runtime.fp8linear import FP8Linear  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        qb, sb, _ = fp8.quantize(w, "block", block=128)
        qr, sr, _ = fp8.quantize(w, "row")
        block = FP8Linear.from_tensors(qb, sb, activations="group", block=128)
        row = FP8Linear.from_tensors(qr, sr, activations="token")
        dense = w.to(torch.bfloat16)
        for m in (1, 2048):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = kernels.group_quantize(x, 128)
            want = (kernels._group_dequantize(xq, xs, 128, torch.float64) @ fp8.dequantize(qb, sb, torch.float64, 128).T)
            r = {"shape": f"{n}x{k}", "m": m}
            bf16_us = timing.per_call_us(lambda: torch.nn.functional.linear(x, dense), dev)
            r["bf16_us"] = round(bf16_us, 2)
            for name, layer in (("scaled_mm_block", block), ("dequant", block), ("scaled_mm_row", row), ("gemv", row)):
                if name == "gemv" and m != 1:
                    continue
                try:
                    y = kernels.run(name, layer, x)
                    if layer is block:
                        r[f"{name}_rel_err"] = float((y.double() - want).norm() / want.norm())
                    us = timing.per_call_us(lambda: kernels.run(name, layer, x), dev)
                    r[f"{name}_us"], r[f"{name}_x_bf16"] = round(us, 2), round(bf16_us / us, 3)
                except Exception as e:  # a kernel this GPU or torch cannot run: said, not hidden
                    r[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            out["rows"].append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
