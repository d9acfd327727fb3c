"""The CLI: bad inputs get one clear line, a non-zero exit, and leave nothing behind."""

import json
import shutil
import struct

import pytest
from click.testing import CliRunner
from safetensors.torch import save_file

from mpsconvert.cli import main

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".mpsconvert-tmp"))


def assert_clean_failure(res, tmp_path, match):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert match in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_help_lists_commands_and_options():
    res = run("--help")
    assert res.exit_code == 0 and "quantize" in res.output and "inspect" in res.output
    res = run("quantize", "--help")
    for opt in ("--scheme", "--weights", "--revision", "--token", "--ignore", "--force", "-o"):
        assert opt in res.output


def test_quantize_then_inspect(tiny_models, tmp_path):
    res = run("quantize", tiny_models["llama"], "-o", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["tensors_quantized"] == 14 and summary["ratio"] < 1
    res = run("inspect", tmp_path / "out")
    assert res.exit_code == 0 and "fp8-dynamic" in res.output and "worst SQNR" in res.output
    res = run("inspect", tmp_path / "out", "--json")
    assert json.loads(res.output)["recipe"]["name"] == "fp8-dynamic"
    res = run("inspect", tmp_path / "out", "--tensors")
    assert "model.layers.1.mlp.down_proj.weight" in res.output


def test_missing_path(tmp_path):
    assert_clean_failure(run("quantize", tmp_path / "nope", "-o", tmp_path / "out"), tmp_path, "does not exist")


def test_non_hf_folder(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("hi")
    assert_clean_failure(run("quantize", tmp_path / "junk", "-o", tmp_path / "out"), tmp_path, "no config.json")


def test_pickle_only(tmp_path, tiny_models):
    d = tmp_path / "pkl"
    d.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    assert_clean_failure(run("quantize", d, "-o", tmp_path / "out"), tmp_path, "only pickle weights")


@pytest.mark.parametrize("corrupt", ["header_json", "header_len", "truncated", "offsets"])
def test_corrupt_safetensors(tmp_path, tiny_models, corrupt):
    d = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], d)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    if corrupt == "header_json":
        data[8:12] = b"\xff\xfe{{"
    elif corrupt == "header_len":
        data[:8] = struct.pack("<Q", len(data) * 2)
    elif corrupt == "truncated":
        data = data[: len(data) - 100]
    else:
        hdr = json.loads(data[8 : 8 + n])
        k = next(k for k in hdr if k != "__metadata__")
        hdr[k]["data_offsets"][1] += 4
        raw = json.dumps(hdr).encode().ljust(n)
        data[8 : 8 + n] = raw[:n] if len(raw) >= n else raw
    f.write_bytes(bytes(data))
    assert_clean_failure(
        run("quantize", d, "-o", tmp_path / "out"), tmp_path, "model.safetensors is not a valid safetensors file"
    )


def test_nan_weights_name_the_tensor(tmp_path, tiny_models):
    d = tmp_path / "nan"
    shutil.copytree(tiny_models["llama"], d)
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.gate_proj.weight"][5, 7] = float("nan")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(
        run("quantize", d, "-o", tmp_path / "out"), tmp_path, "'model.layers.1.mlp.gate_proj.weight' contains NaN"
    )


def test_existing_output_needs_force_and_is_kept_on_failure(tmp_path, tiny_models):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    res = run("quantize", tiny_models["llama"], "-o", out)
    # not "pass --force": --force would refuse this folder too (it replaces only mpsconvert artifacts)
    assert res.exit_code == 2 and "not an mpsconvert artifact" in res.output and "pass --force" not in res.output, (
        res.output
    )
    assert (out / "precious.txt").read_text() == "keep me"
    # --force with a failing conversion must not destroy what was there
    d = tmp_path / "nan"
    shutil.copytree(tiny_models["llama"], d)
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("inf")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    res = run("quantize", d, "-o", out, "--force")
    assert res.exit_code == 2 and (out / "precious.txt").read_text() == "keep me"
    # --force replaces only an mpsconvert artifact: a folder of other files is refused
    res = run("quantize", tiny_models["llama"], "-o", out, "--force")
    assert (
        res.exit_code == 2
        and "not an mpsconvert artifact" in res.output
        and (out / "precious.txt").read_text() == "keep me"
    )
    (out / "precious.txt").unlink()
    out.rmdir()
    assert run("quantize", tiny_models["llama"], "-o", out).exit_code == 0
    res = run("quantize", tiny_models["llama"], "-o", out)  # an artifact: --force is the fix, and it works
    assert res.exit_code == 2 and "already exists" in res.output and "pass --force" in res.output, res.output
    (out / "stale.txt").write_text("x")  # a file the manifest does not list: --force names it and keeps it
    res = run("quantize", tiny_models["llama"], "-o", out, "--force")
    assert res.exit_code == 2 and "stale.txt" in res.output and (out / "stale.txt").read_text() == "x", res.output
    res = run("quantize", tiny_models["llama"], "-o", out, "--force", "--force-delete-unlisted")
    assert res.exit_code == 0 and not (out / "stale.txt").exists() and (out / "mpsconvert.json").is_file()
    assert leftovers(tmp_path) == []


def test_inspect_of_a_non_artifact(tmp_path):
    res = run("inspect", tmp_path)
    assert res.exit_code == 2 and "no mpsconvert.json" in res.output


def test_the_program_exits_with_its_codes_and_flushes_its_output(tmp_path, tiny_models):
    """`mpsconvert` (cli.entry) leaves through os._exit: codes and output must survive that."""
    import subprocess
    import sys

    def prog(*args):
        return subprocess.run(
            [sys.executable, "-m", "mpsconvert.cli", *args], capture_output=True, text=True, timeout=300
        )

    r = prog("--version")
    assert r.returncode == 0 and "mpsconvert" in r.stdout
    r = prog("quantize", str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "does not exist" in r.stdout + r.stderr
    r = prog("quantize", "--scheme", "fp9", str(tmp_path))
    assert r.returncode == 2 and "fp9" in r.stderr  # click's usage error
    out = tmp_path / "art"
    r = prog("quantize", str(tiny_models["llama"]), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors_quantized"] > 0  # the summary was flushed before the exit
    assert (out / "mpsconvert.json").is_file()


def test_errors_name_api_options_and_the_cli_prints_their_flags():
    """The library names an option by its API name in backticks (what a Python caller passes);
    the CLI prints the flag that sets it, and leaves other backticked text alone."""
    import mpsconvert
    from mpsconvert.cli.flags import as_flags

    with pytest.raises(mpsconvert.MpsconvertError) as e:
        mpsconvert.quantize("unused", weights="row", block_size=64)
    assert str(e.value) == "`block_size=64` applies to block weights only; add `weights=block`, or drop `block_size`"
    assert (
        as_flags(str(e.value))
        == "--block-size 64 applies to block weights only; add --weights block, or drop --block-size"
    )
    assert as_flags(
        "pass `use_template=False`, `data='x'`, `scales_file`, `exports=coreml`; run `mpsconvert verify DIR`, "
        "the `coreml` record"
    ) == (
        "pass --ignore-chat-template, --calib-data 'x', --scales, --coreml; run `mpsconvert verify DIR`, "
        "the `coreml` record"
    )
    res = CliRunner().invoke(main, ["quantize", "unused", "--weights", "row", "--block-size", "64"])
    assert (
        res.exit_code == 2 and "--block-size 64 applies to block weights only" in res.output and "`" not in res.output
    )
