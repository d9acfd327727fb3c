"""runtime/patches: one protocol, one registry, one report shape, fallbacks warned once, and
transformers' private names reached only through model/hf_compat.py. Every patch is installed
on tiny Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen2-MoE models and what each left is
asserted: on CPU the patches that apply there (positions), and the CUDA patches through the
Triton interpreter on a model whose context says CUDA (the device faked: the installs act on the
model's own CPU tensors). Marked `core`: CI's floor lane runs it on the oldest transformers
pyproject allows."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

from mpsconvert.model import hf_compat
from mpsconvert.runtime import patches

from .models import MOE_ARCHS, tiny_model, tiny_moe_model

pytestmark = pytest.mark.core

SRC = Path(__file__).resolve().parents[1] / "src" / "mpsconvert"
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe")


def _tiny(arch, seed=0):
    """The tiny BF16 model of `arch` (tests/models.py's builder), without grad."""
    if arch in MOE_ARCHS:
        return tiny_moe_model(arch, seed).requires_grad_(False)
    return tiny_model(arch, vocab=128, seed=seed, dtype=torch.bfloat16).requires_grad_(False)


def _private_uses(path: Path) -> list[str]:
    """What `path` touches of transformers' private surface: imports from its submodules, and
    the private names hf_compat knows (as attributes, names or getattr strings)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("transformers."):
            out.append(f"{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith("transformers.")]
        elif isinstance(node, ast.Attribute) and node.attr in hf_compat.PRIVATE:
            out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in hf_compat.PRIVATE:
            out.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in hf_compat.PRIVATE:
            out.append(f"{node.lineno}: {node.value!r}")
    return out


def test_only_hf_compat_touches_transformers_private_names():
    home = SRC / "model" / "hf_compat.py"
    bad = {p.relative_to(SRC).as_posix(): u for p in sorted(SRC.rglob("*.py")) if p != home and (u := _private_uses(p))}
    assert not bad, f"only model/hf_compat.py may touch transformers' private names: {bad}"
    assert _private_uses(home), "hf_compat.py touches no private name any more: update this test"


def test_the_private_name_scan_sees_a_use(tmp_path):
    """Negative control for the scan above."""
    f = tmp_path / "m.py"
    f.write_text(
        "import transformers.masking_utils as m\nfrom transformers.integrations import x\n"
        "def f(model):\n    '''_attn_implementation in a docstring is fine'''\n"
        "    return model.config._attn_implementation, getattr(model, '_can_set_attn_implementation')\n"
    )
    assert [u.split(":")[0] for u in _private_uses(f)] == ["1", "2", "5", "5"]


def test_registry_order_and_one_report_shape():
    assert [p.name for p in patches.REGISTRY] == [
        "shared_inputs",
        "attention",
        "routing",
        "eager_fusion",
        "prefill_graphs",
        "positions",
        "lm_head",
        "generate",
    ]
    assert [p.phase for p in patches.REGISTRY] == ["modules"] * 3 + ["forwards"] * 5
    model = _tiny("llama")
    ctx = patches.Context(torch.device("cpu"), torch.bfloat16)
    reports = patches.apply(model, ctx, "modules") | patches.apply(model, ctx, "forwards")
    assert set(reports) == {p.name for p in patches.REGISTRY}
    for r in reports.values():
        assert set(r.as_dict()) <= {"patch", "applied", "installed", "left", "skipped", "details"}
    assert reports["shared_inputs"].skipped.startswith("CPU")
    for name in ("attention", "eager_fusion", "prefill_graphs"):
        assert reports[name].skipped == "runs on CUDA only (this model is on cpu)"
    assert reports["generate"].skipped.startswith("mpsconvert's engine takes generate() on CUDA only")
    assert reports["routing"].skipped.startswith("no softmax top-k router")
    assert reports["positions"].applied and reports["positions"].left == []
    off = patches.apply(
        _tiny("llama"), patches.Context(torch.device("cpu"), torch.bfloat16, {"eager_fusion": False}), "forwards"
    )
    assert off["positions"].skipped == off["lm_head"].skipped == "turned off (eager_fusion=False)"
    assert off["prefill_graphs"].skipped == "eager_fusion is off: no direct prefill calls to record"


def test_load_asks_for_the_prefill_graphs_by_default_and_false_turns_them_off(llama_art):
    """The prefill graphs are load()'s default (measured faster, docs/benchmarks.md): on CPU the
    patch is skipped for the device only, and `prefill_graphs=False` is what turns it off."""
    import inspect

    from mpsconvert import api
    from mpsconvert.runtime.load import loader

    assert inspect.signature(loader.load).parameters["prefill_graphs"].default is True
    default = api.load(llama_art, device="cpu").mpsconvert.patches["prefill_graphs"]
    off = api.load(llama_art, device="cpu", prefill_graphs=False).mpsconvert.patches["prefill_graphs"]
    assert default["skipped"] == "runs on CUDA only (this model is on cpu)", default
    assert off["skipped"] == "turned off (prefill_graphs=False)", off


@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_patches_install_on_every_architecture_and_keep_the_output(arch):
    """On CPU only `positions` and `lm_head` apply (the latter where this torch needs it): installed on all six, nothing
    left, logits and greedy tokens bit for bit the model's own (with and without a cache)."""
    model = _tiny(arch)
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        want_gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    ctx = patches.Context(torch.device("cpu"), torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = patches.apply(model, ctx, "modules") | patches.apply(model, ctx, "forwards")
        patches.check(model, ctx, reports)
    installed = {n: r.installed for n, r in reports.items() if r.applied}
    from mpsconvert.runtime.patches import lm_head

    head = (
        {"lm_head": 1} if lm_head.copies_weight(torch.device("cpu"), model.dtype) else {}
    )  # only where this torch copies
    assert installed == {"positions": 1} | head, {n: r.as_dict() for n, r in reports.items()}
    assert all(not r.left for r in reports.values())
    assert not [w for w in caught if issubclass(w.category, patches.PatchFallback)]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want_gen)


def _aten_ops(fn) -> list[tuple[str, list]]:
    """(op, the shapes of its tensor arguments) of every aten op `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def _head_weight_copies(model, fn) -> list[str]:
    """The batched products over the output head's expanded weight that `fn` dispatches (the path
    whose CPU kernel copies the whole weight)."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    return [op for op, shapes in _aten_ops(fn) if op == "bmm" and any(s[-2:] == (hidden, vocab) for s in shapes)]


def test_the_head_probe_says_what_this_torch_dispatches():
    """`lm_head.copies_weight` (the patch's probe, a small product) agrees with what the whole
    model's head dispatches for `model(ids, logits_to_keep=1)` on this torch: a batched product
    over the copied weight up to torch 2.14, one matrix product from 2.15."""
    from mpsconvert.runtime.patches import lm_head

    model = _tiny("llama")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        copies = bool(_head_weight_copies(model, lambda: model(ids[:1], logits_to_keep=1)))
    assert lm_head.copies_weight(torch.device("cpu"), model.dtype) is copies
    assert (lm_head.not_needed(model) is None) is copies


@pytest.mark.parametrize("needed", [True, False], ids=["torch-copies", "torch-folds"])
def test_the_output_head_patch_is_installed_only_where_torch_needs_it(monkeypatch, needed):
    """Both arms of the probe, on whatever torch runs the test (the probe's answer is set; the test
    above checks it against the real one). Needed: installed, the kept tokens' logits are the full
    forward's, and no batched product over the weight is left. Not needed: left out with the reason,
    the model's own head runs and gives the same logits."""
    from mpsconvert.runtime.patches import lm_head

    model = _tiny("llama")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(lm_head, "_COPIES", {("cpu", model.dtype): needed})
    ctx = patches.Context(torch.device("cpu"), torch.bfloat16)
    with torch.no_grad():
        full = model(ids).logits
        report = patches.apply(model, ctx, "forwards")["lm_head"]
        assert lm_head.installed(model) is needed and report.applied is needed, report.as_dict()
        if not needed:
            assert report.skipped.startswith(
                f"torch {torch.__version__} computes the kept tokens' logits as one matrix product"
            )
        for rows in (ids[:1], ids):
            kept = model(rows, logits_to_keep=1).logits
            assert kept.shape == (rows.shape[0], 1, full.shape[-1])
            assert torch.allclose(kept.float(), full[: rows.shape[0], -1:].float(), atol=1e-2, rtol=1e-2)
            if needed:
                assert _head_weight_copies(model, lambda: model(rows, logits_to_keep=1)) == []
        assert torch.equal(model(ids).logits, full)  # every token: the product it always was


def test_no_patch_is_installed_where_its_probe_says_torch_does_not_need_it(llama_art):
    """Every patch that works around a torch limitation (it has `not_needed`) is, in a model that
    load() returns, installed only where its probe says this torch needs it; else its report says why."""
    from mpsconvert import api

    model = api.load(llama_art, device="cpu")
    probed = [p for p in patches.REGISTRY if hasattr(p, "not_needed")]
    assert probed, "no patch carries a probe: update this test"
    ctx = patches.Context(torch.device("cpu"), torch.bfloat16)
    for patch in probed:
        report = model.mpsconvert.patches[patch.name]
        why = patch.not_needed(model, ctx)
        if why is None:
            assert report["installed"], (patch.name, report)
        else:
            assert not report["installed"] and report["skipped"] == why, (patch.name, report)


def test_a_failing_install_never_raises_and_is_warned_once():
    class Broken:
        name, phase, option = "broken", "forwards", None

        def match(self, model, ctx):
            return None

        def install(self, model, ctx):
            raise KeyError("a transformers name that moved")

        def check(self, model, ctx, report):
            return []

    model = _tiny("llama")
    ids = torch.arange(5)[None]
    with torch.no_grad():
        want = model(ids).logits
    ctx = patches.Context(torch.device("cpu"), torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            r = patches.apply(model, ctx, "forwards", registry=(Broken(),))["broken"]
    assert (
        not r.applied
        and r.skipped.startswith("install failed (KeyError")
        and r.left == ["the model: install failed (KeyError)"]
    )
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, patches.PatchFallback)]
    assert fallbacks == [
        "mpsconvert patch 'broken' left the model with transformers' own code: install failed (KeyError)"
    ]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_left_modules_are_grouped_by_reason_in_one_warning():
    r = patches.Report(
        "demo", installed=1, left=[f"model.layers.{i}.mlp: not a gated MLP" for i in range(5)] + ["model.norm: other"]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.warn_left(r)
        patches.warn_left(r)  # a second load of the same model: nothing new
    assert [str(w.message) for w in caught] == [
        "mpsconvert patch 'demo' left model.layers.0.mlp, model.layers.1.mlp, model.layers.2.mlp and 2 more with "
        "transformers' own code: not a gated MLP",
        "mpsconvert patch 'demo' left model.norm with transformers' own code: other",
    ]


def test_decode_attention_accepts_only_arguments_it_may_ignore():
    from mpsconvert.runtime.patches import attention

    assert attention.accepts(
        {"position_ids": torch.arange(3), "sliding_window": 4096, "softcap": None, "output_attentions": False}
    )
    assert not attention.accepts({"softcap": 30.0})
    assert not attention.accepts({"a_future_argument": torch.zeros(1)})  # unknown: SDPA runs it


def test_hf_compat_answers_without_raising_where_a_name_is_gone(monkeypatch):
    import transformers.masking_utils as masking

    monkeypatch.delattr(masking, "find_packed_sequence_indices")
    assert hf_compat.packed_sequence_check() is None
    model = _tiny("llama")
    reports = patches.apply(model, patches.Context(torch.device("cpu"), torch.bfloat16), "forwards")
    assert not reports["positions"].applied
    assert reports["positions"].left == [
        "the model: transformers has no packed-sequence check by that name (hf_compat)"
    ]


@pytest.mark.slow  # every architecture through the Triton interpreter: 19 min of the suite on 2 cores
@pytest.mark.triton("interpret")
def test_cuda_patches_install_on_every_architecture_interpreted():
    """The CUDA patches (shared inputs, decode attention, MoE routing, eager fusion, positions)
    through the Triton interpreter: what each installs and leaves per architecture, and the
    logits of a prefill and of decode steps over a cache equal the model's own."""
    import copy

    from transformers import DynamicCache

    from mpsconvert.model.hf_compat import cache_kwarg

    from .models import fp8_layers

    ctx = patches.Context(torch.device("cuda"), torch.bfloat16)  # the device faked: only the patches' match reads it
    seen = {}
    for arch in ARCHS:
        model = fp8_layers(_tiny(arch))
        model.config._attn_implementation = "sdpa"
        ref = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reports = patches.apply(model, ctx, "modules")
            for g in model.modules():  # gate/up decode by the GEMVs that have a gated form (W8A8 or BF16 activations)
                if type(g).__name__ == "SharedInput":
                    gated = g.names == ["gate_proj", "up_proj"]
                    g.inner.set_kernels(
                        ("gemv_w8a8" if arch in ("llama", "qwen2") else "gemv") if gated else "scaled_mm_row",
                        "scaled_mm_row",
                    )
            reports |= patches.apply(model, ctx, "forwards")
            patches.check(model, ctx, reports)
        seen[arch] = {
            n: (r.installed, sorted({e.partition(": ")[2] for e in r.left}), r.skipped) for n, r in reports.items()
        }
        dense_mlps = sum(type(m).__name__.endswith("MLP") and hasattr(m, "gate_proj") for m in model.modules())
        assert reports["eager_fusion"].details["mlps_gated_decode"] == dense_mlps, (
            arch,
            reports["eager_fusion"].details,
        )
        ids = torch.randint(
            0, 128, (1, 20), generator=torch.Generator().manual_seed(1)
        )  # longer than the routing kernel takes: a prefill all exact
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits), arch
            caches = [DynamicCache(config=m.config) for m in (model, ref)]
            outs = [m(ids, **cache_kwarg(m, c), use_cache=True).logits for m, c in zip((model, ref), caches)]
            for t in range(3):
                tok = outs[1][:, -1:].argmax(-1)
                outs = [m(tok, **cache_kwarg(m, c), use_cache=True).logits for m, c in zip((model, ref), caches)]
                err = float((outs[0].float() - outs[1].float()).abs().max() / outs[1].float().abs().max())
                assert err < 0.05, (arch, t, err)  # decode kernels (attention, routing) round in other orders
    for arch, r in seen.items():
        moe = arch in MOE_ARCHS
        assert r["shared_inputs"][0] == (2 if arch == "mixtral" else 4), (
            arch,
            r,
        )  # q/k/v per layer, gate/up of dense (and shared-expert) MLPs
        assert r["attention"][:2] == (1, []), (arch, r)
        assert r["routing"][0] == (2 if moe else 0) and r["routing"][1] == [], (arch, r)
        assert r["positions"][:2] == (1, []), (arch, r)
        assert r["prefill_graphs"][2] == "the model's weights are not on a CUDA device (CUDA graphs)", (
            arch,
            r,
        )  # tests/test_prefill_graphs.py
        fused, left, _ = r["eager_fusion"]
        assert fused > 0, (arch, r)
        if arch == "qwen3":  # q/k norms inside its attention: its prefill keeps the attention module's forward
            assert left and all("prefill runs the module's forward" in why for why in left), (arch, r)
        else:
            assert left == [], (arch, r)
