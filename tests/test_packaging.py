"""What pyproject.toml promises about installs, checked by evaluating its own requirements:
the test extra resolves to no Core AI wheel where coreai-core ships none (macOS 14 and 15, Intel
Macs, Linux on Arm), Triton only on Linux, and the floors CI's third lane installs are the ones
pyproject and the README state."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _env(system: str, machine: str, release: str, python: str = "3.11") -> dict:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "platform_system": system,
        "platform_machine": machine,
        "platform_release": release,
        "sys_platform": "darwin" if system == "Darwin" else system.lower(),
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_version": "",
        "extra": "",
    }


MACOS_14, MACOS_15, MACOS_26 = (_env("Darwin", "arm64", r) for r in ("23.6.0", "24.6.0", "25.1.0"))
INTEL_MAC = _env("Darwin", "x86_64", "24.6.0")
LINUX, LINUX_ARM = _env("Linux", "x86_64", "6.8.0-1025-aws"), _env("Linux", "aarch64", "6.8.0")


def installs(extra: str, env: dict, seen: frozenset = frozenset()) -> set[str]:
    """The distributions `pip install 'mpsconvert[extra]'` asks for on `env`, nested extras followed."""
    out: set[str] = set()
    for spec in PROJECT["optional-dependencies"][extra]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if req.name == "mpsconvert":
            for inner in req.extras - seen:
                out |= installs(inner, env, seen | {extra})
        else:
            out.add(req.name.lower())
    return out


def test_core_ai_installs_only_where_coreai_core_has_wheels():
    for env in (MACOS_26, LINUX):
        assert {"coreai-core", "coreai-torch"} <= installs("coreai", env)
    for env in (MACOS_14, MACOS_15, INTEL_MAC, LINUX_ARM, _env("Linux", "x86_64", "6.8.0", python="3.10")):
        assert not installs("coreai", env) & {"coreai-core", "coreai-torch"}, env


def test_the_test_extra_resolves_on_every_supported_mac():
    for env in (MACOS_14, MACOS_15, MACOS_26):
        got = installs("test", env)
        assert {"pytest", "hypothesis", "coremltools", "compressed-tensors", "diffusers", "gguf"} <= got
        assert "triton" not in got  # no macOS wheels
        assert ("coreai-core" in got) == (env is MACOS_26)
    assert "triton" in installs("test", LINUX)


def test_the_marker_reads_darwin_releases_as_versions():
    """platform_release '25.1.0' is macOS 26 (Darwin 25); '24.6.0' is macOS 15."""
    m = Marker("platform_release >= '25'")
    assert m.evaluate(MACOS_26) and not m.evaluate(MACOS_15) and not m.evaluate(MACOS_14)


def test_the_floor_lane_installs_the_floors_pyproject_and_readme_state():
    floors = dict(re.findall(r'"(torch|transformers)>=([\d.]+)"', "\n".join(f'"{d}"' for d in PROJECT["dependencies"])))
    r = subprocess.run([sys.executable, str(ROOT / ".ci" / "floor.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"torch=={floors['torch']}", f"transformers=={floors['transformers']}"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    short = {k: ".".join(v.split(".")[:2]) for k, v in floors.items()}
    assert f"torch >= {short['torch']}" in readme and f"transformers >= {short['transformers']}" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ".ci/floor.py" in ci and "-m core" in ci
