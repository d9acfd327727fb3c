"""Quiet by default: the program's captured output (a fresh process, everything on fd 1 and 2)
has no third-party bars, warnings or log lines; `-v` shows them (the negative control)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import models

SRC = Path(__file__).resolve().parents[1] / "src"
NOISE = re.compile(
    r"Loading weights|it/s\]|Warning|warn\(|Failed to load _ML|has not been tested|is not supported|"
    r"past_key_values|deprecated|\d+%\|"
)


def prog(*args, cwd):
    from mpsconvert.cli import quiet

    # not what an earlier in-process CLI call of this test session set (quiet.ENV): a user's environment
    env = {k: v for k, v in os.environ.items() if k not in quiet.ENV}
    env |= {"PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "COLUMNS": "300"}
    r = subprocess.run(
        [sys.executable, "-c", "from mpsconvert.cli import entry; entry()", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def noise(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if NOISE.search(ln)]


@pytest.fixture(scope="module")
def src(work):
    return models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True)


CALIB = [
    "--scheme",
    "fp8",
    "--num-samples",
    "2",
    "--seq-len",
    "32",
    "--calib-data",
    str(models.TEXT_DATA / "wiki_calib.jsonl"),
]


def test_quantize_prints_no_third_party_lines(work, src):
    loud = prog("-v", "quantize", "src", "-o", "loud", *CALIB, cwd=work)
    assert any("Loading weights" in ln for ln in noise(loud)), loud  # the noise is there to hide
    quiet = prog("quantize", "src", "-o", "fp8", *CALIB, cwd=work)
    assert noise(quiet) == [] and "worst SQNR" in quiet and "calibrated on cpu" in quiet


def test_validate_prints_no_third_party_lines(work, src):
    if not (work / "fp8").exists():
        prog("quantize", "src", "-o", "fp8", *CALIB, cwd=work)
    out = prog(
        "validate",
        "fp8",
        "--device",
        "cpu",
        "--max-samples",
        "1",
        "--seq-len",
        "64",
        "--prefill-len",
        "16",
        "--decode-tokens",
        "2",
        "--repeats",
        "1",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--no-write",
        "--eval-data",
        models.TEXT_DATA / "wiki_eval.jsonl",
        cwd=work,
    )
    assert noise(out) == [] and "perplexity" in out


@pytest.mark.extra("coreml")
@pytest.mark.slow
def test_export_coreml_prints_no_coremltools_lines(work, src):
    """Also the relative artifact path a user types (the package's files were once listed relative to it wrongly)."""
    prog("quantize", "src", "-o", "ml", cwd=work)
    out = prog("export-coreml", "ml", "--no-check", "--max-len", "32", cwd=work)
    assert noise(out) == [] and "Core ML: model.mlpackage written" in out
    shown = prog("inspect", "ml", cwd=work)  # the export as a summary row, not raw JSON
    (row,) = [ln for ln in shown.splitlines() if ln.strip().startswith("Core ML")]
    assert "stateful decoder" in row and "target iOS18 / macOS15" in row and "KiB" in row and "not checked" in row
