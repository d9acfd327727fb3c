"""Conversion speed and memory: mpsconvert vs llm-compressor's model_free_ptq vs a plain copy.

Builds a synthetic Llama-3.2-1B-shaped BF16 checkpoint (1.24B parameters, ~1 GB shards, random
weights: conversion cost does not depend on the values), then runs each contender in its own
process, in one run, and prints wall time and peak RSS with ratios.

    python benchmarks/convert.py [--workdir DIR] [--layers 16] [--repeat 3] [--keep]
    python benchmarks/convert.py --skip llm-compressor --baseline-src /path/to/old/checkout/src

With `--baseline-src` another mpsconvert (an older checkout's `src/`) runs as the contender
`mpsconvert-baseline`, interleaved with this one: a before/after of a change in the same run.

With `--flux` the checkpoint is a diffusers FluxTransformer2DModel of Flux.1's real width (3072,
24 heads, the MLPs 4x) with `--double` double and `--single` single blocks (8 and 16: ~10 GB in
BF16; Flux.1-dev has 19 and 38), and the contenders are the copy and mpsconvert's two diffusion
formats (`--format comfyui`, which fuses q/k/v into one tensor per block as it streams, and
`--format diffusers`). Needs the diffusion extra (diffusers, accelerate).

The page cache is warmed by reading the source once before timing, so every contender reads
from memory; each writes its own output folder on the same disk. Runs are interleaved and the
medians compared: on a shared 2-core VM one run of the same command swings by +-20%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_checkpoint(root: Path, layers: int, shard_bytes: int = 1 << 30) -> Path:
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab, kv = 2048, 8192, 128256, 512
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
    }
    src = root / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    tensors = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shards, cur, size = [], {}, 0
    for name, shape in tensors:
        n = 2
        for d in shape:
            n *= d
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = shape
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {k: (torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else rand(*s)) for k, s in shard.items()}
        save_file(data, src / fname, metadata={"format": "pt"})
        total += (src / fname).stat().st_size
        weight_map.update({k: fname for k in shard})
        del data
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return src


def build_flux(root: Path, double: int, single: int, shard_bytes: int = 1 << 30) -> Path:
    """A random BF16 Flux.1-shaped transformer in diffusers layout, written shard by shard (one
    shard of tensors in memory at a time) with its index and config."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    with init_empty_weights():
        model = FluxTransformer2DModel(num_layers=double, num_single_layers=single, guidance_embeds=True)
    src = root / "src"
    src.mkdir(parents=True)
    model.save_config(src)
    shapes = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    g = torch.Generator().manual_seed(0)
    shards, cur, size = [], [], 0
    for name, shape in shapes:
        n = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {
            k: (
                torch.ones(s, dtype=torch.bfloat16)
                if len(s) == 1
                else (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)
            )
            for k, s in shard
        }
        save_file(data, src / fname, metadata={"format": "pt"})
        total += (src / fname).stat().st_size
        weight_map.update({k: fname for k, _ in shard})
        del data
    (src / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return src


# Each contender is a command line run in a fresh process: ours is the CLI a user runs.
CONTENDERS = {
    # `cp -r` + sync: the same bytes read and written, and made durable as quantize makes its output
    "copy": [
        "-c",
        "import os,shutil,sys; shutil.copytree(sys.argv[1], sys.argv[2]); "
        "[os.fsync(fd) or os.close(fd) for fd in (os.open(p, os.O_RDONLY) for p in "
        "(os.path.join(d, f) for d, _, fs in os.walk(sys.argv[2]) for f in fs))]",
    ],
    "mpsconvert": ["-m", "mpsconvert.cli", "quantize", "{src}", "-o", "{out}"],
    "llm-compressor": [
        "-c",
        "import sys; from llmcompressor import model_free_ptq;"
        "model_free_ptq(sys.argv[1], sys.argv[2], scheme='FP8_DYNAMIC', ignore=['lm_head'], device='cpu')",
    ],
}
FLUX_CONTENDERS = {
    "copy": CONTENDERS["copy"],
    "mpsconvert-comfyui": ["-m", "mpsconvert.cli", "quantize", "{src}", "-o", "{out}", "--format", "comfyui"],
    "mpsconvert-diffusers": ["-m", "mpsconvert.cli", "quantize", "{src}", "-o", "{out}", "--format", "diffusers"],
}


def run(name: str, src: Path, out: Path, contenders: dict = CONTENDERS, baseline_src: str = "") -> dict:
    """Run one contender in a fresh process; wall time and that process's peak RSS (wait4).
    `mpsconvert-baseline` is the same CLI run from `baseline_src` (an older checkout's src/)."""
    env = None
    if name == "mpsconvert-baseline":
        name, env = (
            "mpsconvert",
            {**os.environ, "PYTHONPATH": os.pathsep.join([baseline_src, os.environ.get("PYTHONPATH", "")])},
        )
    argv = [a.format(src=src, out=out) for a in contenders[name]]
    if "{src}" not in contenders[name]:
        argv += [str(src), str(out)]
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{err[-3000:]}")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / (1 << 20), "out_bytes": size}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=16, help="16 layers = 1.24B parameters (Llama-3.2-1B shapes)")
    ap.add_argument("--skip", nargs="*", default=[], choices=sorted(set(CONTENDERS) | set(FLUX_CONTENDERS)))
    ap.add_argument(
        "--flux", action="store_true", help="a Flux.1-shaped diffusers transformer instead of the Llama checkpoint"
    )
    ap.add_argument("--double", type=int, default=8, help="with --flux: double blocks")
    ap.add_argument("--single", type=int, default=16, help="with --flux: single blocks")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each contender, interleaved; the median is compared")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--baseline-src", help="an older checkout's src/ run as the contender mpsconvert-baseline (before/after)"
    )
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="mpsconvert-bench-"))
    contenders = FLUX_CONTENDERS if args.flux else CONTENDERS
    if args.build_only:
        build_flux(root, args.double, args.single) if args.flux else build_checkpoint(root, args.layers)
        return
    try:
        t = time.perf_counter()
        src = root / "src"
        if not (src / "config.json").exists():
            # Built in a child process so that its memory does not count in the contenders' peak RSS.
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--build-only",
                    "--workdir",
                    str(root),
                    "--layers",
                    str(args.layers),
                    *(["--flux", "--double", str(args.double), "--single", str(args.single)] if args.flux else []),
                ],
                check=True,
            )
        files = sorted(src.glob("*.safetensors"))
        src_bytes = sum(f.stat().st_size for f in files)
        largest = max(f.stat().st_size for f in files)
        print(
            f"checkpoint: {len(files)} shards, {src_bytes / 1e9:.2f} GB, largest shard {largest / (1 << 30):.2f} GiB "
            f"(built in {time.perf_counter() - t:.0f} s)"
        )
        for f in files:  # warm the page cache so that all contenders read from memory
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        runs: dict[str, list[dict]] = {name: [] for name in contenders if name not in args.skip}
        baseline_src = str(Path(args.baseline_src).resolve()) if args.baseline_src else ""
        if baseline_src:
            runs["mpsconvert-baseline"] = []
        for i in range(args.repeat):  # interleaved, so that a noisy spell of the machine hits every contender
            for name in runs:
                out = root / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                r = run(name, src, out, contenders, baseline_src)
                shutil.rmtree(out, ignore_errors=True)
                runs[name].append(r)
                print(
                    f"  run {i + 1}  {name:15s} {r['wall_s']:7.2f} s   peak RSS {r['peak_rss_gib']:5.2f} GiB   "
                    f"output {r['out_bytes'] / 1e9:.2f} GB",
                    flush=True,
                )
        results = {
            name: {
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "peak_rss_gib": max(r["peak_rss_gib"] for r in rs),
            }
            for name, rs in runs.items()
        }
        print(f"\nmedian of {args.repeat} runs (peak RSS: the largest):")
        for name, r in results.items():
            print(f"  {name:15s} {r['wall_s']:7.2f} s   peak RSS {r['peak_rss_gib']:5.2f} GiB")
        if args.flux:
            from safetensors import safe_open

            biggest = 0
            for f in files:
                with safe_open(str(f), "pt") as fh:
                    biggest = max(
                        [biggest, *(2 * __import__("math").prod(fh.get_slice(k).get_shape()) for k in fh.keys())]
                    )
            print()
            for name in ("mpsconvert-comfyui", "mpsconvert-diffusers"):
                if name in results and "copy" in results:
                    r = results[name]
                    print(
                        f"{name} takes {r['wall_s'] / results['copy']['wall_s']:.2f}x the time of a plain copy, "
                        f"peak RSS {r['peak_rss_gib']:.2f} GiB (largest tensor {biggest / (1 << 20):.0f} MiB, "
                        f"largest shard {largest / (1 << 30):.2f} GiB)"
                    )
        ours = results.get("mpsconvert")
        if ours:
            print()
            if "llm-compressor" in results:
                lc = results["llm-compressor"]
                print(
                    f"mpsconvert is {lc['wall_s'] / ours['wall_s']:.2f}x faster than llm-compressor model_free_ptq, "
                    f"peak RSS {ours['peak_rss_gib'] / lc['peak_rss_gib']:.2f}x of it"
                )
            if "copy" in results:
                print(f"mpsconvert takes {ours['wall_s'] / results['copy']['wall_s']:.2f}x the time of a plain copy")
                if "mpsconvert-baseline" in results:
                    print(
                        f"the baseline ({baseline_src}) takes "
                        f"{results['mpsconvert-baseline']['wall_s'] / results['copy']['wall_s']:.2f}x"
                    )
            print(f"mpsconvert peak RSS = largest shard {ours['peak_rss_gib'] - largest / (1 << 30):+.2f} GiB")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
