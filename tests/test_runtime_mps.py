"""What only a Mac runs, run here on a fake MPS device (tests/fake_mps.py: CPU tensors that refuse
float64, float8 before torch 2.15, FP8 matmuls and a foreign sampling generator, as MPS does; two
profiles, the torch 2.13 and the torch 2.15 a Mac user runs, and a last test that every MPS branch
of src/ ran under one of them):
metrics and observers without float64 on the device, sampling with the device's generator, the
capability probe said once, e4m3 codes held as bytes and decoded bit by bit where the device has
no float8, MoE experts in one copy, the chip in the device name, and `--device mps` without MPS."""

from __future__ import annotations

import warnings

import pytest
import torch
from click.testing import CliRunner

import mpsconvert
from mpsconvert.calibrate import observers
from mpsconvert.format import fp8
from mpsconvert.infra import devices
from mpsconvert.runtime import engine as generate
from mpsconvert.runtime.evaluate import metrics
from mpsconvert.runtime.load.policy import KernelPolicy
from mpsconvert.runtime.ops import kernels
from mpsconvert.runtime.ops.fp8_experts import FP8Experts, expert_bytes
from mpsconvert.runtime.ops.fp8linear import PREFILL_BUCKETS, FP8Linear

from . import models
from .fake_mps import CHIP, OnMPS, fake_mps, to_mps


def test_the_fake_device_refuses_what_mps_refuses(monkeypatch):
    """Negative control: without these refusals every test below would pass on any code."""
    with fake_mps(monkeypatch) as mode:
        x = torch.ones(4, device="mps") * 0.5
        assert isinstance(x, OnMPS) and x.device == torch.device("mps") and x.is_mps
        assert type(x.cpu()) is torch.Tensor and x.cpu().double().dtype == torch.float64  # fine once on the CPU
        with pytest.raises(TypeError, match="float64"):
            x.double()
        with pytest.raises(TypeError, match="Float8_e4m3fn to the MPS backend"):
            x.to(torch.float8_e4m3fn)
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(x, 1, generator=torch.Generator().manual_seed(0))
        torch.multinomial(x, 1, generator=torch.Generator(device="mps").manual_seed(0))
    with fake_mps(monkeypatch, fp8=True) as mode:
        a = torch.ones(16, 16, device="mps").to(torch.float8_e4m3fn)
        with pytest.raises(NotImplementedError, match="scaled_mm"):
            torch._scaled_mm(
                a, a.t(), torch.ones((), device="mps"), torch.ones((), device="mps"), out_dtype=torch.bfloat16
            )
        assert len(mode.refused) == 1


# -- the device: what it has, said once, and its name ------------------------------------------------


@pytest.mark.parametrize(
    "fp8_ok,scaled_mm,code_dtype,lacks",
    [
        (False, False, torch.uint8, "no float8_e4m3fn tensors on MPS"),
        (True, False, torch.float8_e4m3fn, "no FP8 matmul on MPS"),
        (True, True, torch.float8_e4m3fn, None),
    ],
)
def test_capabilities_are_probed_once_and_said_once(monkeypatch, fp8_ok, scaled_mm, code_dtype, lacks):
    with fake_mps(monkeypatch, fp8=fp8_ok, scaled_mm=scaled_mm) as mode:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            caps = [devices.capabilities(torch.device("mps")) for _ in range(3)]
        assert caps[0] is caps[1] is caps[2] and len(mode.refused) == (lacks is not None)  # one probe per process
        assert (caps[0].fp8_tensors, caps[0].scaled_mm, caps[0].code_dtype) == (fp8_ok, scaled_mm, code_dtype)
        assert caps[0].name == f"{CHIP} (MPS)"
        said = [str(w.message) for w in caught]
        if lacks is None:
            assert said == [] and caps[0].lacks == ""
        else:
            assert len(said) == 1 and lacks in said[0] and "torch >= 2.15" in said[0] and said[0] == caps[0].lacks


def test_a_policy_on_mps_without_scaled_mm_offers_no_fp8_matmul_and_warns_once(monkeypatch, tmp_path):
    """Without scaled_mm on MPS the policy does not time `scaled_mm_row` on each layer shape: the probe's one
    warning is all, and only the kernels that run are candidates."""
    layers = [
        FP8Linear.from_tensors(*fp8.quantize(torch.randn(n, k), "row")[:2], activations="token")
        for n, k in ((64, 32), (48, 32), (32, 64), (96, 64))
    ]
    model = torch.nn.Sequential(*layers)
    timed = []

    def measure(kernel, layer, m):
        timed.append(kernel)
        return {"dequant": 2.0, "bf16": 3.0}[kernel]  # anything else is a KeyError: a candidate that must not be

    with fake_mps(monkeypatch, fp8=True, scaled_mm=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            decisions = KernelPolicy(torch.device("mps"), measure=measure, cache=False).apply(model)
    buckets = 1 + len(PREFILL_BUCKETS)  # decode, and each prefill bucket
    assert set(timed) == {"dequant", "bf16"} and len(timed) == 2 * buckets * len(layers)
    assert len(caught) == 1 and "no FP8 matmul on MPS" in str(caught[0].message)
    assert {d.choice for d in decisions} == {"dequant"} and all("torch >= 2.15" in d.note for d in decisions)
    assert kernels.candidates("mps", "token", "row", "decode", scaled_mm=False) == ["dequant", "bf16"]
    assert kernels.candidates("mps", "token", "row", "decode") == ["scaled_mm_row", "dequant", "bf16"]


class _Run:
    def __init__(self, returncode=0, stdout=""):
        self.returncode, self.stdout = returncode, stdout


def test_the_mps_device_is_named_for_the_macs_chip(monkeypatch):
    calls = []
    monkeypatch.setattr(devices.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(devices.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or _Run(0, "Apple M4 Pro\n"))
    assert devices.mac_chip() == "Apple M4 Pro" and devices.mps_name() == "Apple M4 Pro (MPS)"
    assert calls == [["sysctl", "-n", "machdep.cpu.brand_string"]] * 2
    for broken in (
        lambda cmd, **kw: _Run(1, ""),
        lambda cmd, **kw: _Run(0, "\x1b[31m"),
        lambda cmd, **kw: (_ for _ in ()).throw(OSError("no sysctl")),
    ):
        monkeypatch.setattr(devices.subprocess, "run", broken)
        with pytest.warns(UserWarning, match="chip could not be read"):
            assert devices.mps_name() == devices.MPS_NAME == "Apple GPU (MPS)"
    monkeypatch.setattr(devices.platform, "system", lambda: "Linux")
    monkeypatch.setattr(devices.subprocess, "run", lambda *a, **kw: pytest.fail("sysctl called off macOS"))
    assert devices.mac_chip() is None


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "ART", "--device", "mps"],
        ["generate", "ART", "hi", "--device", "mps"],
        ["chat", "ART", "--device", "mps"],
    ],
)
def test_device_mps_without_mps_is_one_line_exit_2(text_art, command):
    if devices.mps_available():
        pytest.skip("this machine has MPS")
    from mpsconvert.cli import main

    res = CliRunner().invoke(main, [str(text_art) if c == "ART" else c for c in command], input="")
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert (
        len(lines) == 1 and "--device mps" in lines[0] and "torch >= 2.15" in lines[0] and "Traceback" not in res.output
    )


# -- no float64 on the device -------------------------------------------------------------------------


def test_validate_metrics_on_mps_reduce_in_float64_on_the_cpu(monkeypatch):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(2, 9, 50, generator=g) * 3).to(torch.bfloat16)
    test = (base.float() + torch.randn(2, 9, 50, generator=g) * 0.2).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    want = metrics.CausalLMScores()
    want.update(base, test, ids, mask)
    with fake_mps(monkeypatch):
        got = metrics.CausalLMScores()
        got.update(to_mps(base), to_mps(test), to_mps(ids), to_mps(mask))
        cos = metrics.cosine(to_mps(base[0]), to_mps(test[0]))
    assert got.result() == want.result() and torch.equal(cos, metrics.cosine(base[0], test[0]))
    monkeypatch.setattr(metrics, "_CHUNK_ELEMS", 100)  # two positions per block: the same sums
    chunked = metrics.CausalLMScores()
    chunked.update(base, test, ids, mask)
    assert chunked.result() == pytest.approx(want.result(), rel=1e-12)


@pytest.mark.parametrize("kind", ["percentile", "mse"])
def test_histogram_observers_on_mps(monkeypatch, kind):
    """calibrate --observer percentile|mse on MPS: the counts become float64 only on the CPU."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    want = observers.make(kind)()
    want.update(x)
    with fake_mps(monkeypatch):
        got = observers.make(kind)()
        got.update(to_mps(x))
        assert isinstance(got.counts, OnMPS)  # the histogram is kept on the device
        clip = got.clip()
    assert clip == want.clip() and 0 < clip <= float(x.abs().max())


# -- sampling with the device's generator -------------------------------------------------------------


class _Decoder:
    """A decoder whose logits are on the fake device (a fixed table: token -> next logits)."""

    backend, max_len = "torch", None

    def __init__(self, device):
        self.device = device
        self.table = torch.randn(40, 40, generator=torch.Generator().manual_seed(2)) * 2
        self.put = to_mps if device == "mps" else (lambda t: t)

    def reserve(self, tokens):
        return None

    def reset(self):
        pass

    def prefill(self, ids):
        return self.put(self.table[ids[-1]])

    def step(self, token):
        return self.put(self.table[token])

    def sync(self):
        pass


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampling_on_mps_draws_with_a_generator_on_the_device(monkeypatch, top_p):
    """`--temp > 0` on MPS (and CUDA) failed: a CPU generator for device probabilities. The seed
    still decides the tokens (the fake's MPS generator is a CPU one: the very same draws)."""
    sampling = generate.Sampling(max_tokens=12, temp=1.3, top_p=top_p, seed=7)
    want = generate.generate_ids(_Decoder("cpu"), [1, 2], sampling).tokens
    with fake_mps(monkeypatch) as mode:
        got = generate.generate_ids(_Decoder("mps"), [1, 2], sampling).tokens
        again = generate.generate_ids(_Decoder("mps"), [1, 2], sampling).tokens
        other = generate.generate_ids(
            _Decoder("mps"), [1, 2], generate.Sampling(max_tokens=12, temp=1.3, top_p=top_p, seed=8)
        ).tokens
    assert got == again == want and other != got and len(mode.generators) == 3 and not mode.refused


# -- FP8 on MPS without float8: bytes, decoded bit by bit -----------------------------------------------


def test_codes_as_bytes_decode_and_round_exactly(monkeypatch):
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # no NaN codes
    want = every.view(torch.float8_e4m3fn).float()
    assert torch.equal(fp8.fp8_to_float(every), want) and torch.equal(
        fp8.fp8_to_float(every.view(torch.float8_e4m3fn)), want
    )
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 7
    scale = fp8.per_token_scale(x)
    with fake_mps(monkeypatch) as mode:
        assert torch.equal(fp8.fp8_to_float(to_mps(every)).cpu(), want)  # bytes on the device: no float8 op
        got = fp8.fake_quantize(to_mps(x), to_mps(scale)).cpu()
        assert fp8.codes_to(every.view(torch.float8_e4m3fn), "mps").dtype == torch.uint8
    assert torch.equal(got, fp8.fake_quantize(x, scale)) and mode.refused == [
        mode.refused[0]
    ]  # only the probe's float8 was refused


def test_round_to_e4m3_is_the_cast_bit_for_bit():
    grid = fp8.fp8_to_float(torch.arange(256, dtype=torch.uint8))
    grid = grid[~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2  # ties: to even
    step = lambda t, d: torch.nextafter(t, torch.full_like(t, d))  # noqa: E731 - one float32 step either side
    g = torch.Generator().manual_seed(4)
    v = torch.cat(
        [
            grid,
            mids,
            step(mids, 1e9),
            step(mids, -1e9),
            step(grid, 1e9),
            step(grid, -1e9),
            torch.randn(1 << 18, generator=g) * 60,
            (torch.rand(1 << 18, generator=g) - 0.5) * 0.04,
            torch.tensor([0.0, -0.0, 448.0, -448.0]),
        ]
    ).clamp(-448, 448)
    want = v.to(torch.float8_e4m3fn).float()
    assert torch.equal(fp8.round_to_e4m3(v).view(torch.int32), want.view(torch.int32))  # signs of zero included


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """Weight-only artifacts of a tiny Llama and a tiny Mixtral (no activation rounding: the MPS
    dequantizing kernel and the CPU's dense one then compute the same numbers)."""
    from mpsconvert.format.schemes import Scheme

    work = tmp_path_factory.mktemp("mps")
    only = Scheme.make("fp8-weight-only")
    return {
        "llama": models.tiny_artifact(work, "llama", lambda p: models.tiny("llama", p, dtype=torch.bfloat16), only),
        "mixtral": models.tiny_artifact(
            work, "mixtral", lambda p: models.tiny("mixtral", p, dtype=torch.bfloat16, widen=0.08, vocab=128), only
        ),
    }


@pytest.fixture(scope="module")
def text_art(tmp_path_factory, text_data):
    """A tiny Llama artifact with a tokenizer (generate, chat, validate)."""
    return models.tiny_artifact(
        tmp_path_factory.mktemp("mps-text"),
        "llama",
        lambda p: models.tiny("llama", p, tokenizer="bpe", dtype=torch.bfloat16, tie=False),
    )


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_load_on_mps_with_torch_2_15_holds_float8_and_computes_what_cpu_computes(monkeypatch, arts, arch):
    """torch 2.15 on MPS: the e4m3 codes are float8 tensors on the device, the policy measures the
    kernels MPS has (weight-only: dequantize per call or a BF16 copy), MoE experts run F.grouped_mm
    on the device (2.15's native one; 2.13 has none: a loop over the experts), nothing is refused,
    and the logits are the CPU's."""
    cpu = mpsconvert.load(arts[arch], device="cpu", dtype=torch.bfloat16)
    ids = torch.randint(0, cpu.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = cpu(ids).logits
    paths = {}
    for profile in ("2.15", "2.13"):
        with fake_mps(monkeypatch, profile=profile) as mode:
            model = mpsconvert.load(
                arts[arch], device="mps", kernel_cache=False, measure=lambda k, l, m: {"dequant": 1.0, "bf16": 2.0}[k]
            )
            with torch.no_grad():
                got = model(to_mps(ids)).logits.cpu()
        paths[profile] = {e.path for e in model.modules() if isinstance(e, FP8Experts)}
        assert torch.equal(got, want), profile
        if profile == "2.15":
            info = model.mpsconvert
            assert mode.refused == [] and info.weights_held["code_dtype"] == "float8_e4m3fn"
            layers = [m for m in model.modules() if isinstance(m, FP8Linear) and m.group is None]
            assert layers and all(m.weight.dtype == torch.float8_e4m3fn and isinstance(m.weight, OnMPS) for m in layers)
            assert {d["choice"] for d in info.kernels} == {"dequant"} and not any(
                "torch >= 2.15" in d["note"] for d in info.kernels
            )
    assert paths == (
        {"2.15": {"grouped_mm"}, "2.13": {"loop"}} if arch == "mixtral" else {"2.15": set(), "2.13": set()}
    )


def test_the_2_15_profile_offers_fp8_matmul_but_no_block_scaling(monkeypatch):
    import torch.nn.functional as F

    with fake_mps(monkeypatch, profile="2.15") as mode:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            caps = devices.capabilities(torch.device("mps"))
        assert (caps.fp8_tensors, caps.scaled_mm, caps.lacks) == (True, True, "") and not caught and not mode.refused
        a = torch.ones(16, 16, device="mps").to(torch.float8_e4m3fn)
        one = torch.ones((), device="mps")
        y = F.scaled_mm(
            a, a.t(), one, F.ScalingType.TensorWise, one, F.ScalingType.TensorWise, output_dtype=torch.bfloat16
        )
        assert isinstance(y, OnMPS) and bool((y.float() == 16).all())
        with pytest.raises(NotImplementedError, match="TensorWise and RowWise"):
            F.scaled_mm(
                a,
                a.t(),
                one,
                F.ScalingType.BlockWise1x128,
                one,
                F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16,
            )


def test_a_policy_on_2_15_mps_measures_scaled_mm_against_bf16_per_bucket(monkeypatch):
    """With FP8 matmul on MPS (torch 2.15) the policy times `F.scaled_mm` against dequantizing and
    BF16 in each token bucket and keeps what measured fastest there (BF16 alone only where it won
    every bucket: a second copy of the weight for some buckets would double its memory)."""
    layer = FP8Linear.from_tensors(*fp8.quantize(torch.randn(64, 32), "row")[:2], activations="token")
    block = FP8Linear.from_tensors(*fp8.quantize(torch.randn(256, 256), "block")[:2], activations="group", block=128)

    def measure(kernel, layer, m):  # the GEMV wins at decode, dequantize + BF16 matmul at prefill
        return {"scaled_mm_row": 1.0 if m == 1 else 9.0, "dequant": 3.0, "bf16": 2.0 if m == 1 else 4.0}[kernel]

    with fake_mps(monkeypatch, profile="2.15"):
        decisions = KernelPolicy(torch.device("mps"), measure=measure, cache=False).apply(
            torch.nn.Sequential(layer, block)
        )
    row = [d for d in decisions if d.weights == "row"]
    assert row[0].bucket == "decode" and row[0].m == 1 and row[0].choice == "scaled_mm_row"
    assert {d.choice for d in row[1:]} == {"dequant"} and set(row[0].timings_us) == {"scaled_mm_row", "dequant", "bf16"}
    blocks = [
        d for d in decisions if d.weights == "block128"
    ]  # no block-wise scaled_mm on MPS: which path runs is said
    assert blocks and all(set(d.timings_us) == {"dequant", "bf16"} for d in blocks)
    assert all("no block-scaled FP8 kernel on mps" in d.note for d in blocks)


@pytest.mark.parametrize("profile", ["2.13", "2.15"])
def test_an_out_of_memory_on_mps_names_the_watermark(monkeypatch, profile):
    emptied = []
    with fake_mps(monkeypatch, profile=profile):
        monkeypatch.setattr(torch.mps, "empty_cache", lambda: emptied.append(1))
        devices.empty_cache(torch.device("mps"))  # between phases: the device's own cache call
        assert emptied == [1]
        with pytest.raises(mpsconvert.DeviceError, match="PYTORCH_MPS_HIGH_WATERMARK_RATIO"):
            with devices.oom_hint(torch.device("mps"), "calibration"):
                raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)")


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_load_on_mps_without_float8_holds_bytes_and_computes_what_cpu_computes(monkeypatch, arts, arch):
    cpu = mpsconvert.load(arts[arch], device="cpu", dtype=torch.bfloat16)
    ids = torch.randint(0, cpu.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = cpu(ids).logits
    with fake_mps(monkeypatch) as mode:
        model = mpsconvert.load(
            arts[arch], device="mps", kernel_cache=False, measure=lambda k, l, m: {"dequant": 1.0, "bf16": 2.0}[k]
        )
        info = model.mpsconvert
        with torch.no_grad():
            got = model(to_mps(ids)).logits.cpu()
    probes = [
        r for r in mode.refused if "grouped_mm" not in r
    ]  # 2.13 has no MPS grouped matmul: its probe is refused too
    assert probes == [mode.refused[0]] and "Float8" in mode.refused[0]  # the probe's float8, and nothing after it
    assert info.device == "mps" and info.weights_held["code_dtype"] == "uint8"
    layers = [m for m in model.modules() if isinstance(m, FP8Linear) and m.group is None]
    assert layers and all(
        m.weight.dtype == torch.uint8 and isinstance(m.weight, OnMPS) and m.dense_weight is None for m in layers
    )
    assert {d["choice"] for d in info.kernels} == {"dequant"} and all(
        "torch >= 2.15" in d["note"] for d in info.kernels
    )
    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    if arch == "mixtral":  # one copy: the dense weights, not codes beside them
        assert experts and all(
            e.gate_up_codes is None and e.down_codes is None and e.gate_up_dense is not None for e in experts
        )
        assert all(r["weights"] == "bfloat16 (dequantized at load)" for r in info.experts.values())
        assert all(expert_bytes(e) < 1.1 * 2 * (e.gate_up_dense.numel() + e.down_dense.numel()) for e in experts)
    assert torch.equal(got, want)


@pytest.mark.parametrize("profile", ["2.13", "2.15"])
def test_generate_and_validate_on_mps(monkeypatch, tmp_path, text_art, profile):
    """The user's commands on a Mac with torch 2.13 and 2.15, end to end: sampling, and validate's
    accuracy (float64 metrics) and latency, recorded under the chip's name. On 2.15 nothing is
    refused (float8 and F.scaled_mm exist); on 2.13 only the capability probe's float8."""
    art = text_art
    monkeypatch.setenv("MPSCONVERT_CACHE_DIR", str(tmp_path / "cache"))
    with fake_mps(monkeypatch, profile=profile) as mode:
        res = mpsconvert.generate(art, "The river", device="mps", temp=1.0, seed=3, max_tokens=6, use_template=False)
        val = mpsconvert.validate(
            art,
            options=mpsconvert.validate_options(
                device="mps", seq_len=32, max_samples=2, prefill_len=16, decode_tokens=3, repeats=1, warmup=1, rounds=1
            ),
        )
    assert res.stats.device == "mps" and len(res.stats.tokens) == 6 and len(mode.refused) == (profile == "2.13")
    assert val.device_name == f"{CHIP} (MPS)" and val.accuracy["tokens"] == 62 and 0 <= val.accuracy["mean_kl"] < 0.1
    import json

    assert f"{CHIP} (MPS) (mps)" in json.loads((art / "mpsconvert.json").read_text())["validation"]


# -- CPU: how the weights are held is said ------------------------------------------------------------


def test_cpu_load_says_the_weights_are_dequantized(arts):
    info = mpsconvert.load(arts["mixtral"], device="cpu").mpsconvert
    held = info.weights_held
    assert (
        held["e4m3"] == 0
        and held["dequantized"] > 0
        and "no faster" in held["note"]
        and "as much memory" in held["note"]
    )
    assert all(r["weights"] == "bfloat16 (dequantized at load)" for r in info.experts.values())


# -- every MPS branch of src/ ran under a profile (keep this test last in the file) ---------------------


def test_every_mps_branch_in_src_ran_under_a_profile(request):
    """Each comparison with "mps" in src/mpsconvert (found by reading the source: a new one joins the
    list by itself) ran in this module's tests under the fake device's 2.13 or 2.15 profile."""
    from .fake_mps import BRANCHES, HIT

    if request.config.option.keyword or any("::" in a for a in request.config.args):
        pytest.skip("needs the whole module: the branches are recorded by the tests above")
    assert BRANCHES, "no MPS branch found in src/: the scan is broken"
    missed = sorted(
        f"{f.split('mpsconvert/', 1)[1]}:{line}"
        for f, lines in BRANCHES.items()
        for line in lines
        if not HIT.get((f, line))
    )
    assert not missed, f"MPS branches no test ran under a fake-MPS profile: {missed}"
    assert set().union(*HIT.values()) == {"2.13", "2.15"}
