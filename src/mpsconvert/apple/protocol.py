"""What an Apple export target is: the protocol Core ML and Core AI implement (apple/coreml,
apple/coreai), and the settings they declare as data.

A target turns an FP8 artifact into a package inside it (`model.mlpackage`, `model.aimodel`),
checks that package without Apple hardware, opens it as a decoder for `generate` / `chat`, and
measures it beside PyTorch for `validate`. Everything the targets share (the artifact's lock, its
verification, the staged swap that publishes the package with its record, check and card) is
apple/flow.py's; everything that names a target (the API's `export`/`check`, the CLI's
`export-<key>` and `quantize --<key>` options, the renderer, the card's paragraph, inspect's
row) is generated from the registry (apple/registry.py). This module is light (no torch, no
target library), so the CLI's options come from here without loading either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    from ..infra.progress import Progress
    from ..manifests.manifest import Manifest
    from ..manifests.records import AppleExport, RuntimeResult


@dataclass(frozen=True)
class Option:
    """One setting of a target's export or check, as data: the CLI makes a click option of it and
    the API a field of the target's options (`name`).

    `kind`: "int", "str", "flag" or a tuple of choices. `negate`: a flag that sets the field
    False (`--no-kv-cache` -> kv_cache=False). `quantize`: also offered by `quantize --<key>`,
    spelled `quantize` there (`--coreml-seq-len`); targets that spell an option the same share it
    (`--max-len`)."""

    name: str
    flag: str
    help: str
    kind: Any = "str"
    default: Any = None
    minimum: int | None = None
    negate: bool = False
    quantize: str | None = None
    metavar: str | None = None


def max_len_option(help: str) -> Option:
    """The KV cache length every target exports with: one `--max-len` that `quantize` shares between
    the targets, so its kind, minimum and spelling are the same everywhere; `help` says what it means
    for the target."""
    return Option("max_len", "--max-len", help, kind="int", minimum=2, quantize="--max-len")


def check_numbers(opts, flags: tuple[Option, ...]) -> None:
    """Every integer setting of `opts` that one of `flags` declares, within untrusted.LIMITS for
    its API name (`--decode-steps 1000000000` is one line, not a run that never ends)."""
    from ..infra.untrusted import LIMITS, bounded

    for o in flags:
        v = getattr(opts, o.name, None)
        if o.kind == "int" and v is not None and o.name in LIMITS:
            bounded(v, o.name)


class Target:
    """An Apple export target. Subclasses set the class attributes and implement the methods;
    each method imports its heavy modules (torch, the target's library) when it is called."""

    key: ClassVar[str]  # "coreml" (the record's KEY): `export-<key>`, `quantize --<key>`, `--backend <key>`
    name: ClassVar[str]  # "Core ML" (the record's NAME)
    package: ClassVar[str]  # "model.mlpackage": the package's name inside the artifact
    noun: ClassVar[str]  # "package" | "asset": what the messages call it
    module: ClassVar[str]  # the import that says the target's library is installed
    extra: ClassVar[str]  # the pip extra that brings it
    record: ClassVar[type[AppleExport]]  # the manifest record of an export (with its check)
    runtime_record: ClassVar[type[RuntimeResult]]  # the manifest record of validate's runtime part
    options: ClassVar[type]  # the export settings (a dataclass with `force`)
    check_options: ClassVar[type]  # the check settings (a dataclass)
    export_flags: ClassVar[tuple[Option, ...]] = ()
    check_flags: ClassVar[tuple[Option, ...]] = ()
    help: ClassVar[str]  # the `export-<key>` command's help
    quantize_help: ClassVar[str]  # `quantize --<key>`'s help
    backend_help: ClassVar[str]  # `generate --backend <key>`'s help: what runs the package, where
    check_fix: ClassVar[str]  # what to try when its checks fail

    def __init_subclass__(cls, **kw):
        """`key` and `name` default to the record's KEY and NAME, so that a target says them once."""
        super().__init_subclass__(**kw)
        if "record" in vars(cls):
            cls.key = vars(cls).get("key", cls.record.KEY)
            cls.name = vars(cls).get("name", cls.record.NAME)

    def make_options(self, **kw):
        """The export options from keyword settings (the CLI's and the API's values)."""
        return self.options(**kw)

    def build(self, folder: Path, manifest: Manifest, opts, progress: Progress) -> AppleExport:
        """Write the package into `folder / self.package` from the (verified) artifact in
        `folder`; return its record (without a check)."""
        raise NotImplementedError

    def check(self, folder: Path, record: AppleExport, opts, progress: Progress) -> dict:
        """Every check of the package in `folder` that needs no Apple hardware; `ok` says if it passed."""
        raise NotImplementedError

    def failed(self, check: dict) -> str:
        """What failed in a check, in one line."""
        return failed_checks(check)

    def runnable(self) -> None:
        """Raise (one line: why, and what to use instead) where this machine cannot run the package."""
        from ..infra.extras import require

        require(self.module, self.extra, f"running the {self.name} {self.noun}")

    def open_decoder(self, package: Path, record: AppleExport, close: Callable) -> tuple[Callable, str]:
        """A verified stateful package as `(new_conversation, what runs it)` for generate / chat
        (apple/compare.py's runner contract); `close(cm)` enters a context to leave at the end."""
        raise NotImplementedError

    def latency(self, artifact: Path, record: AppleExport, settings: dict, progress: Progress) -> dict:
        """validate's part: the package's latency (and accuracy) beside PyTorch with the settings the
        PyTorch rows were measured with (`ValidationResult.settings`), or why it did not run
        ({"status": "skipped", "reason"})."""
        raise NotImplementedError

    def measure(self, artifact: Path, record: AppleExport, **settings) -> dict:
        """The package's latency beside PyTorch with explicit settings (the API's `<key>_latency`)."""
        raise NotImplementedError(
            f"the {self.name} target has no latency measurement of its own; `validate` runs its part"
        )

    def rows(
        self, artifact: Path, record: dict, check: dict
    ) -> tuple[list[tuple[str, str, bool | None]], dict | None, str]:
        """What the CLI shows of a check: (label, text, ok) rows (ok False: shown as a failure),
        the decoder check to show as its own table (or None) and that table's title."""
        raise NotImplementedError

    def written(self, record: dict) -> str:
        """The line the CLI prints once the package is written."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name} target {self.key!r}>"


def package_in(artifact: Path, name: str, key: str) -> Path:
    """The package `name` of target `key` in `artifact`, or one line saying there is none and what makes one."""
    from ..errors import ArtifactError

    p = Path(artifact) / name
    if not p.is_dir():
        raise ArtifactError(f"{artifact} has no {name}", f"run `mpsconvert export-{key}` first")
    return p


def failed_checks(res: dict) -> str:
    """What failed in an export's check (interface, weights read back, the evaluation), in one line."""
    bad = []
    if res.get("interface") and not res["interface"]["ok"]:
        bad.append("; ".join(res["interface"]["problems"]))
    if not res["weights"]["all_ok"]:
        bad.append(
            "weights read back differ "
            f"({sum(1 for r in res['weights']['tensors'].values() if not r.get('ok'))} tensors)"
        )
    ev = res.get("reference_eval") or res.get("runtime_eval")
    if ev and not ev["ok"]:
        if "prefill" in ev:
            bad.append(
                f"prefill top-1 {ev['prefill']['top1_agreement']:.1%}, decode top-1 "
                f"{ev['decode']['top1_agreement']:.1%}, cosine min "
                f"{min(ev['prefill']['cosine_min'], ev['decode']['cosine_min']):.4f}"
            )
        else:
            bad.append(
                f"cosine min {ev['cosine_min']:.4f}"
                + (f", top-1 {ev['top1_agreement']:.1%}" if "top1_agreement" in ev else "")
            )
    return "; ".join(bad) or "see the recorded check"


def feature_text(f: dict) -> str:
    """An input, output or state of a package as `name dtype [1x?x64] range [[1, 512]]`."""
    rng = f" range {f['range']}" if f.get("range") else ""
    shape = "x".join("?" if d is None else str(d) for d in f["shape"]) if f.get("shape") else "?"
    return f"{f['name']} {f['dtype']} [{shape}]{rng}"


def states_rows(interface: dict) -> list[tuple[str, str, None]]:
    """A stateful decoder's states (the KV cache of every layer) as a check's one row; none for a
    package without states."""
    states = interface.get("states")
    if not states:
        return []
    return [
        (
            "states",
            f"{len(states)}: key_cache_i / value_cache_i for {len(states) // 2} layers, each "
            f"{feature_text(states[0]).split(' ', 1)[1]}",
            None,
        )
    ]
