"""A model's definition without its weights: the one place that turns config.json into a module.

Conversion plans from it (which Linears exist, with which shapes), the runtime and sequential
calibration fill it with tensors read from safetensors. Building on the meta device costs no
memory and runs no random initialisation at any model size. Two forms:

- `buffers="meta"`: everything on meta (planning only reads structure);
- `buffers="real"`: parameters on meta, buffers real, because rotary tables and position ids
  are computed in `__init__` and are not in checkpoints, so a loader must keep them.

Only transformers' own architectures are built unless `trust_remote_code` is given. It also
answers what kind of model a config describes (`is_causal_lm`), for every part that asks.

Importing it loads neither torch nor transformers (the model card asks `is_causal_lm` without them).
"""

from __future__ import annotations

import contextlib
import warnings

from ..errors import SourceError
from ..infra.untrusted import check_model_config, read_json

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # transformers' text-generation heads (GPT-2's is GPT2LMHeadModel)


def is_causal_lm(config) -> bool:
    """Whether the model generates text (input_ids -> next-token logits): one of its
    `architectures` is a transformers causal-LM head (`*ForCausalLM`, or `*LMHeadModel` as GPT-2
    names it). `config`: transformers' config object, or config.json as a dict. The one rule for
    generate and chat, validate's metrics, the model card's loading code and the Apple export."""
    archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return any(str(a).endswith(CAUSAL_LM_SUFFIXES) for a in archs or [])


def model_class(config):
    """The transformers class for a config: its `architectures` entry, else the causal-LM auto
    class where the model type has one (so an lm_head, which loaders build for generation, is
    planned and kept, never left expecting scales), else AutoModel."""
    import transformers

    from . import hf_compat

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if hf_compat.has_causal_lm_class(getattr(config, "model_type", None)):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def load_config(path, trust_remote_code: bool = False):
    """transformers' config of the model in `path`, with remote code refused unless allowed."""
    from pathlib import Path

    import transformers

    cfg = Path(path) / "config.json" if Path(path).is_dir() else None
    if cfg is not None and (
        cfg.exists() or cfg.is_symlink()
    ):  # read by us first: bounded, each key once, no NaN, a regular file
        fix = "fix config.json or re-create the model folder"
        check_model_config(read_json(cfg, what=str(cfg), error=SourceError, fix=fix), what=str(cfg), error=SourceError)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "trust_remote_code" in msg or "custom code" in msg:
            raise SourceError(
                "this model's architecture is defined by code inside the repo",
                "review that code, then pass `trust_remote_code` to allow running it",
            ) from e
        raise SourceError(
            f"transformers cannot read config.json: {msg}", "upgrade transformers or check the model"
        ) from e
    except Exception as e:  # a config.json of the wrong shape (transformers' dataclass validation, TypeError, ...)
        raise SourceError(
            f"transformers cannot read config.json: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}",
            "fix config.json or re-create the model folder",
        ) from e
    check_counts(config)
    archs = getattr(config, "architectures", None)
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise SourceError(
            f"config.json: architectures is {str(archs)[:60]!r}, not a list of class names", "fix config.json"
        )
    return config


@contextlib.contextmanager
def _params_on_meta():
    """Parameters registered inside go to the meta device (keeping their Parameter type); buffers
    stay where they are made."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def check_counts(config) -> None:
    """Refuse a config (transformers' object or its dict) whose sizes exceed untrusted.LIMITS
    (layers, experts, hidden size, vocabulary, ...) or whose values make the model compute garbage
    (untrusted.check_model_config), its sub-configs included, before anything is built."""
    body = config.to_dict() if hasattr(config, "to_dict") else config
    check_model_config(body, error=SourceError)


def build(config, *, buffers: str = "meta", trust_remote_code: bool = False):
    """The model of `config` with no weights: `buffers="meta"` puts everything on meta,
    `buffers="real"` keeps buffers (rotary tables, position ids) real. Raises SourceError when
    transformers cannot build the architecture, or the config asks for more layers or experts
    than any model has (check_counts)."""
    import torch

    check_counts(config)
    cls = model_class(config)
    placement = torch.device("meta") if buffers == "meta" else _params_on_meta()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with placement:
                if cls.__name__.startswith("Auto"):
                    return cls.from_config(config, trust_remote_code=trust_remote_code)
                return cls(config)
        except Exception as e:  # an architecture transformers cannot build is a user-facing problem
            raise SourceError(
                f"transformers could not build {cls.__name__} for this config: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}",
                "upgrade transformers, or pass `trust_remote_code` if the repo defines its own model",
            ) from e


def build_from(path, *, buffers: str = "meta", trust_remote_code: bool = False):
    """(config, weightless model) of the model folder `path`."""
    config = load_config(path, trust_remote_code)
    return config, build(config, buffers=buffers, trust_remote_code=trust_remote_code)
