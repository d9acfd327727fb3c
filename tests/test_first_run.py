"""What a new user meets on a first run (and bad input on a Mac install): every command that writes
takes its lock before any work, an existing output is refused before torch loads, the manifest
sha256 is printed whole and a malformed pin is said as such, the card names the folder it is in,
long runs are not silent in a log, inspect says what the run concluded."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert import api
from mpsconvert.cli import main, progress_bars, render
from mpsconvert.manifests.manifest import Manifest

from . import models


def cli(*args, **kw):
    return CliRunner(**kw).invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(res, *matches, code=2):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for m in matches:
        assert m in lines[0], lines[0]


@pytest.fixture(scope="module")
def art(work):
    return models.tiny_artifact(
        work, "llama", lambda p: models.tiny("llama", p, tokenizer="bpe", dtype=torch.bfloat16, tie=True)
    )


@pytest.fixture
def copy(art, tmp_path):
    import shutil

    out = tmp_path / "art"
    shutil.copytree(art, out)
    return out


def never(what):
    def fail(*a, **k):
        raise AssertionError(f"{what} ran although the output is locked by another run")

    return fail


@pytest.fixture
def held_elsewhere():
    """Hold `target`'s lock from another process, as a second mpsconvert run would."""
    procs = []

    def hold(target):
        code = textwrap.dedent(f"""
            import fcntl, os, sys, time
            from pathlib import Path
            t = Path({str(target.absolute())!r})
            fd = os.open(t.parent / (".mpsconvert-lock-" + t.name), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("held", flush=True)
            time.sleep(120)
        """)
        target.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)

    yield hold
    for p in procs:
        p.kill()
        p.wait()


# --------------------------------------------------------------------------- the lock, before any work


def test_quantize_into_a_locked_output_is_refused_before_resolving_a_hub_id(held_elsewhere, tmp_path, monkeypatch):
    from mpsconvert.source import snapshot as source

    out = tmp_path / "out"
    held_elsewhere(out)
    monkeypatch.setattr(source, "_download", never("the hub download"))
    one_line_error(cli("quantize", "org/model", "-o", out), "another mpsconvert run is writing")
    held_elsewhere(tmp_path / "model-fp8-dynamic")  # the default output name is claimed as well
    monkeypatch.chdir(tmp_path)
    one_line_error(cli("quantize", "org/model"), "another mpsconvert run is writing")


def test_quantize_of_a_folder_into_a_locked_output_does_no_work(held_elsewhere, tiny_models, tmp_path, monkeypatch):
    import mpsconvert.convert.quantize as q
    from mpsconvert.calibrate import artifact as calibrate_artifact

    out = tmp_path / "out"
    held_elsewhere(out)
    monkeypatch.setattr(q, "quantize_snapshot", never("the conversion"))
    monkeypatch.setattr(calibrate_artifact, "calibrate", never("calibration"))
    one_line_error(
        cli("quantize", tiny_models["llama"], "-o", out, "--scheme", "fp8"), "another mpsconvert run is writing"
    )
    assert not out.exists()


def test_calibrate_validate_and_upload_into_a_locked_artifact_do_no_work(held_elsewhere, copy, monkeypatch):
    import mpsconvert.manifests.verify as verify
    import mpsconvert.runtime.evaluate.validate as validate
    from mpsconvert.calibrate import artifact as calibrate_artifact

    held_elsewhere(copy)
    before = models.tree_hashes(copy)
    monkeypatch.setattr(verify, "check_before_use", never("verification"))
    monkeypatch.setattr(calibrate_artifact, "calibrate", never("calibration"))
    monkeypatch.setattr(validate, "validate", never("the validation run"))
    monkeypatch.setattr(api, "verify", never("the upload's verification"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for args in (("calibrate", copy), ("validate", copy, "--device", "cpu"), ("upload", copy, "me/x")):
        one_line_error(cli(*args), "another mpsconvert run is writing")
    assert models.tree_hashes(copy) == before


@pytest.mark.extra("coreai")
def test_an_apple_export_and_its_check_run_under_one_lock(held_elsewhere, copy, monkeypatch):
    """The export and its check hold one lock: with a lock each, a second export started in between
    would work for its whole length, then fail, and leave the first one unchecked."""
    import mpsconvert.apple.coreai.coreai_check as check
    import mpsconvert.apple.coreai.coreai_export as export

    held_elsewhere(copy)
    monkeypatch.setattr(export, "build", never("the Core AI export"))
    monkeypatch.setattr(check, "check_asset", never("the Core AI check"))
    one_line_error(cli("export-coreai", copy), "another mpsconvert run is writing")
    one_line_error(cli("export-coreai", copy, "--check-only"), "another mpsconvert run is writing")


def test_a_command_joins_its_own_lock_and_nobody_else_does(tmp_path):
    from mpsconvert.errors import MpsconvertError
    from mpsconvert.infra import atomic

    out = tmp_path / "out"
    with atomic.claim(out):
        with atomic.writing(out), atomic.writing(out):  # the steps of the command that claimed it
            pass
        assert (tmp_path / f"{atomic.LOCK_PREFIX}out").exists()
    assert not (tmp_path / f"{atomic.LOCK_PREFIX}out").exists()
    with atomic.writing(out):  # an ordinary holder: a second one is refused, also in this process
        with pytest.raises(MpsconvertError, match="another mpsconvert run"):
            with atomic.claim(out):
                pass


def test_an_existing_output_is_refused_before_torch_loads_or_the_hub_is_asked(art, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    code = textwrap.dedent(f"""
        import sys
        from mpsconvert import api
        from mpsconvert.errors import MpsconvertError
        for out, force in (({str(art)!r}, False), ({str(tmp_path / "plain")!r}, True)):
            try:
                api.quantize("org/not-downloaded", out, force=force)
            except MpsconvertError as e:
                print(e)
        print("torch" in sys.modules, "transformers" in sys.modules, "huggingface_hub" in sys.modules)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3, r.stdout + r.stderr
    assert "already exists; pass --force" in lines[0]
    assert "is not an mpsconvert artifact" in lines[1] and "pass --force" not in lines[1]
    assert lines[2] == "False False False"
    # the command line too (it builds the calibration options first: they must not load torch)
    code = (
        "import sys, atexit; atexit.register(lambda: print('torch' in sys.modules)); from mpsconvert.cli import main; "
        f"main(['quantize', {str(art.parent / 'src-llama')!r}, '-o', {str(art)!r}])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "already exists" in r.stderr and r.stdout.strip() == "False", r.stdout + r.stderr


# --------------------------------------------------------------------------- the manifest sha256


@pytest.mark.parametrize("columns", ["80", "40"])
def test_the_manifest_sha256_is_printed_whole(tiny_models, tmp_path, columns):
    res = cli("quantize", tiny_models["llama"], "-o", tmp_path / "out", env={"COLUMNS": columns})
    assert res.exit_code == 0, res.output
    from mpsconvert.manifests.manifest import manifest_sha256

    want = manifest_sha256(tmp_path / "out")
    assert (
        f"manifest sha256 {want} " in res.output
    )  # on one line, all 64 digits (a table cut it with "…" at 80 columns)
    res = cli("verify", tmp_path / "out", "--manifest-sha256", want, env={"COLUMNS": columns})
    assert res.exit_code == 0 and f"manifest sha256 {want}\n" in res.output


def test_a_pin_that_is_not_a_sha256_says_so(art):
    from mpsconvert.manifests.manifest import manifest_sha256

    good = manifest_sha256(art)
    cut = good[:40] + "…"  # what the old summary printed at 80 columns
    one_line_error(cli("verify", art, "--manifest-sha256", cut), "--manifest-sha256", "is not a sha256")
    with pytest.raises(mpsconvert.MpsconvertError, match="is not a sha256"):
        mpsconvert.load(art, device="cpu", manifest_sha256="abc")
    res = cli("verify", art, "--manifest-sha256", "0" * 64)  # a real sha256 that differs: the manifest was changed
    assert res.exit_code == 1 and "the manifest was changed" in " ".join(res.output.split())
    assert cli("verify", art, "--manifest-sha256", f"  {good.upper()} ").exit_code == 0  # case and spaces of a paste


# --------------------------------------------------------------------------- the card, generate, inspect


def test_the_card_names_the_folder_the_artifact_is_in(tiny_models, tmp_path):
    out = tmp_path / "models" / "my-llama"
    assert cli("quantize", tiny_models["llama"], "-o", out).exit_code == 0
    card = (out / "README.md").read_text()
    assert 'mpsconvert generate my-llama "Hello"' in card and 'from_pretrained("my-llama"' in card
    assert "llama-fp8-dynamic" not in card  # the default name, a folder that does not exist
    moved = tmp_path / "renamed"
    out.rename(moved)
    from mpsconvert.manifests.transaction import transaction

    with transaction(
        moved
    ):  # any later change (validate, an export) rewrites the card, naming the folder as it is then
        pass
    assert 'mpsconvert generate renamed "Hello"' in (moved / "README.md").read_text()
    assert mpsconvert.verify(moved).ok


@pytest.mark.skipif(sys.platform == "darwin", reason="Core ML runs on macOS")
def test_generate_with_core_ml_off_macos_says_so_before_anything_else(art, monkeypatch):
    from mpsconvert.apple import flow

    monkeypatch.setattr(flow.Manifest, "read", never("the artifact's verification and package lookup"))
    one_line_error(cli("generate", art, "hi", "--backend", "coreml"), "only on macOS", "--backend coreai")


def test_inspect_shows_the_runs_verdict_and_sorts_layers_by_number(tmp_path):
    from mpsconvert.manifests.transaction import transaction

    src = models.tiny(
        "llama",
        tmp_path / "src",
        vocab=128,
        layers=11,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    out = mpsconvert.quantize(src, tmp_path / "a").output
    with transaction(out) as t:  # the card is rewritten with the record
        t.manifest.extra["validation"] = {
            "CPU (cpu)": {
                "kind": "causal-lm",
                "device": "cpu",
                "scheme": "fp8-dynamic",
                "measured_at": "2026-01-01T00:00:00Z",
                "accuracy": {
                    "perplexity_bf16": 10.0,
                    "perplexity_fp8": 10.1,
                    "perplexity_delta_pct": 1.0,
                    "mean_kl": 0.01,
                    "top1_agreement": 0.95,
                    "tokens": 64,
                },
                "speedup": {"prefill": 1.5, "decode": 0.38},
                "verdict": {
                    "prefill": {"ratio": 1.5, "spread": 0.05, "verdict": "faster"},
                    "decode": {"ratio": 0.38, "spread": 2.1, "verdict": "no clear difference"},
                },
            }
        }
    res = cli("inspect", out, env={"COLUMNS": "300"})
    assert res.exit_code == 0
    assert "decode no clear difference (0.38x" in res.output and "decode 0.38x" not in res.output
    assert "prefill 1.50x faster" in res.output
    text = (out / "README.md").read_text()
    assert "no clear difference (0.38x)" in text and "| 0.38x |" not in text and "1.5x faster" in text
    assert Manifest.read(out).extra["validation"]["CPU (cpu)"]["speedup"]["decode"] == 0.38  # the figure is kept
    res = cli("inspect", out, "--tensors", env={"COLUMNS": "300"})
    order = [int(ln.split("layers.")[1].split(".")[0]) for ln in res.output.splitlines() if "self_attn.q_proj" in ln]
    assert order == list(range(11))


# --------------------------------------------------------------------------- progress in a log


def test_without_a_terminal_a_long_phase_prints_a_line_every_few_seconds():
    now = [0.0]
    lines = []
    p = progress_bars.ProgressLines(every=10, clock=lambda: now[0], write=lines.append)
    p("quick", 0, 3, "")
    now[0] = 1
    p("quick", 3, 3, "")  # under 10 s: nothing (a short command's output is its result)
    assert lines == []
    now[0] = 2
    p("accuracy", 0, 8, "")
    now[0] = 11
    p("accuracy", 1, 8, "")
    assert lines == []  # 9 s into the phase
    now[0] = 12.5
    p("accuracy", 2, 8, "")
    assert lines == ["accuracy: 2/8 (10 s, about 32 s left)"]  # 6 more steps at the rate of the first 2
    now[0] = 20
    p.tick()  # the timer: no update came, and 7.5 s is not yet the interval
    now[0] = 23
    p.tick()  # nothing reported for 10.5 s: still a line (a phase with no updates is not silent)
    assert lines[-1] == "accuracy: 2/8 (21 s, about 63 s left)"
    now[0] = 40
    p("accuracy", 8, 8, "")
    assert lines[-1] == "accuracy: 8/8 (38 s, done)" and len(lines) == 3
    now[0] = 100
    p.tick()
    assert len(lines) == 3  # a finished phase says nothing more
    p("quantize", 0, 2 << 30, "model.layers.0.mlp.down_proj.weight")
    now[0] = 111
    p.tick()
    assert lines[-1] == "quantize: 0 B of 2.0 GiB model.layers.0.mlp.down_proj.weight (11 s)"


def test_progress_lines_come_from_a_timer_when_stderr_is_a_log(capsys):
    assert not render.console.is_terminal
    with progress_bars.progress_bars(every=0.05) as progress:
        progress("latency", 0, 3, "rounds")
        time.sleep(0.5)  # no update: the timer keeps the phase visible
    err = capsys.readouterr().err
    assert err.count("latency: 0/3 rounds") >= 2, err


# --------------------------------------------------------------------------- Ctrl-C


def test_an_interrupt_that_surfaces_as_another_error_is_one_line_and_exit_130(art, monkeypatch):
    """Ctrl-C during `import transformers` can end as an ImportError of a half-imported module, or
    as our error about a config it could not read: once a stop was asked for, it is the stop."""
    from mpsconvert.cli import app
    from mpsconvert.errors import SourceError

    for surfaced in (
        ImportError("cannot import name 'LlamaConfig' from partially initialized module"),
        SourceError("transformers cannot read config.json: ModuleNotFoundError"),
    ):

        def interrupted_import(*a, surfaced=surfaced, **k):
            try:
                app._on_signal(signal.SIGINT, None)
            except KeyboardInterrupt:
                raise surfaced from None

        monkeypatch.setattr(api, "inspect", interrupted_import)
        res = cli("inspect", art)
        assert res.exit_code == 130 and res.output.strip() == "interrupted: partial output removed", res.output
    monkeypatch.undo()
    assert cli("inspect", art).exit_code == 0  # the next command of the process starts afresh


def test_an_interrupt_while_the_program_imports_is_one_line():
    code = textwrap.dedent("""
        import sys
        import mpsconvert  # the API, before the program's own imports

        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "mpsconvert.cli.render":
                    raise KeyboardInterrupt
        sys.meta_path.insert(0, Interrupt())
        import mpsconvert.cli
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130 and r.stderr.strip() == "interrupted" and "Traceback" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- bad input on a Mac install


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_and_writes_nothing(art, tiny_models, tmp_path):
    before = models.tree_hashes(art)
    for args in (
        ("generate", art, "hi", "--device", "cuda"),
        ("chat", art, "--device", "cuda"),
        ("validate", art, "--device", "cuda"),
        ("calibrate", art, "--device", "cuda"),
        ("quantize", tiny_models["llama"], "-o", tmp_path / "out", "--scheme", "fp8", "--device", "cuda"),
    ):
        one_line_error(cli(*args), "CUDA is not available", "--device auto")
    assert models.tree_hashes(art) == before and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mpsconvert")]


def test_backend_coreai_without_the_extra_is_one_line(art, monkeypatch):
    import mpsconvert.manifests.verify as verify

    models.hide_modules(monkeypatch, "coreai")
    monkeypatch.setattr(verify, "check_before_use", never("verifying the artifact for a runtime that is not installed"))
    before = models.tree_hashes(art)
    for args in (("generate", art, "hi", "--backend", "coreai"), ("chat", art, "--backend", "coreai")):
        one_line_error(cli(*args), "pip install 'mpsconvert[coreai]'")
    assert models.tree_hashes(art) == before
    res = cli("quantize", art.parent / "src-llama", "-o", art.parent / "never", "--coreai")
    one_line_error(res, "pip install 'mpsconvert[coreai]'")
    assert not (art.parent / "never").exists()
    assert json.loads(json.dumps(Manifest.read(art).extra)).get("coreai") is None
