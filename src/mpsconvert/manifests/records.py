"""The manifest's typed records: each block a step writes into `mpsconvert.json` after (or
beside) the conversion, one dataclass per kind, with where it lives and what it holds.

    m = Manifest.read(folder)
    rec = m.get(CoreMLExport)            # None when there is none; ArtifactError when malformed
    m.put(Hub(repo="me/model-fp8"))      # written by the next transaction (manifests/transaction.py)

A record is read back from an untrusted file, so `from_dict` checks every field the code reads
(present where required, of its type) and a malformed record is an ArtifactError naming it and
the step that rewrites it, never a KeyError or a TypeError deep in a renderer. Fields the code
does not read (an export's per-tensor encodings, a check's numbers) stay in `more`, as written:
a record read and written back keeps every key, also those of another mpsconvert version.

Where each lives: top-level keys of the manifest (`SECTION = None`: validation, moe,
calibration_experts, hub, and each Apple target's export and runtime records: coreml,
coreml_runtime, coreai, coreai_runtime, defined with their target in apple/) or inside the
`source` block (gguf, diffusion: what the source was) or the `recipe` (calibration: how the
static scales were measured). `register` makes a kind known to the readers that walk a manifest
(the card, inspect); `kinds()` lists them.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

from ..errors import ArtifactError
from ..infra.units import human, num, speed

R = TypeVar("R", bound="Record")
_MORE = "more"


class Typed:
    """A typed JSON object: the dataclass's fields are checked on read, other keys kept in `more`."""

    FIX: ClassVar[str] = "re-create the artifact (`mpsconvert quantize ... --force`)"

    @classmethod
    def from_dict(cls, body: Any, where: str, fix: str | None = None):
        fix = fix or cls.FIX
        if not isinstance(body, dict):
            raise ArtifactError(f"{where} is {type(body).__name__}, not an object", fix)
        hints = typing.get_type_hints(cls)
        kw: dict = {}
        for f in dataclasses.fields(cls):
            if f.name == _MORE:
                continue
            if f.name not in body:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ArtifactError(f"{where} has no {f.name!r}", fix)
                continue
            kw[f.name] = _value(body[f.name], hints[f.name], f"{where}.{f.name}", fix)
        if any(f.name == _MORE for f in dataclasses.fields(cls)):
            kw[_MORE] = {k: v for k, v in body.items() if k not in kw and k not in _names(cls)}
        return cls(**kw)

    def as_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name != _MORE:
                out[f.name] = _plain(getattr(self, f.name))
        return out | dict(getattr(self, _MORE, {}))


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _plain(v):
    if isinstance(v, Typed):
        return v.as_dict()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


_SCALAR = {str: str, bool: bool, dict: dict, list: list}


def _value(v, tp, where: str, fix: str):
    """`v` checked against the annotation `tp` (str, int, float, bool, dict, list, a Typed class,
    dict[str, X], list[X], and unions with None); returns it, nested Typed values built."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:  # X | None: X's own error, which says what is wrong inside it
            return _value(v, others[0], where, fix)
        for a in others:
            try:
                return _value(v, a, where, fix)
            except ArtifactError:
                continue
        raise ArtifactError(f"{where} is {_shown(v)}, not {_type_name(tp)}", fix)
    if isinstance(tp, type) and issubclass(tp, Typed):
        return tp.from_dict(v, where, fix)
    if origin is dict:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise ArtifactError(f"{where} is {_shown(v)}, not an object", fix)
        _, vt = typing.get_args(tp)
        return {k: _value(x, vt, f"{where}[{k!r}]", fix) for k, x in v.items()}
    if origin is list:
        if not isinstance(v, list):
            raise ArtifactError(f"{where} is {_shown(v)}, not a list", fix)
        (it,) = typing.get_args(tp)
        return [_value(x, it, f"{where}[{i}]", fix) for i, x in enumerate(v)]
    if tp is Any:
        return v
    ok = type(v) is int if tp is int else type(v) in (int, float) if tp is float else isinstance(v, _SCALAR[tp])
    if not ok:
        raise ArtifactError(f"{where} is {_shown(v)}, not {_type_name(tp)}", fix)
    return v


def _shown(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _type_name(tp) -> str:
    return {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        dict: "an object",
        list: "a list",
    }.get(tp, getattr(tp, "__name__", str(tp).replace("typing.", "")))


class Record(Typed):
    """A record of the manifest: `KEY` in the manifest's top level, or in its `SECTION` ("source" or "recipe")."""

    KEY: ClassVar[str]
    SECTION: ClassVar[str | None] = None
    # written by a step after the conversion (validate, an export, upload): outside the pin (pin.py)
    AFTER: ClassVar[bool] = False

    def __init_subclass__(cls, *, key=None, section=None, after=None, fix=None, name=None, **kw):
        """A kind's place and words as class keywords: `class Hub(Record, key="hub", after=True,
        fix="upload it again")` sets KEY, SECTION, AFTER, FIX and NAME (those given)."""
        super().__init_subclass__(**kw)
        for attr, value in (("KEY", key), ("SECTION", section), ("AFTER", after), ("FIX", fix), ("NAME", name)):
            if value is not None:
                setattr(cls, attr, value)

    @classmethod
    def path(cls) -> str:
        return f"{cls.SECTION}.{cls.KEY}" if cls.SECTION else cls.KEY

    @classmethod
    def read(cls: type[R], body: Any, where: str) -> R:
        return cls.from_dict(body, f"{where}: the `{cls.path()}` record", cls.FIX)

    def inspect_rows(self) -> list[tuple[str, str]]:
        """What `inspect` shows of the record: (label, text) rows [default: its JSON, cut short]."""
        return [(self.path(), compact(self.as_dict()))]


class MappingRecord(Record):
    """A record that is one mapping and nothing beside it: its one field holds the whole body,
    checked against that field's annotation."""

    @classmethod
    def from_dict(cls, body, where, fix=None):
        (f,) = dataclasses.fields(cls)
        return cls(**{f.name: _value(body, typing.get_type_hints(cls)[f.name], where, fix or cls.FIX)})

    def as_dict(self) -> dict:
        (f,) = dataclasses.fields(self)
        return _plain(getattr(self, f.name))


def compact(value, limit: int = 100) -> str:
    """JSON of `value` in at most `limit` characters (inspect --json shows all of it)."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... (inspect --json for all)"


# --------------------------------------------------------------------------- validate


@dataclass(kw_only=True)
class ValidationRun(Typed):
    """One `validate` run (runtime/evaluate/validate.py's result), as the card and inspect show it."""

    kind: str  # "causal-lm" | "encoder" | "diffusion-step"
    device: str
    accuracy: dict
    device_name: str | None = None
    scheme: str | None = None
    eval_data: str | None = None
    baseline: str | None = None
    measured_at: str | None = None
    speedup: dict[str, float] | None = None
    verdict: dict | None = None
    more: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Validation(
    MappingRecord, key="validation", after=True, fix="run `mpsconvert validate` again (it rewrites the record)"
):
    """Every `validate` run, keyed by "<device name> (<device>)": a run on another device adds a key."""

    runs: dict[str, ValidationRun] = field(default_factory=dict)

    def inspect_rows(self) -> list[tuple[str, str]]:
        rows = []
        for key, r in sorted(self.runs.items()):
            a, sp = r.accuracy, r.speedup or {}
            if r.kind == "causal-lm":
                top1 = a.get("top1_agreement")
                acc = (
                    f"ppl {num(a.get('perplexity_bf16'), '.3f')} -> {num(a.get('perplexity_fp8'), '.3f')} "
                    f"({num(a.get('perplexity_delta_pct'), '+.2f')}%), KL {num(a.get('mean_kl'), '.5f')}, "
                    f"top-1 {num(100 * top1 if num(top1) != '?' else None, '.2f')}%"
                )
            elif r.kind == "diffusion-step":
                acc = (
                    f"one denoising step: relative error {num(a.get('rel_error'), '.5f')}, cosine "
                    f"{num(a.get('cosine'), '.6f')}"
                )
            else:
                acc = f"embedding cosine mean {num(a.get('cosine_mean'), '.5f')}, min {num(a.get('cosine_min'), '.5f')}"
            verdicts = (
                r.verdict or {}
            )  # the run's own verdict wins over the bare ratio (noise reads as "no clear difference")
            speeds = (
                ", ".join(
                    f"{ph} {speed(verdicts[ph]) if isinstance(verdicts.get(ph), dict) else num(v, '.2f') + 'x'}"
                    for ph, v in sorted(sp.items())
                )
                or "latency not measured"
            )
            rows.append((f"validation {key}", f"{acc}; speedup vs BF16: {speeds} ({(r.measured_at or '')[:10]})"))
        return rows


# --------------------------------------------------------------------------- Apple exports


@dataclass(kw_only=True)
class ExportCheck(Typed):
    """The checks of an export that run without Apple hardware (the per-tensor rows left out)."""

    ok: bool
    more: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class AppleExport(Record, after=True):
    """What an Apple target's export wrote: its package inside the artifact, the task and
    interface, and, once checked, the check. `package` names the file whatever the target calls
    it (Core AI records it as `asset`)."""

    task: str
    max_len: int | None = None
    pooling: str | None = None
    encoded_tensors: dict = field(default_factory=dict)
    check: ExportCheck | None = None
    more: dict = field(default_factory=dict)

    PACKAGE_FIELD: ClassVar[str] = "package"  # the field that names the package file
    NAME: ClassVar[str]  # "Core ML": what the card and inspect call the target

    @property
    def package_name(self) -> str:
        return getattr(self, self.PACKAGE_FIELD)

    @property
    def stateful(self) -> bool:
        """A stateful decoder (generate and chat can run it)."""
        return self.task == "causal-lm" and bool(getattr(self, "kv_cache", True))

    def card_lines(self, name: str, causal: bool) -> list[str]:
        """The model card's paragraph on this package (`name`: the artifact folder's name)."""
        raise NotImplementedError

    def summary(self) -> str:
        """One line for `inspect`: the package, its task, the OS it needs, its size, the check (`summary_of`)."""
        raise NotImplementedError

    def summary_of(self, target: str | None, size: int | None, weights: str | None = None) -> str:
        parts = [
            f"{self.package_name}: {self.task}" + (" stateful decoder" if self.stateful else ""),
            f"target {target}" if target else None,
            human(size) if size else None,
            f"weights {weights}" if weights else None,
            ("checks ok" if self.check.ok else "checks FAILED") if self.check else "not checked",
        ]
        return ", ".join(p for p in parts if p)

    def inspect_rows(self) -> list[tuple[str, str]]:
        return [(self.NAME, self.summary())]


@dataclass(kw_only=True)
class RuntimeResult(Record, after=True):
    """A target's runtime part of `validate`: latency (and accuracy) beside PyTorch per engine,
    or why it did not run."""

    NAME: ClassVar[str]  # the target's name ("Core ML")
    status: str  # "ran" | "skipped" | "failed"
    reason: str | None = None
    rows: list[dict] = field(default_factory=list)
    inputs: str | None = None
    more: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line for `inspect`: decode tokens/s (or latency) per engine, or why it did not run."""
        if self.status != "ran":
            return f"not run ({self.reason or self.status})"
        rows = [r for r in self.rows if "error" not in r]
        return (
            "; ".join(
                f"{r.get('engine')}: "
                + (
                    f"decode {r['decode_tokens_per_s']:.1f} tok/s"
                    if isinstance(r.get("decode_tokens_per_s"), (int, float))
                    else f"{r.get('latency_ms', 0):.2f} ms"
                )
                for r in rows
            )
            or "no rows"
        )

    def inspect_rows(self) -> list[tuple[str, str]]:
        return [(f"{self.NAME} runtime", self.summary())]


# --------------------------------------------------------------------------- MoE, calibration, hub


@dataclass(kw_only=True)
class Experts(Record, key="moe"):
    """Where the MoE experts' weights are (moe_layout) and how they were written."""

    experts_layout: str
    experts: dict[str, dict]
    scales: str | None = None
    more: dict = field(default_factory=dict)

    def inspect_rows(self) -> list[tuple[str, str]]:
        return [("MoE experts", f"{len(self.experts)} expert modules, layout {self.experts_layout}")]


@dataclass(kw_only=True)
class ExpertCalibration(MappingRecord, key="calibration_experts", fix="calibrate again (`mpsconvert calibrate`)"):
    """Calibrated input scales of fused MoE experts: "<experts module>.<param>" -> one per expert."""

    scales: dict[str, list[float]] = field(default_factory=dict)


@dataclass(kw_only=True)
class CalibrationRecord(Record, key="calibration", section="recipe", fix="calibrate again (`mpsconvert calibrate`)"):
    """How the static input scales were measured (calibrate/calibration.py's record), in the recipe."""

    device: str | None = None
    observer: str | None = None
    mode: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    data: dict | None = None
    fallbacks: dict = field(default_factory=dict)
    more: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Hub(Record, key="hub", after=True, fix="upload it again (`mpsconvert upload`)"):
    """The hub repo the artifact was uploaded to: the card then loads from there."""

    repo: str
    more: dict = field(default_factory=dict)

    def inspect_rows(self) -> list[tuple[str, str]]:
        return [("hub repo", self.repo)]


@dataclass(kw_only=True)
class Pin(Record, key="pinned"):
    """What the conversion sealed (manifests/pin.py): the top-level keys, library versions and
    files of the manifest a pin covers."""

    keys: list[str]
    versions: list[str]
    files: list[str]

    def inspect_rows(self) -> list[tuple[str, str]]:
        return [("pin covers", f"{len(self.files)} files, {', '.join(self.keys)}; not the card or later records")]


# --------------------------------------------------------------------------- the source


@dataclass(kw_only=True)
class GGUFSource(Record, key="gguf", section="source"):
    """A source that was one GGUF file (convert/gguf.py): what it held and how it was unpacked."""

    file: str
    architecture: str | None = None
    file_type: str | None = None
    tensor_types: dict[str, int] = field(default_factory=dict)
    bits_per_weight: dict[str, float] = field(default_factory=dict)
    below_8_bits: bool = False
    lowest: str | None = None
    dtype: str | None = None
    unpacked: str | None = None
    more: dict = field(default_factory=dict)

    def precision_note(self) -> str | None:
        """One sentence when the weights were already below 8 bits (quantize's summary and the card say it)."""
        if not self.below_8_bits or self.lowest not in self.tensor_types:
            return None
        low = self.lowest
        return (
            f"the source weights were already below 8 bits: {self.file} is GGUF {self.file_type or low} "
            f"({self.tensor_types[low]} tensors {low}, {self.bits_per_weight.get(low, '?')} bits per weight with "
            "their scales); FP8 keeps that coarser grid and cannot restore what it lost, and validate compares "
            "against the same GGUF, dequantized"
        )


@dataclass(kw_only=True)
class DiffusionSource(Record, key="diffusion", section="source"):
    """A diffusion source (source.DiffusionSource): pipeline, component or single file, and the class."""

    layout: str
    component: str | None = None
    class_name: str | None = None
    more: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class VLLMBlock(Record, key="vllm_block", section="recipe"):
    """Block weights checked against vLLM's rule at quantize time (manifests/engines.py): the
    merged layers (qkv_proj, gate_up_proj) and MoE experts vLLM would refuse, with their sizes.
    In the recipe, so the pin covers it; the card and inspect read it through engines.line."""

    block: int
    vllm: str
    refused: list[str] = field(default_factory=list)
    more: dict = field(default_factory=dict)


_KINDS: dict[str, type[Record]] = {}


def register(kind: type[R]) -> type[R]:
    """Make a record kind known to the readers that walk a manifest (the card, inspect): the kinds
    here, and each Apple target's export and runtime records (apple/registry.py registers them)."""
    _KINDS[kind.path()] = kind
    return kind


def unregister(kind: type[Record]) -> None:
    _KINDS.pop(kind.path(), None)


def kinds(base: type[R] = Record) -> list[type[R]]:
    """The registered record kinds that are `base`s, in registration order."""
    return [k for k in _KINDS.values() if issubclass(k, base)]


for _kind in (
    Validation,
    Experts,
    ExpertCalibration,
    CalibrationRecord,
    Hub,
    Pin,
    GGUFSource,
    DiffusionSource,
    VLLMBlock,
):
    register(_kind)
