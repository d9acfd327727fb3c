"""What a source may say about itself: a GGUF's header and tensors, a source's config.json. Every
parameter the model defines is read from the file or the source is refused; every count in a GGUF
header is bounded before anything is built or looped over; a config that would build something no
model is, or compute garbage, is refused in one line. What quantize is given is checked before
anything is written: an FP8 source's scales and NaN codes, a static source's input scales, a scales
file, a --dtype a tensor overflows, --ignore regexes (compiled and matched within a time bound)."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

import mpsconvert
from mpsconvert.errors import SourceError
from mpsconvert.manifests.layout import MANIFEST_NAME
from mpsconvert.manifests.manifest import Manifest

from . import models
from .bounded import within
from .helpers import cli, one_error, one_line_error


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _gguf(n_tensors: int, kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"") -> bytes:
    """GGUF v3 bytes: a header declaring `n_tensors` and `n_kv` (whatever follows says)."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


_ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")


# --------------------------------------------------------------------- 3. GGUF headers bounded before anything is built


@pytest.mark.extra("gguf")
@pytest.mark.parametrize(
    "body, says",
    [
        # a 56-byte GGUF with no tensors: transformers built its default Llama (32 x 4096) from it
        (_gguf(0, _ARCH, 1), "tensor count is 0"),
        # an array declaring 2^40 elements: gguf's reader looped over them
        (_gguf(1, _s("x") + struct.pack("<IIQ", 9, 0, 1 << 40), 1), "outside 0..16,777,216"),
        # a length that fits the limit but not the file
        (_gguf(1, _s("x") + struct.pack("<IIQ", 9, 8, 1 << 20) + b"\0" * 64, 1), "cannot fit"),
        (_gguf(1 << 60, _ARCH, 1), "tensor count is 1152921504606846976"),
        (_gguf(1, _ARCH, 1 << 40), "metadata key count"),
        (_gguf(1, _ARCH, 1, _s("t") + struct.pack("<I", 9) + b"\0" * 80), "dimensions of t is 9"),
        (
            _gguf(1, _ARCH, 1, _s("t") + struct.pack("<I", 2) + struct.pack("<QQ", 1 << 32, 1 << 32) + b"\0" * 12),
            "elements of t",
        ),
        (_gguf(1, _s("k") + struct.pack("<IQ", 8, 1 << 50), 1), "a string of k is 1125899906842624"),
    ],
    ids=[
        "no-tensors",
        "array-2^40",
        "array-past-the-end",
        "tensors-2^60",
        "keys-2^40",
        "dims-9",
        "elements-2^64",
        "string-2^50",
    ],
)
def test_a_gguf_header_is_bounded_before_anything_is_built(tmp_path, body, says):
    f = tmp_path / "m.gguf"
    f.write_bytes(body)
    t = time.monotonic()
    one_line_error(cli("quantize", f, "-o", tmp_path / "out"), "m.gguf", says)
    assert time.monotonic() - t < 30 and not (tmp_path / "out").exists()


@pytest.mark.extra("gguf")
def test_a_gguf_whose_metadata_does_not_describe_its_tensors_is_refused(tmp_path):
    """The model transformers builds comes from the metadata: blocks it counts must all be there, none
    more, the sizes within the limits, the embedding as wide as it says; else it is refused before
    transformers reads the file (a default-size or wrong-size model is never built)."""
    from mpsconvert.convert.gguf import check_header

    assert models.SMOLLM2_GGUF is not None
    assert check_header(models.SMOLLM2_GGUF).fields["llama.block_count"] == 30
    cases = [
        ({"llama.block_count": 31}, "says 31 blocks but holds tensors of no block 30"),
        ({"llama.block_count": 29}, "holds tensors of block 29"),
        ({"llama.block_count": 1 << 30}, "outside 0..1,024"),
        ({"llama.embedding_length": 1000000}, "outside 1..65,536"),
        ({"llama.embedding_length": 512}, "token_embd.weight is 576 wide"),
    ]
    for fields, says in cases:
        f = models.gguf_variant(tmp_path / "v.gguf", fields=fields)
        with pytest.raises(SourceError, match=None) as e:
            check_header(f)
        assert says in str(e.value), (fields, str(e.value))
        f.unlink()


@pytest.mark.extra("gguf")
@pytest.mark.slow
def test_a_gguf_with_a_hole_is_refused_not_filled_with_random_weights(tmp_path):
    """One layer's attn_v missing: transformers' random init took its place, quantize exited 0 and
    the artifact verified. Every parameter the model defines is read from the file or refused."""
    f = models.gguf_variant(tmp_path / "hole.gguf", drop=("blk.3.attn_v.weight",))
    res = cli("quantize", f, "-o", tmp_path / "out")
    errors = [
        ln for ln in res.output.splitlines() if "error:" in ln
    ]  # transformers' own bar ("Converting ... GGUF tensors") aside
    assert res.exit_code == 2 and "Traceback" not in res.output and len(errors) == 1, res.output[-2000:]
    for says in ("hole.gguf does not hold 1 tensor(s)", "model.layers.3.self_attn.v_proj.weight", "random weights"):
        assert says in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 8, 9. source configs


@pytest.fixture(scope="module")
def src(work):
    return models.tiny("llama", work / "src", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"model_type": ["llama"]}, "model_type is ['llama'], not a string"),
        ({"rms_norm_eps": float("nan")}, "not a number JSON allows"),
        ({"rms_norm_eps": 1e400}, "rms_norm_eps is inf"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06"),
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0, outside 1..16,777,216"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -5}}, "factor is -5"),
        ({"rope_theta": 0}, "rope_theta is 0"),
        ({"hidden_size": 10**9}, "hidden_size is 1000000000, outside"),
        ({"vocab_size": 1 << 40}, "vocab_size is 1099511627776, outside"),
        ({"num_attention_heads": 1e9}, "num_attention_heads is 1000000000.0, not an integer"),
        ({"text_config": {"num_hidden_layers": 10**7}}, "text_config: num_hidden_layers is 10000000"),
    ],
)
def test_a_source_config_that_builds_or_computes_garbage_is_one_line(src, tmp_path, edit, says):
    s = tmp_path / "s"
    shutil.copytree(src, s)
    cfg = json.loads((s / "config.json").read_text())
    cfg.update(edit)
    text = json.dumps(cfg)
    if edit.get("rms_norm_eps") == 1e400:
        text = text.replace("Infinity", "1e400")  # a number JSON allows, which Python reads as inf
    (s / "config.json").write_text(text)
    one_line_error(cli("quantize", s, "-o", tmp_path / "out"), says)
    assert not (tmp_path / "out").exists()


def test_a_source_config_with_a_key_twice_is_refused(src, tmp_path):
    """transformers reads the last of two keys; whatever else reads the file may read the first."""
    s = tmp_path / "s"
    shutil.copytree(src, s)
    text = (s / "config.json").read_text()
    (s / "config.json").write_text(
        text.replace('"num_hidden_layers"', '"num_hidden_layers": 1, "num_hidden_layers"', 1)
    )
    one_line_error(cli("quantize", s, "-o", tmp_path / "out"), "has the key 'num_hidden_layers' twice")


@pytest.mark.parametrize("what", ["remote code", "another architecture", "another size"])
def test_validate_baseline_that_is_another_model_or_needs_remote_code_is_one_line(llama_art, work, tmp_path, what):
    base = tmp_path / "base"
    if what == "another architecture":
        models.tiny("qwen2", base)
        says = "is another model"
    else:
        shutil.copytree(work / "src-llama", base)
        cfg = json.loads((base / "config.json").read_text())
        if what == "remote code":
            cfg["auto_map"] = {"AutoConfig": "conf.MyConfig"}
            cfg["model_type"] = "my-own-llama"
            (base / "conf.py").write_text("raise SystemExit('never run')\n")
            says = "defined by code inside the repo"
        else:
            cfg["num_hidden_layers"] = 3
            says = "its num_hidden_layers is 3, the artifact's 2"
        (base / "config.json").write_text(json.dumps(cfg))
    one_line_error(cli("validate", llama_art, "--baseline", base, "--device", "cpu", "--no-write"), says)


# --------------------------------------------------------------------------- sources checked before anything is written


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """A FineGrainedFP8 source with 32 x 32 blocks: gate_proj [128, 64] has [4, 2] scales."""
    import torch

    work = tmp_path_factory.mktemp("fp8src")
    return models.to_fine_grained_fp8(models.tiny("qwen3", work / "bf16", dtype=torch.float32), work / "fp8", 32)


GATE = "model.layers.0.mlp.gate_proj.weight"


def _edited(src: Path, dst: Path, edit, cfg_edit=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if cfg_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _nan_code(sd, code=0x7F):
    import torch

    w = sd[GATE].view(torch.uint8).clone()
    w[3, 5] = code
    sd[GATE] = w.view(torch.float8_e4m3fn)


def _set(key, fn):
    def edit(sd):
        sd[key] = fn(sd[key])

    return edit


FP8_SOURCE_ATTACKS = {
    "scale 3e38 (finite, but 448 x it is inf)": (
        _set(GATE + "_scale_inv", lambda s: s.fill_(3e38)),
        "dequantize past float32",
    ),
    "scale transposed [2, 4] for [4, 2]": (_set(GATE + "_scale_inv", lambda s: s.t().contiguous()), "are [4, 2]"),
    "scale flat [8]": (_set(GATE + "_scale_inv", lambda s: s.reshape(-1).contiguous()), "are [4, 2]"),
    "scale negative": (_set(GATE + "_scale_inv", lambda s: -s), "not finite positive"),
    "NaN code 0x7F": (_nan_code, "NaN code"),
    "NaN code 0xFF": (lambda sd: _nan_code(sd, 0xFF), "NaN code"),
    "3-D FP8 tensor": (
        lambda sd: sd.__setitem__("model.extra.weight", sd[GATE].reshape(2, 64, 64).clone()),
        "2-D FP8 weights",
    ),
}


@pytest.mark.parametrize("attack", sorted(FP8_SOURCE_ATTACKS))
def test_an_fp8_source_that_verify_would_reject_is_refused_at_quantize(fp8_source, tmp_path, attack):
    edit, says = FP8_SOURCE_ATTACKS[attack]
    src = _edited(fp8_source, tmp_path / "src", edit)
    one_error(cli("quantize", src, "-o", tmp_path / "out"), says)
    assert not (tmp_path / "out").exists()


def test_a_negative_static_input_scale_of_an_fp8_source_is_refused(chat_llama, tmp_path):
    """A compressed-tensors static FP8 source (ours, calibrated) whose input_scale is negative."""
    from safetensors.torch import load_file

    static = tmp_path / "static"
    mpsconvert.quantize(
        chat_llama[0], static, scheme="fp8", calibration=mpsconvert.calibration_options(num_samples=1, seq_len=16)
    )
    key = next(k for k in load_file(str(static / "model.safetensors")) if k.endswith("input_scale"))
    src = _edited(static, tmp_path / "src", _set(key, lambda s: -s))
    (src / MANIFEST_NAME).unlink()
    one_error(cli("quantize", src, "-o", tmp_path / "out"), "input scale", key)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [1e308, 5e-324, 3e38, -1.0, float("nan")])
def test_a_scales_file_with_values_float32_cannot_hold_is_refused(chat_llama, tmp_path, value):
    from mpsconvert.calibrate.artifact import SCALES_FORMAT, SCALES_VERSION

    mods = {r["module"] for r in Manifest.read(chat_llama[1]).tensors.values()}
    scales = tmp_path / "scales.json"
    body = {
        "format": SCALES_FORMAT,
        "version": SCALES_VERSION,
        "input_scales": {m: 0.01 for m in mods},
        "calibration": {},
    }
    body["input_scales"][sorted(mods)[0]] = value
    scales.write_text(json.dumps(body))
    one_error(
        cli("quantize", chat_llama[0], "-o", tmp_path / "out", "--scheme", "fp8", "--scales", scales), "input scale"
    )
    assert not (tmp_path / "out").exists()


def test_dtype_float16_that_overflows_a_tensor_is_an_error_naming_it(chat_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(chat_llama[0], src)
    sd = load_file(str(src / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][7] = 1e6  # fine in bfloat16, inf in float16
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    one_error(cli("quantize", src, "-o", tmp_path / "out", "--dtype", "float16"), "model.norm.weight", "inf")
    assert not (tmp_path / "out").exists()
    assert cli("quantize", src, "-o", tmp_path / "out", "--dtype", "bfloat16").exit_code == 0


@pytest.mark.parametrize(
    "pattern,says",
    [
        ("re:[", "not a valid regular expression"),
        ("re:(a|aa)+$", None),
        ("re:(.*){1,32000}[bc]", "catastrophic backtracking"),
        ("re:" + "x" * 2000, "characters long"),
    ],
)
def test_ignore_patterns_are_compiled_and_matched_with_a_time_bound(chat_llama, tmp_path, pattern, says):
    with within(60, f"quantize --ignore {pattern[:20]}"):
        res = cli("quantize", chat_llama[0], "-o", tmp_path / "out", "--ignore", pattern)
    if says is None:  # a pattern that backtracks only on a long run of a's: matches nothing here, fine
        assert res.exit_code == 0, res.output
    else:
        one_error(res, says)
        assert not (tmp_path / "out").exists()
