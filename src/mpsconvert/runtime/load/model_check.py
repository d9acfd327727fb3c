"""The model built from config.json, weightless, against the artifact: its Linear shapes and the
config's ignore list (which `load` checks the checkpoint against), and `check_built_model`, the
part of `mpsconvert verify` that needs the model. Kept apart from the load driver (loader.py)
since verify builds the model without loading it.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ...errors import MpsconvertError
from ...infra.untrusted import read_json
from ...manifests import layout
from ...model import definition


def linear_layout(model, qc: dict) -> tuple[dict, set]:
    """The Linear shapes of the model built from config, and which of them the config ignores."""
    from ...model.plan import matches

    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return linears, {n for n in linears if matches(n, list(qc.get("ignore") or []))}


def check_built_model(path, report, trust_remote_code: bool = False) -> None:
    """The part of `mpsconvert verify` that needs the model: build it from config.json (weightless)
    and check every FP8 weight against its Linear's shape and the config's ignore list, adding
    what disagrees to `report` (manifests/verify.py's, run first). verify asks for it only where
    the manifest does not vouch for config.json (`report.needs_model`): a checkpoint of another
    tool, a config.json changed since the conversion. With `trust_remote_code` the model's code
    runs only once every file (that code included) matched its hash."""
    from ...manifests.verify import check_model_shapes, check_model_structure

    path = Path(path)
    if trust_remote_code and not (report.ok and report.hashes_checked):
        report.warnings.append(
            "the model was not built from config.json: with --trust-remote-code, code runs only "
            "from an artifact that verified"
        )
        return
    try:
        qc = read_json(path / layout.CONFIG_NAME, what=layout.CONFIG_NAME).get("quantization_config") or {}
        _, model = definition.build_from(path, buffers="real", trust_remote_code=trust_remote_code)
        linears, ignored = linear_layout(model, qc if isinstance(qc, dict) else {})
    except (OSError, ValueError, MpsconvertError):  # config missing or unreadable: verify_artifact said which
        return
    check_model_shapes(report, linears, ignored)
    report.linears = set(linears)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = (
        model.get_output_embeddings()
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "get_output_embeddings")
        else None
    )
    for n, m in model.named_modules():  # a tied output embedding is the input embedding: not stored under its own name
        if out is not None and m is out:
            params.pop(f"{n}.weight", None)
    check_model_structure(report, params, {n for n, _ in model.named_modules()})
