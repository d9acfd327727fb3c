"""The `mpsconvert.json` manifest: what went in, what was done, what came out, and checks since.

Everything in it is a pure function of the inputs and options except the `created` block
(timestamp, host), kept apart so that two identical runs give identical files otherwise.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..atomic import write_text
from ..errors import ArtifactError
from .layout import MANIFEST_NAME

SCHEMA_VERSION = 1


def library_versions() -> dict:
    """Versions of the libraries that shape an artifact (None where not installed).

    Read from package metadata, so that recording them imports nothing (coremltools is slow
    and noisy to import)."""
    from importlib import metadata

    out = {"mpsconvert": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors", "huggingface_hub", "compressed-tensors", "coremltools"):
        try:
            out[dist.replace("-", "_")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist.replace("-", "_")] = None
    return out


@dataclass
class Manifest:
    source: dict
    recipe: dict
    tensors: dict = field(default_factory=dict)  # name -> record (quantized weights and scales)
    skipped: dict = field(default_factory=dict)  # module -> reason it was left unquantized
    files: dict = field(default_factory=dict)  # output file -> {"sha256", "size"}
    device: str = "cpu"
    versions: dict = field(default_factory=library_versions)
    summary: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # later steps: calibration, coreml, validation
    created: dict = field(default_factory=lambda: {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        body = {
            "schema_version": self.schema_version,
            "tool": "mpsconvert",
            "versions": self.versions,
            "source": self.source,
            "recipe": self.recipe,
            "device": self.device,
            "summary": self.summary,
            "tensors": self.tensors,
            "skipped": self.skipped,
            "files": self.files,
            **self.extra,
            "created": self.created,
        }
        return json.dumps(body, indent=2, sort_keys=False, allow_nan=False) + "\n"

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        write_text(path, self.to_json())
        return path

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ArtifactError(f"{folder} has no {MANIFEST_NAME}", "is this an mpsconvert artifact? run `mpsconvert quantize` first")
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path} is not valid JSON ({e})", "re-run `mpsconvert quantize` to rebuild it") from e
        if body.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{path} has schema_version {body.get('schema_version')!r}, this mpsconvert reads {SCHEMA_VERSION}",
                "upgrade mpsconvert or rebuild the artifact",
            )
        known = {"schema_version", "tool", "versions", "source", "recipe", "device", "summary", "tensors", "skipped", "files", "created"}
        return cls(
            source=body["source"],
            recipe=body["recipe"],
            tensors=body.get("tensors", {}),
            skipped=body.get("skipped", {}),
            files=body.get("files", {}),
            device=body.get("device", "cpu"),
            versions=body.get("versions", {}),
            summary=body.get("summary", {}),
            extra={k: v for k, v in body.items() if k not in known},
            created=body.get("created", {}),
        )
