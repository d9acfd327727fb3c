"""The manifest's typed records (manifests/records.py): what a step writes is read back checked,
a malformed record is one ArtifactError naming it and the step that rewrites it (never a
KeyError in a renderer), and a record read and written back keeps every key it had."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import mpsconvert
from mpsconvert.apple.coreml import CoreMLExport
from mpsconvert.cli import main
from mpsconvert.errors import ArtifactError
from mpsconvert.manifests.manifest import Manifest
from mpsconvert.manifests.records import GGUFSource, Hub, Validation, ValidationRun
from mpsconvert.manifests.transaction import transaction

from .models import resign

pytestmark = pytest.mark.core


def _edit(art, change) -> None:
    """Rewrite the manifest by hand (as a newer version, or a tamperer, would), its own sha256 is
    nowhere else: the files it lists still verify."""
    path = art / "mpsconvert.json"
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body, indent=2))


def test_a_record_round_trips_with_the_keys_it_does_not_type():
    body = {
        "package": "model.mlpackage",
        "task": "causal-lm",
        "kv_cache": True,
        "max_len": 64,
        "weights": "fp8-lut",
        "encoded_tensors": {"a": {"lut": "x"}},
        "check": {"ok": True, "spec": {"ops": {}}},
        "future_field": [1, 2],
    }
    rec = CoreMLExport.read(body, "test")
    assert rec.kv_cache and rec.max_len == 64 and rec.check.ok and rec.check.more == {"spec": {"ops": {}}}
    assert rec.stateful and rec.package_name == "model.mlpackage"
    out = rec.as_dict()
    assert {k: v for k, v in out.items() if k in body} == body and out["future_field"] == [1, 2]


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"package": 3, "task": "causal-lm"}, "`coreml` record.package is int 3, not a string"),
        ({"task": "causal-lm"}, "`coreml` record has no 'package'"),
        (
            {"package": "model.mlpackage", "task": "causal-lm", "check": {"spec": {}}},
            "`coreml` record.check has no 'ok'",
        ),
        ({"package": "model.mlpackage", "task": "causal-lm", "max_len": "64"}, "record.max_len is str '64', not"),
        ([1, 2], "`coreml` record is list, not an object"),
    ],
)
def test_a_malformed_record_is_one_error_naming_it(art_copy, bad, says):
    _edit(art_copy, lambda body: body.update(coreml=bad))
    with pytest.raises(ArtifactError) as e:
        Manifest.read(art_copy).get(CoreMLExport)
    assert says in e.value.problem and "mpsconvert export-coreml --force" in e.value.fix
    r = CliRunner().invoke(main, ["inspect", str(art_copy)])  # the CLI says it in one line, exit 2
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output


def test_a_malformed_validation_run_names_its_key(art_copy):
    _edit(
        art_copy,
        lambda body: body.update(validation={"CPU (cpu)": {"kind": "causal-lm", "device": "cpu", "accuracy": [0.5]}}),
    )
    with pytest.raises(ArtifactError, match=r"`validation` record\['CPU \(cpu\)'\]\.accuracy is list"):
        Manifest.read(art_copy).get(Validation)


def test_source_and_recipe_records_are_typed_too(art_copy):
    gguf = {
        "file": "m.gguf",
        "file_type": "Q4_1",
        "tensor_types": {"Q4_1": 10, "F32": 2},
        "bits_per_weight": {"Q4_1": 5.0, "F32": 32},
        "below_8_bits": True,
        "lowest": "Q4_1",
        "dtype": "bfloat16",
        "unpacked": "dequantized",
    }
    _edit(art_copy, lambda body: body["source"].update(gguf=gguf))
    g = Manifest.read(art_copy).get(GGUFSource)
    assert g.tensor_types["Q4_1"] == 10 and "below 8 bits" in g.precision_note()
    _edit(art_copy, lambda body: body["source"].update(gguf={**gguf, "tensor_types": {"Q4_1": "ten"}}))
    with pytest.raises(ArtifactError, match=r"`source.gguf` record.tensor_types\['Q4_1'\] is str"):
        Manifest.read(art_copy).get(GGUFSource)


def test_put_writes_through_the_transaction_and_the_card_follows(art_copy):
    with transaction(art_copy) as t:
        t.put(Hub(repo="me/llama-fp8"))
        acc = {
            "tokens": 32,
            "perplexity_bf16": 9.0,
            "perplexity_fp8": 9.1,
            "perplexity_delta_pct": 1.1,
            "mean_kl": 0.01,
            "top1_agreement": 0.97,
        }
        t.put(Validation(runs={"CPU (cpu)": ValidationRun(kind="causal-lm", device="cpu", accuracy=acc)}))
    m = Manifest.read(art_copy)
    assert m.get(Hub).repo == "me/llama-fp8" and m.get(Validation).runs["CPU (cpu)"].accuracy["top1_agreement"] == 0.97
    card = (art_copy / "README.md").read_text()
    assert 'from_pretrained("me/llama-fp8"' in card and "| CPU (cpu) | 32 |" in card
    assert mpsconvert.verify(art_copy).ok  # the card's new sha256 is the manifest's


def test_unknown_blocks_are_kept_and_shown(art_copy):
    _edit(art_copy, lambda body: body.update(from_the_future={"x": 1}))
    with transaction(art_copy):  # a change by this version keeps what a newer one wrote
        pass
    assert Manifest.read(art_copy).extra["from_the_future"] == {"x": 1}
    r = CliRunner().invoke(main, ["inspect", str(art_copy)], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "from_the_future" in r.output and '{"x": 1}' in r.output


def test_a_tampered_record_does_not_verify(art_copy):
    """Records are data in the manifest, whose own hash the user pins: an edit is caught there."""
    before = mpsconvert.verify(art_copy).manifest_sha256
    _edit(art_copy, lambda body: body.update(hub={"repo": "evil/repo"}))
    assert not mpsconvert.verify(art_copy, manifest_sha256=before).ok
    resign(art_copy, "README.md")  # (resigning a file does not make the pinned manifest hash match)
    assert not mpsconvert.verify(art_copy, manifest_sha256=before).ok
