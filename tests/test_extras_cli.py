"""A missing optional dependency is one line naming the extra to install, exit 2, for every
command that needs one (simulated by making the module unimportable)."""

import sys

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.cli import main

from . import models


@pytest.fixture(scope="module")
def art(work):
    return mpsconvert.quantize(
        models.tiny("llama", work / "src", tokenizer="bpe", dtype=torch.bfloat16, tie=True), work / "art"
    ).output


def _missing(monkeypatch, *modules):
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # `import m` now raises ImportError, as when it is not installed


@pytest.mark.parametrize(
    "args, module, extra",
    [
        (["export-coreml", "{art}"], "coremltools", "coreml"),
        (["export-coreml", "{art}", "--check-only"], "coremltools", "coreml"),
        (["export-coreai", "{art}"], "coreai.authoring", "coreai"),
        (["export-coreai", "{art}", "--check-only"], "coreai.authoring", "coreai"),
        (["quantize", "{src}", "-o", "{out}", "--coreml"], "coremltools", "coreml"),
        (["quantize", "{src}", "-o", "{out}", "--coreai"], "coreai.authoring", "coreai"),
    ],
)
def test_missing_extra_is_one_line_and_exit_2(art, tmp_path, monkeypatch, args, module, extra):
    _missing(monkeypatch, module, *(["coreai"] if module.startswith("coreai") else []))
    args = [a.format(art=art, src=art.parent / "src", out=tmp_path / "out") for a in args]
    res = CliRunner().invoke(main, args)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: ") and f"pip install 'mpsconvert[{extra}]'" in lines[0]
    assert not (tmp_path / "out").exists()  # said before converting, nothing half-written


@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_diffusion_source_without_diffusers_is_one_line_and_exit_2(tmp_path, monkeypatch, fmt):
    """A diffusers transformer folder on a base install (no `diffusion` extra): said before anything
    is written, for both formats (the folder is made by hand: the base lane has no diffusers)."""
    import json

    from safetensors.torch import save_file

    _missing(monkeypatch, "diffusers")
    src = tmp_path / "flux"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps(
            {
                "_class_name": "FluxTransformer2DModel",
                "_diffusers_version": "0.36.0",
                "num_layers": 1,
                "num_single_layers": 0,
            }
        )
    )
    save_file(
        {"transformer_blocks.0.attn.to_q.weight": torch.randn(32, 32).bfloat16()},
        str(src / "diffusion_pytorch_model.safetensors"),
    )
    res = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), "--format", fmt])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "needs diffusers" in lines[0] and "pip install 'mpsconvert[diffusion]'" in lines[0]
    assert not (tmp_path / "out").exists()
