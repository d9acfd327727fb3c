import functools
import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from . import models

# Nothing in the test suite may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CLI's rich consoles fix their width from COLUMNS when first imported (as a process should);
# a pytest-xdist worker starts with COLUMNS=80: dropped, so that a test's own COLUMNS is read live.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


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
    # triton("interpret"): also run in a process of its own with TRITON_INTERPRET=1 (see pytest_pyfunc_call)
    "triton": (
        lambda *_: importable("triton"),
        "needs Triton (its kernels run on CPU through TRITON_INTERPRET=1); not installed (no macOS wheels)",
    ),
    "extra": (
        lambda *names: all(importable(m) for n in names for m in EXTRA_MODULES[n]),
        "needs pip install 'mpsconvert[{args}]', not installed here",
    ),
    "needs": (
        lambda *modules: all(importable(m) for m in modules),
        "needs {args} (a reference the test compares with, not a dependency of mpsconvert), not installed here",
    ),
    "gpu": (lambda *_: _gpu(), "needs a CUDA or MPS device"),
    "network": (
        lambda *_: os.environ.get("MPSCONVERT_TEST_NETWORK") == "1",
        "reaches the network: set MPSCONVERT_TEST_NETWORK=1 to run it",
    ),
}


def _core_leaves_out_slow(config, items) -> None:
    """`-m core` is the quick subset (a contributor's first run, CI's floor lane): a test of a core
    module that is also marked `slow` is left out of it unless the expression names `slow` too
    (CI's slow lane runs those: `-m slow`)."""
    expr = config.getoption("markexpr", "") or ""
    if "core" not in expr or "slow" in expr:
        return
    kept = [i for i in items if i.get_closest_marker("slow") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("slow") is not None])
        items[:] = kept


def pytest_collection_modifyitems(config, items):
    _core_leaves_out_slow(config, items)
    for item in items:
        for marker, (check, reason) in REQUIRES.items():
            for mark in item.iter_markers(marker):
                unknown = [a for a in mark.args if marker == "extra" and a not in EXTRA_MODULES]
                if unknown:
                    raise pytest.UsageError(f"{item.nodeid}: unknown extra {unknown}; known: {sorted(EXTRA_MODULES)}")
                if not check(*mark.args):
                    item.add_marker(pytest.mark.skip(reason=reason.format(args=",".join(mark.args))))


INTERPRET = "TRITON_INTERPRET"


def _is_interpreted(item) -> bool:
    mark = item.get_closest_marker("triton")
    return mark is not None and "interpret" in mark.args


def pytest_pyfunc_call(pyfuncitem):
    """A test marked `triton("interpret")` runs its Triton kernels on CPU tensors, which Triton
    does only when TRITON_INTERPRET=1 is set before its kernels are defined: so such a test runs,
    as the normal test function it is, in a pytest process of its own (one per test file, all of
    that file's together), and its outcome (the assertion pytest rewrote, a skip) is reported here."""
    if not _is_interpreted(pyfuncitem) or os.environ.get(INTERPRET) == "1":
        return None
    outcome, text = _interpreted(pyfuncitem).get(pyfuncitem.nodeid, ("failed", "not run by the interpreted process"))
    if outcome == "skipped":
        pytest.skip(text)
    if outcome == "failed":
        pytest.fail(f"in the {INTERPRET}=1 process:\n{text}", pytrace=False)
    return True


@functools.cache
def _interpreted_runs(rootdir: str, nodeids: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = dict(
            os.environ,
            **{INTERPRET: "1"},
            PYTHONPATH=os.pathsep.join([str(Path(rootdir) / "src"), rootdir, os.environ.get("PYTHONPATH", "")]),
        )
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodeids],
            cwd=rootdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if not report.is_file():
            return {
                n: ("failed", f"the process exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}") for n in nodeids
            }
        out = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/") + ".py"
            nodeid = f"{path}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            out[nodeid] = (
                ("failed", (bad.get("message", "") + "\n" + (bad.text or ""))[-4000:])
                if bad is not None
                else ("skipped", skip.get("message", ""))
                if skip is not None
                else ("passed", "")
            )
        return out


def _interpreted(item) -> dict:
    """{nodeid: (outcome, text)} of every `triton("interpret")` test in `item`'s file, run once:
    one process per test file, so that under pytest-xdist (`-n auto`, one file per worker: the
    `--dist loadfile` of pyproject.toml) each runs on the worker that has the file, once."""
    nodeids = tuple(i.nodeid for i in item.session.items if _is_interpreted(i) and i.path == item.path)
    return _interpreted_runs(str(item.config.rootpath), nodeids)


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


@pytest.fixture(scope="module")
def work(tmp_path_factory, request):
    """The folder a test module's tests share (the models and artifacts they build once)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))


@pytest.fixture(scope="module")
def llama_art(work):
    """A tiny Llama quantized (fp8-dynamic) once per module."""
    return models.tiny_artifact(work, "llama", lambda p: models.tiny("llama", p))


@pytest.fixture
def art_copy(llama_art, tmp_path):
    """A copy of `llama_art` for one test to change."""
    import shutil

    return Path(shutil.copytree(llama_art, tmp_path / "art"))


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    """A tiny Llama with a byte-level tokenizer that has a chat template (helpers.CHAT_TEMPLATE), and
    its artifact: (source, artifact), built once per module."""
    import torch

    import mpsconvert

    from .helpers import CHAT_TEMPLATE

    work = tmp_path_factory.mktemp("chat")
    src = models.with_chat_template(
        models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16), CHAT_TEMPLATE
    )
    art = work / "art"
    mpsconvert.quantize(src, art)
    return src, art


@pytest.fixture
def chat_art(chat_llama, tmp_path):
    """A copy of `chat_llama`'s artifact (in a folder of its own: what a writer leaves beside it is
    under `tmp_path / "box"`) for one test to change."""
    import shutil

    dst = tmp_path / "box" / "art"
    shutil.copytree(chat_llama[1], dst)
    return dst


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Builders run once per session; returns {name: source folder}."""
    root = tmp_path_factory.mktemp("src")
    return {
        "llama": models.tiny("llama", root / "llama"),
        "llama_bf16": models.tiny("llama", root / "llama_bf16", dtype=__import__("torch").bfloat16),
        "qwen2_tied": models.tiny("qwen2", root / "qwen2_tied", tie=True),
        "mistral": models.tiny("mistral", root / "mistral"),
        "bert": models.tiny("bert", root / "bert"),
        "gpt2": models.tiny("gpt2", root / "gpt2"),
        "llama_sharded": models.tiny("llama", root / "llama_sharded", max_shard_size="100KB"),
    }


@pytest.fixture(scope="session")
def minilm_dir():
    """all-MiniLM-L6-v2's folder (str); skipped with the install line where the package is missing."""
    return str(models.minilm_dir())


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
