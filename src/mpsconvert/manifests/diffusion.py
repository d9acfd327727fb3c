"""The consistency checks of a diffusion artifact (`mpsconvert verify`, and before `validate` or
`upload`), beside the integrity checks every artifact gets (manifests/verify.py).

- comfyui: the one file the manifest names; every F8_E4M3 `<m>.weight` is 2-D with a float32
  0-d `<m>.weight_scale` (ComfyUI's FP8 layout is per tensor only) and a `<m>.comfy_quant` whose
  JSON says float8_e4m3fn; the header's `_quantization_metadata` lists exactly those layers.
  Legacy layout: the `scaled_fp8` marker and a 0-d `<m>.scale_weight` per FP8 weight.
- diffusers: config.json's `quantization_config` is SDNQ's (float8_e4m3fn, per row), every FP8
  weight has a float32 `<m>.scale` [N, 1], and none of them is a module the config keeps
  unconverted (SDNQ would then read FP8 codes as plain weights).
Scales must be finite and > 0 and no code a NaN (values.check_values' rules).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError, MpsconvertError
from ..infra import filesystem
from ..infra.safetensors_io import read_header
from ..infra.untrusted import inside, parse_json, read_json
from .layout import CONFIG_NAME
from .values import check_records, check_values, floats


def _problem(report, msg: str) -> None:
    report.problems.append(msg)


def _headers(folder: Path, names: list[str], report) -> dict:
    out = {}
    for n in names:
        try:
            out[n] = read_header(inside(folder, n, what="the manifest's recipe"))
        except MpsconvertError as e:
            _problem(report, e.problem)
    return out


def verify_diffusion(folder: Path, manifest, report, check_codes: bool = True, counted: dict | None = None) -> None:

    r = manifest.recipe
    fmt = report.format = r.get("format")
    report.scheme, report.weights = r.get("name"), r.get("weights")
    if fmt in ("comfyui", "comfyui-legacy"):
        names = [r.get("file")] if isinstance(r.get("file"), str) else []
        if not names:
            _problem(report, "the manifest's recipe names no ComfyUI file")
    else:
        wdir = r.get("weights_dir") or "."
        base = inside(folder, wdir, what="the manifest's recipe") if wdir != "." else folder
        names = [
            f"{wdir}/{n}" if wdir != "." else n for n in filesystem.files(base, ".safetensors")
        ]  # no AppleDouble `._*`
        cfg = base / CONFIG_NAME
        try:
            qc = read_json(cfg, what=str(cfg)).get("quantization_config") or {}
        except MpsconvertError as e:
            _problem(report, e.problem)
            qc = {}
        if qc.get("quant_method") != "sdnq" or qc.get("weights_dtype") != "float8_e4m3fn" or qc.get("group_size") != -1:
            _problem(report, f"{wdir}/config.json has no SDNQ float8_e4m3fn per-row quantization_config")
    headers = _headers(folder, names, report)
    report.shards = sorted(headers)
    report.headers = headers
    tensors = {n: i for h in headers.values() for n, i in h.tensors.items()}
    fp8 = {n[: -len(".weight")]: i for n, i in tensors.items() if i.dtype == "F8_E4M3" and n.endswith(".weight")}
    for mod, info in fp8.items():
        if len(info.shape) != 2:
            _problem(report, f"{mod}.weight is F8_E4M3 {list(info.shape)}, expected 2-D [out, in]")
            continue
        report.quantized[mod] = list(info.shape)
        leaf, want = {
            "comfyui": ("weight_scale", []),
            "comfyui-legacy": ("scale_weight", []),
            "diffusers": ("scale", [info.shape[0], 1]),
        }[fmt]
        sc = tensors.get(f"{mod}.{leaf}")
        if sc is None or sc.dtype != "F32" or list(sc.shape) != want:
            got = "none" if sc is None else f"{sc.dtype}{list(sc.shape)}"
            _problem(
                report,
                f"{mod}.weight needs a float32 {want or '0-d'} {leaf} "
                f"({'per tensor: ComfyUI' if fmt != 'diffusers' else 'per row: SDNQ'}), has {got}",
            )
            continue
        h = next(h for h in headers.values() if f"{mod}.{leaf}" in h.tensors)
        v = floats(h.path, sc)
        if not (v.size and float(v.min()) > 0 and all(map(lambda x: x == x and x != float("inf"), v.tolist()))):
            _problem(report, f"{mod}.{leaf} holds values that are not finite positive scales")
    if fmt == "comfyui":
        _check_comfy_markers(headers, tensors, fp8, report)
    elif fmt == "comfyui-legacy" and "scaled_fp8" not in tensors:
        _problem(report, "the legacy ComfyUI layout needs its scaled_fp8 marker")
    elif fmt == "diffusers":
        kept = {
            k[: -len(".weight")]
            for k in qc.get("modules_to_not_convert") or []
            if isinstance(k, str) and k.endswith(".weight")
        }
        for mod in sorted(set(fp8) & kept):
            _problem(
                report, f"{mod} is FP8 but the SDNQ config keeps it unconverted (its codes would be read as weights)"
            )
    if not fp8 and headers:
        _problem(report, "no F8_E4M3 weights found: this is not an FP8 checkpoint")
    check_values(headers, report, codes=check_codes, counted=counted)
    check_records(manifest, tensors, report)


def _check_comfy_markers(headers: dict, tensors: dict, fp8: dict, report) -> None:
    """Every FP8 layer's comfy_quant marker and the header's layer list agree with the weights."""
    for mod in fp8:
        q = tensors.get(f"{mod}.comfy_quant")
        if q is None or q.dtype != "U8":
            _problem(
                report,
                f"{mod} is FP8 but has no uint8 {mod}.comfy_quant marker (ComfyUI would load its codes as weights)",
            )
            continue
        h = next(h for h in headers.values() if f"{mod}.comfy_quant" in h.tensors)
        with open(h.path, "rb") as f:
            f.seek(q.start)
            raw = f.read(q.nbytes)
        try:
            conf = parse_json(raw, what=f"{mod}.comfy_quant")
        except MpsconvertError as e:
            _problem(report, e.problem)
            continue
        if conf.get("format") != "float8_e4m3fn":
            _problem(report, f"{mod}.comfy_quant says format {conf.get('format')!r}, not float8_e4m3fn")
    for name, h in headers.items():
        raw = h.metadata.get("_quantization_metadata")
        try:
            layers = parse_json(raw, what=f"{name}: _quantization_metadata").get("layers") if raw else None
        except ArtifactError:
            layers = None
        if not isinstance(layers, dict):
            _problem(report, f"{name} has no _quantization_metadata header with a layer list")
        elif set(layers) != set(fp8):
            diff = sorted(set(layers) ^ set(fp8))
            _problem(
                report,
                f"{name}: _quantization_metadata and the FP8 weights disagree on {len(diff)} layer(s), e.g. {diff[0]}",
            )
