"""A hostile-artifact fuzz test (issue 14): seeded mutations of manifests, configs, indexes,
safetensors headers and file trees, run through verify, load, calibrate and export-coreml.

Counted and asserted: tracebacks (anything but an MpsconvertError: 0), writes outside the
artifact (0), tampered files accepted (a listed file changed, replaced by a link, or code
added, and still verified or loaded or used: 0). The counts are printed (pytest -s) for the
reliability table in docs/security.md.
"""

from __future__ import annotations

from functools import partial
import json
import os
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest

import mpsconvert
from mpsconvert.errors import MpsconvertError

from .models import resign, tiny, tiny_artifact, tree_hashes

CASES = int(os.environ.get("MPSCONVERT_FUZZ_CASES", "400"))
SEED = int(os.environ.get("MPSCONVERT_FUZZ_SEED", "14"))

HOSTILE_PATHS = ["../x", "/etc/passwd", "link/../../x", "link/payload", "a\\b", ".hidden", "a//b", "", "c:evil", "\x00",
                 "model.safetensors/..", "a/./b", "x" * 2000]
HOSTILE_VALUES = [None, 0, -1, 2**70, 1.5, "", "x", [], {}, [1, [2, [3]]], {"a": {"b": None}}, True, "../../x", "\u202e"]


def _dumps(body) -> str:
    """json.dumps, with the "__DEEP_n__" markers written as n nested arrays (json.dumps itself
    cannot write what we want the readers to refuse)."""
    text = json.dumps(body)
    for n in (70, 5000):
        text = text.replace(f'"__DEEP_{n}__"', "[" * n + "]" * n)
    return text


def _nodes(body, path=()):
    """Every (path, value) in a JSON value."""
    yield path, body
    if isinstance(body, dict):
        for k, v in body.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            yield from _nodes(v, (*path, i))


def _set(body, path, value):
    if not path:
        return value
    cur = body
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return body


def _mutate_json(rng: random.Random, body):
    nodes = list(_nodes(body))
    path, _ = rng.choice(nodes)
    r = rng.random()
    if r < 0.15 and path:
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        return body, f"delete {path[-3:]}"
    if r < 0.25:
        n = rng.choice([70, 5000])
        return _set(body, path, f"__DEEP_{n}__"), f"nested {n} deep at {path[-3:]}"
    value = rng.choice(HOSTILE_VALUES)
    return _set(body, path, value), f"{path[-3:]} = {str(value)[:20]!r}"


def _listed(art: Path) -> list[str]:
    return sorted(json.loads((art / "mpsconvert.json").read_text())["files"])


def mutate(rng: random.Random, art: Path, outside: Path) -> tuple[str, bool]:
    """Apply one mutation; returns (description, whether a listed file or the code was tampered with)."""
    kind = rng.choice(["flip", "truncate", "delete", "code", "extra", "manifest", "manifest-path", "config", "index",
                       "header", "link", "no-manifest"])
    files = [f for f in _listed(art) if f != "mpsconvert.json"]
    if kind == "flip":
        f = rng.choice(files)
        data = bytearray((art / f).read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (art / f).write_bytes(bytes(data))
        return f"flip a bit of {f}", True
    if kind == "truncate":
        f = rng.choice(files)
        data = (art / f).read_bytes()
        (art / f).write_bytes(data[: rng.randrange(len(data))] if rng.random() < 0.7 else data + b"\0" * rng.randint(1, 64))
        return f"resize {f}", True
    if kind == "delete":
        f = rng.choice(files)
        (art / f).unlink()
        return f"delete {f}", True
    if kind == "code":
        name = rng.choice(["modeling_evil.py", "sub/evil.py"])
        (art / name).parent.mkdir(exist_ok=True)
        (art / name).write_text(f"open({str(outside / 'code-ran')!r}, 'w')\n")
        if rng.random() < 0.5:  # and point config at it, re-recording config (the attacker rewrote that entry)
            cfg = json.loads((art / "config.json").read_text())
            cfg["auto_map"] = {"AutoConfig": name.replace("/", ".")[:-3] + ".X"}
            (art / "config.json").write_text(json.dumps(cfg))
            resign(art, "config.json")
        return f"add code {name}", True
    if kind == "extra":
        (art / "README.md").write_text("added")
        return "add an unlisted README.md", False
    if kind == "link":
        f = rng.choice(files)
        real = outside / f"real-{Path(f).name}"
        shutil.copyfile(art / f, real)  # same bytes, but outside the folder
        (art / f).unlink()
        (art / f).symlink_to(real)
        return f"{f} -> a link out of the folder", True
    if kind == "no-manifest":
        (art / "mpsconvert.json").unlink()
        return "delete the manifest", False
    if kind in ("manifest", "manifest-path"):
        body = json.loads((art / "mpsconvert.json").read_text())
        if kind == "manifest-path":
            (art / "link").symlink_to(outside, target_is_directory=True)
            old = rng.choice(files)
            body["files"][rng.choice(HOSTILE_PATHS)] = body["files"].pop(old)
            desc = f"manifest path for {old} made hostile"
        else:
            body, desc = _mutate_json(rng, body)
            desc = "manifest: " + desc
        (art / "mpsconvert.json").write_text(_dumps(body))
        return desc, False
    target = {"config": "config.json", "index": "model.safetensors.index.json"}.get(kind)
    if target is not None:
        body, desc = _mutate_json(rng, json.loads((art / target).read_text()))
        if kind == "index" and rng.random() < 0.5:
            wm = json.loads((art / target).read_text())["weight_map"]
            body = {"weight_map": {**wm, rng.choice(list(wm)): rng.choice(HOSTILE_PATHS + ["link/x.safetensors"])}}
            (art / "link").symlink_to(outside, target_is_directory=True)
            desc = "index names a hostile shard"
        (art / target).write_text(_dumps(body))
        resign(art, target)  # re-recorded: only the type and path checks stand in the way
        return f"{target}: {desc}", False
    # a safetensors header rewritten (and re-recorded)
    shard = rng.choice([f for f in files if f.endswith(".safetensors")])
    raw = (art / shard).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header, desc = _mutate_json(rng, header)
    new = _dumps(header).encode()
    new += b" " * (-len(new) % 8)
    (art / shard).write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    resign(art, shard)
    return f"{shard} header: {desc}", False


def _mpsconvert_temp() -> set[str]:
    """This process's folders in the system temp dir (other runs on the machine make their own)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"mpsconvert-*-{os.getpid()}-*")}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.mktemp("fuzz"), "llama-sharded", partial(tiny, "llama", max_shard_size="100KB"))


@pytest.mark.extra("coreml")
def test_hostile_artifacts(base, tmp_path):
    import coremltools  # noqa: F401  (imported once, outside the timed cases)

    rng = random.Random(SEED)
    counts = {"cases": 0, "tampered": 0, "ops": 0, "refused": 0, "tracebacks": 0, "writes_outside": 0, "tampered_accepted": 0}
    failures = []
    temp_before = _mpsconvert_temp()
    t0 = time.monotonic()
    for case in range(CASES):
        box = tmp_path / f"c{case}"
        outside = box / "outside"
        outside.mkdir(parents=True)
        (outside / "payload").write_text("x")
        art = box / "art"
        shutil.copytree(base, art)
        desc, tampered = mutate(rng, art, outside)
        counts["cases"] += 1
        counts["tampered"] += tampered
        before_outside = tree_hashes(outside)
        ops = ["verify", "load"] + (["calibrate", "export-coreml"] if case % 3 == 0 else [])
        verified = None
        for op in ops:
            if op in ("calibrate", "export-coreml") and verified:
                continue  # a sound artifact: a full calibration / export is covered elsewhere
            counts["ops"] += 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if op == "verify":
                        rep = mpsconvert.verify(art, trust_remote_code=rng.random() < 0.5)
                        verified = rep.ok
                        accepted = rep.ok
                    elif op == "load":
                        mpsconvert.load(art, device="cpu", trust_remote_code=rng.random() < 0.5)
                        accepted = True
                    elif op == "calibrate":
                        mpsconvert.calibrate(art, options=mpsconvert.calibration_options(num_samples=1, seq_len=16))
                        accepted = True
                    else:
                        mpsconvert.export_coreml(art, check=False, kv_cache=False, seq_len="8")
                        accepted = True
            except MpsconvertError:
                counts["refused"] += 1
                accepted = False
            except BaseException as e:  # noqa: BLE001  (the point: anything else is a traceback)
                counts["tracebacks"] += 1
                failures.append(f"case {case} ({desc}) {op}: {type(e).__name__}: {str(e)[:200]}")
                accepted = False
            if tampered and accepted:
                counts["tampered_accepted"] += 1
                failures.append(f"case {case} ({desc}) {op}: accepted a tampered artifact")
            if tree_hashes(outside) != before_outside or (outside / "code-ran").exists() \
                    or set(os.listdir(box)) - {"art", "outside"} - {".mpsconvert-lock-art"}:
                counts["writes_outside"] += 1
                failures.append(f"case {case} ({desc}) {op}: wrote outside the artifact: {sorted(os.listdir(box))}")
        shutil.rmtree(box, ignore_errors=True)
    leftovers = _mpsconvert_temp() - temp_before
    counts["seconds"] = round(time.monotonic() - t0, 1)
    print("\nfuzz counts:", json.dumps(counts))
    assert not failures, "\n".join(failures[:20])
    assert not leftovers, leftovers
    assert counts["tampered"] >= CASES // 4 and counts["refused"] > 0
