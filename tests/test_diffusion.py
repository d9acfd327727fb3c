"""Diffusion transformers to FP8, checked through the loaders' own libraries.

Tiny random Flux.1, Wan 2.x and Qwen-Image transformers built with diffusers (BF16), each
converted both ways:
- the ComfyUI file is read the way ComfyUI reads it: every `comfy_quant` layer becomes
  comfy-kitchen's `QuantizedTensor(TensorCoreFP8Layout)` with its `weight_scale` and is
  dequantized by comfy-kitchen; its original-repo names go back to diffusers' names through
  diffusers' own single-file converters (not our key map); the model then runs one step;
- the diffusers folder is loaded by diffusers' `from_pretrained`, through its SDNQ backend.
Both must be within TOLERANCE of the BF16 model on the same inputs, with every layer kept in
high precision still BF16. The two traps of the issue are shown, and bad inputs give one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sdnq")
pytest.importorskip("comfy_kitchen")
pytest.importorskip("accelerate")

import mpsconvert  # noqa: E402
from mpsconvert.errors import MpsconvertError, QuantizationError, SourceError  # noqa: E402
from mpsconvert.runtime.evaluate.validate_diffusion import compare, step_inputs  # noqa: E402

sfu = pytest.importorskip("diffusers.loaders.single_file_utils")

# One denoising step of an FP8 weight-only transformer against BF16: measured 0.4-0.7% relative
# error (cosine > 0.99997) on these tiny random models; the bound leaves room for other seeds.
TOLERANCE = {"rel_error": 0.03, "cosine": 0.999}
FAMILIES = ("flux", "wan", "qwen-image")
FORMATS = ("comfyui", "diffusers")


def _flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=[8, 12, 12],
    )


def _wan():
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _qwen():
    return diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )


BUILDERS = {"flux": _flux, "wan": _wan, "qwen-image": _qwen}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion")
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        build().to(torch.bfloat16).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def artifacts(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {
        (fam, fmt): mpsconvert.quantize(sources[fam], root / f"{fam}-{fmt}", format=fmt)
        for fam in FAMILIES
        for fmt in FORMATS
    }


def _bf16(src: Path):
    cls = getattr(diffusers, json.loads((src / "config.json").read_text())["_class_name"])
    return cls.from_pretrained(str(src), torch_dtype=torch.bfloat16).eval()


def _out(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


class _Split:
    """diffusers' Flux converter splits `single_blocks.N.linear1` with Flux.1's width written in
    (3072): this stands in for torch there and scales that one split to the tiny model's width.
    Every name, order and swap stays diffusers' own."""

    def __init__(self, inner: int):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(torch, name)

    def split(self, t, sizes, dim=0):
        if tuple(sizes) == (3072, 3072, 3072, 12288):
            sizes = (self.inner,) * 3 + (4 * self.inner,)
        return torch.split(t, sizes, dim)


def _diffusers_names(family: str, original: dict, config: dict, monkeypatch) -> dict:
    """Original-repo tensors -> diffusers names by diffusers' own single-file converters."""
    if family == "qwen-image":  # released in diffusers layout; ComfyUI's model uses those names
        return original
    if family == "flux":
        monkeypatch.setattr(sfu, "torch", _Split(config["num_attention_heads"] * config["attention_head_dim"]))
        return sfu.convert_flux_transformer_checkpoint_to_diffusers(original)
    return sfu.convert_wan_transformer_to_diffusers(original)


def _read_comfy(path: Path):
    """The file as ComfyUI's loader reads it (comfy/ops.py): codes + 0-d weight_scale become a
    comfy-kitchen QuantizedTensor; returns (dequantized BF16 tensors, the QuantizedTensors, header metadata)."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
        sd = {k: fh.get_tensor(k) for k in fh.keys()}
    qts = {}
    for key in [k for k in sd if k.endswith(".comfy_quant")]:
        mod = key[: -len(".comfy_quant")]
        conf = json.loads(bytes(sd.pop(key).tolist()))
        assert conf["format"] == "float8_e4m3fn"
        w, s = sd.pop(mod + ".weight"), sd.pop(mod + ".weight_scale")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0  # per tensor only
        qts[mod] = QuantizedTensor(
            w,
            "TensorCoreFP8Layout",
            TensorCoreFP8Layout.Params(scale=s, orig_dtype=torch.bfloat16, orig_shape=tuple(w.shape)),
        )
        sd[mod + ".weight"] = qts[mod].dequantize()
    return sd, qts, meta


def _fp8_model(family, fmt, art, src, monkeypatch):
    """The artifact through its real loader, as a diffusers model."""
    if fmt == "diffusers":
        cls = getattr(diffusers, json.loads((src / "config.json").read_text())["_class_name"])
        return cls.from_pretrained(str(art.output), torch_dtype=torch.bfloat16).eval()
    sd, _, _ = _read_comfy(art.output / art.manifest.recipe["file"])
    model = _bf16(src)
    missing, unexpected = model.load_state_dict(
        _diffusers_names(family, dict(sd), dict(model.config), monkeypatch), strict=False
    )
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_within_tolerance_through_the_real_loader(family, fmt, sources, artifacts, monkeypatch):
    art = artifacts[(family, fmt)]
    assert mpsconvert.verify(art.output).ok
    bf16 = _bf16(sources[family])
    fp8 = _fp8_model(family, fmt, art, sources[family], monkeypatch)
    kw = step_inputs(family, dict(bf16.config), image_tokens=64, text_tokens=16)
    got = compare(_out(bf16, kw), _out(fp8, kw))
    print(f"{family} {fmt}: rel_error {got['rel_error']:.5f} cosine {got['cosine']:.6f}")
    assert got["rel_error"] < TOLERANCE["rel_error"] and got["cosine"] > TOLERANCE["cosine"], got
    # the FP8 model is not the BF16 one under another name: its weights differ by the rounding
    assert got["rel_error"] > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_excluded_layers_stay_in_their_source_dtype(family, sources, artifacts):
    from safetensors import safe_open

    comfy, dif = artifacts[(family, "comfyui")], artifacts[(family, "diffusers")]
    kept = comfy.manifest.recipe["ignored_modules"]
    assert kept and all("default" in why for why in kept.values())
    with safe_open(str(comfy.output / comfy.manifest.recipe["file"]), "pt") as fh:
        dtypes = {k: fh.get_slice(k).get_dtype() for k in fh.keys()}
    fp8 = {k[: -len(".weight")] for k, d in dtypes.items() if d == "F8_E4M3"}
    assert fp8 and all(
        dtypes[k] == "BF16"
        for k in dtypes
        if not k.endswith((".weight_scale", ".comfy_quant")) and k[: -len(".weight")] not in fp8
    )
    with safe_open(str(dif.output / "diffusion_pytorch_model.safetensors"), "pt") as fh:
        stored = {k: fh.get_slice(k).get_dtype() for k in fh.keys()}
    model = type(_bf16(sources[family])).from_pretrained(str(dif.output), torch_dtype=torch.bfloat16)
    for name in dif.manifest.recipe["ignored_modules"]:
        # a plain Linear for SDNQ, stored BF16 (diffusers may widen its _keep_in_fp32_modules at load: Wan's embedders)
        assert type(model.get_submodule(name)) is torch.nn.Linear and stored[name + ".weight"] == "BF16", name
    quantized = [m for m in model.modules() if type(m).__name__.startswith("SDNQ")]
    assert len(quantized) == dif.manifest.summary["tensors_quantized"]
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in quantized)


def test_comfyui_file_layout_markers_and_names(artifacts):
    art = artifacts[("flux", "comfyui")]
    sd, qts, meta = _read_comfy(art.output / art.manifest.recipe["file"])
    layers = json.loads(meta["_quantization_metadata"])
    assert layers["format_version"] == "1.0" and set(layers["layers"]) == set(qts)
    assert all(v == {"format": "float8_e4m3fn", "full_precision_matrix_mult": True} for v in layers["layers"].values())
    # original-repo names, fused as BFL stores them: never a diffusers name (ComfyUI would drop its scales)
    assert "double_blocks.0.img_attn.qkv" in qts and "single_blocks.1.linear1" in qts
    assert not any(k.startswith(("transformer_blocks.", "single_transformer_blocks.", "x_embedder")) for k in sd)
    # comfy-kitchen's own linear on the QuantizedTensor (what ComfyUI's Linear calls) = the dequantized weight's
    x = torch.randn(3, qts["double_blocks.0.img_attn.qkv"].shape[1], dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, qts["double_blocks.0.img_attn.qkv"].dequantize())
    assert torch.equal(torch.nn.functional.linear(x, qts["double_blocks.0.img_attn.qkv"]), ref)


def test_key_map_gives_back_every_diffusers_tensor_through_diffusers_converters(monkeypatch):
    """Our diffusers -> original map, then diffusers' original -> diffusers converter: bit for bit,
    for the five families (SD3.5 and Z-Image included)."""
    from mpsconvert.convert.diffusion.families import BY_NAME
    from mpsconvert.convert.diffusion.keymap import to_original

    torch.manual_seed(0)
    models = {
        "flux": (_flux(), sfu.convert_flux_transformer_checkpoint_to_diffusers),
        "wan": (_wan(), sfu.convert_wan_transformer_to_diffusers),
        "sd3": (
            diffusers.SD3Transformer2DModel(
                sample_size=32,
                patch_size=2,
                in_channels=4,
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=2,
                caption_projection_dim=16,
                joint_attention_dim=16,
                pooled_projection_dim=16,
                out_channels=4,
                qk_norm="rms_norm",
                dual_attention_layers=(0,),
            ),
            sfu.convert_sd3_transformer_checkpoint_to_diffusers,
        ),
        "z-image": (
            diffusers.ZImageTransformer2DModel(
                all_patch_size=(2,),
                all_f_patch_size=(1,),
                in_channels=4,
                dim=32,
                n_layers=2,
                n_refiner_layers=1,
                n_heads=2,
                n_kv_heads=2,
                cap_feat_dim=16,
                axes_dims=[4, 6, 6],
                axes_lens=[64, 32, 32],
            ),
            sfu.convert_z_image_transformer_checkpoint_to_diffusers,
        ),
    }
    monkeypatch.setattr(sfu, "torch", _Split(64))
    for fam, (model, convert) in models.items():
        sd = model.state_dict()
        original = {
            o.name: torch.cat([sd[p.key][p.row0 : p.row1] for p in o.pieces]) if o.shape else sd[o.pieces[0].key]
            for o in to_original(BY_NAME[fam], {k: tuple(v.shape) for k, v in sd.items()})
        }
        back = convert(dict(original))
        assert set(back) == set(sd), fam
        assert all(torch.equal(back[k], sd[k]) for k in sd), fam


def test_trap_diffusers_single_file_loader_ignores_comfyui_scales(sources, artifacts):
    """Trap 1, as diffusers 0.42 behaves: plain `from_single_file` loads our ComfyUI file with no
    error and its scales ignored (wrong output; its only sign is the warning that lists the
    unused `comfy_quant` markers): diffusers has no hook a file can use to refuse, so the card
    and docs say which loader reads which file. With its BFL quantizer the first step fails."""
    art = artifacts[("wan", "comfyui")]
    path = str(art.output / art.manifest.recipe["file"])
    bf16 = _bf16(sources["wan"])
    silent = diffusers.WanTransformer3DModel.from_single_file(
        path, config=str(sources["wan"]), torch_dtype=torch.bfloat16
    )
    kw = step_inputs("wan", dict(bf16.config), image_tokens=64, text_tokens=16)
    assert compare(_out(bf16, kw), _out(silent, kw))["rel_error"] > 0.5  # garbage, silently
    bfl = diffusers.WanTransformer3DModel.from_single_file(
        path, config=str(sources["wan"]), quantization_config=diffusers.BFLQuantizationConfig()
    )
    with pytest.raises(IndexError):  # BFL's fp8r is per row: our 0-d per-tensor scales stop its first matmul
        _out(bfl, kw)
    card = (art.output / "README.md").read_text()
    assert "from_single_file" in card and "without their scales" in card and "models/diffusion_models/" in card


def test_trap_comfyui_marker_missing_is_caught_by_verify(artifacts, tmp_path):
    """Trap 2's failure mode (an FP8 weight with neither its marker nor the header's layer list, as
    a re-save by a diffusers-layout tool leaves it: ComfyUI keeps the codes as plain weights, its
    scale dropped) is what verify refuses."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    art = artifacts[("qwen-image", "comfyui")]
    copy = tmp_path / "art"
    shutil.copytree(art.output, copy)
    f = copy / art.manifest.recipe["file"]
    with safe_open(str(f), "pt") as fh:
        meta, sd = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    sd.pop(next(k for k in sd if k.endswith(".comfy_quant")))
    save_file(sd, str(f), metadata={k: v for k, v in meta.items() if k != "_quantization_metadata"})
    problems = mpsconvert.verify(copy, check_hashes=False).problems
    assert any("comfy_quant" in p for p in problems) and any("_quantization_metadata" in p for p in problems)


def test_legacy_layout_reads_as_comfyui_converts_it(sources, tmp_path, monkeypatch):
    from mpsconvert.convert.diffusion.load import comfy_state_dict

    art = mpsconvert.quantize(sources["wan"], tmp_path / "legacy", format="comfyui-legacy")
    assert mpsconvert.verify(art.output).ok
    sd, how = comfy_state_dict(art.output / art.manifest.recipe["file"])
    assert how["fp8_layers"] == art.manifest.summary["tensors_quantized"] > 0
    bf16 = _bf16(sources["wan"])
    model = _bf16(sources["wan"])
    model.load_state_dict(_diffusers_names("wan", sd, dict(model.config), monkeypatch), strict=True)
    kw = step_inputs("wan", dict(bf16.config), image_tokens=64, text_tokens=16)
    assert compare(_out(bf16, kw), _out(model, kw))["rel_error"] < TOLERANCE["rel_error"]


def test_ignore_replaces_the_family_list(sources, tmp_path):
    art = mpsconvert.quantize(sources["flux"], tmp_path / "ign", format="comfyui", ignore=["img_mod.lin"])
    rec = art.manifest.recipe
    assert rec["high_precision"] == {"rule": "--ignore", "patterns": ["img_mod.lin"]}
    assert "img_in.weight" in art.manifest.tensors  # the family default no longer applies
    assert "double_blocks.0.img_mod.lin.weight" not in art.manifest.tensors
    assert all(why == "--ignore: img_mod.lin" for why in rec["ignored_modules"].values())


def test_pipeline_folder_keeps_the_rest_and_validates(sources, tmp_path):
    pipe = tmp_path / "pipe"
    shutil.copytree(sources["wan"], pipe / "transformer")
    (pipe / "scheduler").mkdir()
    (pipe / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "UniPCMultistepScheduler"}')
    (pipe / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "WanPipeline",
                "transformer": ["diffusers", "WanTransformer3DModel"],
                "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            }
        )
    )
    art = mpsconvert.quantize(pipe, tmp_path / "out", format="diffusers")
    assert (art.output / "scheduler" / "scheduler_config.json").read_text() == (
        pipe / "scheduler" / "scheduler_config.json"
    ).read_text()
    assert (
        "scheduler/scheduler_config.json" in art.manifest.files
        and "transformer/diffusion_pytorch_model.safetensors" in art.manifest.files
    )
    assert mpsconvert.verify(art.output).ok
    res = mpsconvert.validate(
        art.output, options=mpsconvert.validate_options(device="cpu", prefill_len=64, repeats=1, rounds=1, warmup=0)
    )
    assert (
        res.kind == "diffusion-step" and res.accuracy["rel_error"] < TOLERANCE["rel_error"] and res.speedup["step"] > 0
    )
    assert "diffusion-step" in json.dumps(mpsconvert.inspect(art.output).extra["validation"])
    assert "One denoising step" in (art.output / "README.md").read_text()
    comfy = mpsconvert.quantize(pipe, tmp_path / "comfy", format="comfyui")
    assert sorted(p.name for p in comfy.output.iterdir()) == [
        "README.md",
        "comfy.safetensors",
        "config.json",
        "mpsconvert.json",
    ]


def test_validate_comfyui_artifact(artifacts):
    art = artifacts[("flux", "comfyui")]
    res = mpsconvert.validate(
        art.output,
        options=mpsconvert.validate_options(device="cpu", prefill_len=64, repeats=1, rounds=1, warmup=0, write=False),
    )
    assert res.accuracy["rel_error"] < TOLERANCE["rel_error"] and res.accuracy["cosine"] > TOLERANCE["cosine"]
    assert "comfy-kitchen" in json.dumps(res.kernels) and res.recorded is None
    from click.testing import CliRunner

    from mpsconvert.cli import main

    # the command's table: the step's accuracy and latency rows (it read an LLM's keys and crashed)
    cli = CliRunner().invoke(
        main,
        [
            "validate",
            str(art.output),
            "--device",
            "cpu",
            "--prefill-len",
            "64",
            "--repeats",
            "1",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--no-write",
            "--explain",
        ],
        env={"COLUMNS": "80"},
    )  # the width is read live: fixed here
    said = " ".join(cli.output.split())
    assert cli.exit_code == 0, cli.output
    assert (
        "denoising" in said and "relative error" in said and "denoising step (64" in said and "|error|" in said
    )  # cells wrap at 80 columns
    assert "how the FP8 layers ran" in said and "comfy-kitchen" in said and "kernel policy" not in said


# --------------------------------------------------------------------------- bad input


def test_unknown_family(tmp_path):
    from diffusers import UNet2DModel

    UNet2DModel(
        sample_size=8,
        block_out_channels=(8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    ).save_pretrained(tmp_path / "unet")
    with pytest.raises(SourceError) as e:
        mpsconvert.quantize(tmp_path / "unet", tmp_path / "o")
    assert "UNet2DModel" in str(e.value) and "Flux.1" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_pipeline_without_transformer(tmp_path):
    (tmp_path / "p" / "vae").mkdir(parents=True)
    (tmp_path / "p" / "model_index.json").write_text(
        json.dumps({"_class_name": "X", "vae": ["diffusers", "AutoencoderKL"]})
    )
    with pytest.raises(SourceError) as e:
        mpsconvert.quantize(tmp_path / "p", tmp_path / "o")
    assert "no transformer" in str(e.value) and "vae" in str(e.value) and "`component=NAME`" in str(e.value)


def test_single_file_of_no_family(tmp_path):
    from safetensors.torch import save_file

    save_file({"encoder.layer.0.weight": torch.zeros(4, 4)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(SourceError) as e:
        mpsconvert.quantize(tmp_path / "x.safetensors", tmp_path / "o")
    assert (
        "match no diffusion family" in str(e.value)
        and "encoder.layer.0.weight" in str(e.value)
        and "Wan 2.x" in str(e.value)
    )


def test_single_file_to_comfyui_and_not_to_diffusers(artifacts, tmp_path):
    """An original-repo file (our Flux ComfyUI output dequantized back to BF16 stands in for BFL's
    release) converts to ComfyUI as it is; --format diffusers needs the diffusers model."""
    from safetensors.torch import save_file

    art = artifacts[("flux", "comfyui")]
    sd, _, _ = _read_comfy(art.output / art.manifest.recipe["file"])
    save_file(
        {f"model.diffusion_model.{k}": v.contiguous() for k, v in sd.items()}, str(tmp_path / "flux1.safetensors")
    )
    out = mpsconvert.quantize(tmp_path / "flux1.safetensors", tmp_path / "one")
    assert out.manifest.recipe["format"] == "comfyui" and out.manifest.recipe["family"] == "flux"
    assert out.manifest.summary["tensors_quantized"] == art.manifest.summary["tensors_quantized"]
    assert mpsconvert.verify(out.output).ok
    with pytest.raises(QuantizationError, match="single file"):
        mpsconvert.quantize(tmp_path / "flux1.safetensors", tmp_path / "two", format="diffusers")


def test_llm_options_and_formats_do_not_mix(sources, tiny_models, tmp_path):
    with pytest.raises(MpsconvertError, match="`scheme` applies to language models"):
        mpsconvert.quantize(sources["wan"], tmp_path / "a", scheme="fp8-dynamic")
    with pytest.raises(MpsconvertError, match="is for diffusion models"):
        mpsconvert.quantize(tiny_models["llama"], tmp_path / "b", format="comfyui")


def test_cli_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from mpsconvert.cli import main

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "model_index.json").write_text(
        json.dumps({"_class_name": "X", "vae": ["diffusers", "AutoencoderKL"]})
    )
    r = CliRunner().invoke(main, ["quantize", str(tmp_path / "p"), "--format", "comfyui"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "no transformer" in r.output


def test_upload_of_a_diffusers_artifact_sends_every_file_and_the_card_names_the_repo(sources, tmp_path, online):
    """upload covers diffusion artifacts as LLM ones: verified first, the card rewritten for the repo."""
    art = mpsconvert.quantize(sources["qwen-image"], tmp_path / "qwen-fp8", format="diffusers")
    mpsconvert.upload(art.output, "me/qwen-fp8")
    (commit,) = online.commits
    files = {p.relative_to(art.output).as_posix() for p in art.output.rglob("*") if p.is_file()}
    assert set(commit["files"]) == files and "diffusion_pytorch_model.safetensors" in files
    card = (art.output / "README.md").read_text()
    assert 'QwenImageTransformer2DModel.from_pretrained("me/qwen-fp8"' in card and "library_name: diffusers" in card
    assert mpsconvert.verify(art.output).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_sd35_and_z_image_convert_and_validate(fmt, tmp_path):
    """The other two families end to end through `validate` (their key maps are checked against
    diffusers' converters above). Measured: SD3.5 0.7% relative error both ways; the tiny Z-Image
    (width 32) 2.7-3.1%, hence this test's wider bound."""
    torch.manual_seed(0)
    built = {
        "sd3": diffusers.SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_projection_dim=16,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            out_channels=4,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
        ),
        "z-image": diffusers.ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6],
            axes_lens=[256, 64, 64],
        ),
    }
    for fam, model in built.items():
        model.to(torch.bfloat16).save_pretrained(tmp_path / fam)
        art = mpsconvert.quantize(tmp_path / fam, tmp_path / f"{fam}-{fmt}", format=fmt)
        assert art.manifest.recipe["family"] == fam and mpsconvert.verify(art.output).ok
        res = mpsconvert.validate(
            art.output,
            options=mpsconvert.validate_options(
                device="cpu", prefill_len=64, repeats=1, rounds=1, warmup=0, write=False
            ),
        )
        assert 1e-4 < res.accuracy["rel_error"] < 0.06 and res.accuracy["cosine"] > 0.998, (fam, res.accuracy)
