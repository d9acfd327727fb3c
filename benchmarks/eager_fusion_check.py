"""The eager fusion on a GPU, against the same artifact loaded without it (CUDA only).

    python benchmarks/eager_fusion_check.py ARTIFACT   # an artifact of a Llama-family model

Loads ARTIFACT twice (`load(...)` and `load(..., eager_fusion=False)`), prints what was fused,
the logits' relative difference and argmax agreement at 1, 3 and 300 tokens (decode-sized calls
run the norm kernel without quantizing; 300 rows take the whole fused path), the RMSNorm kernel
against transformers' arithmetic at the Llama-3-8B width (elements differing, e4m3 codes of its
output against act_quant.quantize), and the fused model with its layers compiled (the modules'
own forwards) against the unfused eager one. Results of a run: docs/runtime-notes.md.
"""

import json
import sys

import torch

from mpsconvert.runtime import act_quant, load

art = sys.argv[1]
a = load(art, device="cuda")
b = load(art, device="cuda", eager_fusion=False)
print("eager_fusion", a.mpsconvert.eager_fusion, "unfused:", b.mpsconvert.eager_fusion)
g = torch.Generator().manual_seed(0)
out = {}
with torch.no_grad():
    for n in (1, 3, 300):
        ids = torch.randint(0, a.config.vocab_size, (1, n), generator=g).cuda()
        la, lb = a(ids).logits.float(), b(ids).logits.float()
        out[n] = {"rel_err": float((la - lb).norm() / lb.norm()), "argmax_agree": float((la.argmax(-1) == lb.argmax(-1)).float().mean())}
    # the norm kernel against the module's forward at the Llama-3-8B width, 2048 rows
    x = (torch.randn(2048, 4096, device="cuda") * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    y, q, s = act_quant.rms_norm_quantize(x, w, 1e-5, True)
    ref = act_quant.torch_rms_norm(x, w, 1e-5)
    d = (y.float() - ref.float()).abs()
    q2, s2 = act_quant.torch_quantize(y)
    out["norm 2048x4096"] = {"elements_differing": int((d > 0).sum()), "max_abs": float(d.max()), "codes_differing": int((q.view(torch.uint8) != q2.view(torch.uint8)).sum()), "scales_equal": bool(torch.equal(s, s2))}
    for layer in a.model.layers:
        layer.compile()
    ids = torch.randint(0, a.config.vocab_size, (1, 300), generator=g).cuda()
    lc, lb = a(ids).logits.float(), b(ids).logits.float()
    out["compiled fused vs eager unfused"] = float((lc - lb).norm() / lb.norm())
print(json.dumps(out, indent=1))
