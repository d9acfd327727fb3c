"""A model's definition without its weights: the one place that turns config.json into a module.

Conversion plans from it (which Linears exist, with which shapes), the runtime and sequential
calibration fill it with tensors read from safetensors. Building on the meta device costs no
memory and runs no random initialisation at any model size. Two forms:

- `buffers="meta"`: everything on meta (planning only reads structure);
- `buffers="real"`: parameters on meta, buffers real, because rotary tables and position ids
  are computed in `__init__` and are not in checkpoints, so a loader must keep them.

Only transformers' own architectures are built unless `trust_remote_code` is given.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .errors import SourceError


def model_class(config):
    """The transformers class for a config: its `architectures` entry, else the causal-LM auto
    class where the model type has one (so an lm_head, which loaders build for generation, is
    planned and kept, never left expecting scales), else AutoModel."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def load_config(path, trust_remote_code: bool = False):
    """transformers' config of the model in `path`, with remote code refused unless allowed."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "trust_remote_code" in msg or "custom code" in msg:
            raise SourceError(
                "this model's architecture is defined by code inside the repo",
                "review that code, then pass --trust-remote-code to allow running it",
            ) from e
        raise SourceError(f"transformers cannot read config.json: {msg}", "upgrade transformers or check the model") from e
    except Exception as e:  # a config.json of the wrong shape (transformers' dataclass validation, TypeError, ...)
        raise SourceError(f"transformers cannot read config.json: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                          "fix config.json or re-create the model folder") from e
    archs = getattr(config, "architectures", None)
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise SourceError(f"config.json: architectures is {str(archs)[:60]!r}, not a list of class names", "fix config.json")
    return config


@contextlib.contextmanager
def _params_on_meta():
    """Parameters registered inside go to the meta device (keeping their Parameter type); buffers
    stay where they are made."""
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


# How many layers and experts a config may ask for: building costs time per module even on the
# meta device (1024 Llama layers: 0.3 s; a config saying 10^7 kept quantize busy for minutes).
# The largest public models have ~130 layers and 384 experts.
MAX_COUNTS = {"layers": 1024, "experts": 4096}
_COUNT_KEYS = {"layers": ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers",
                          "encoder_layers"),
               "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")}


def check_counts(config) -> None:
    """Refuse a config whose layer or expert counts (its own or a sub-config's: text_config, ...)
    exceed MAX_COUNTS, before anything is built."""
    body = config.to_dict() if hasattr(config, "to_dict") else config
    todo = [("config.json", body)]
    while todo:
        where, d = todo.pop()
        for kind, keys in _COUNT_KEYS.items():
            for key in keys:
                v = d.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= MAX_COUNTS[kind]:
                    raise SourceError(f"{where}: {key} is {v}, outside 0..{MAX_COUNTS[kind]} {kind}",
                                      "fix config.json (is it the model's own?)")
        todo += [(f"{where} {k}", v) for k, v in d.items() if isinstance(v, dict) and k.endswith("config")]


def build(config, *, buffers: str = "meta", trust_remote_code: bool = False):
    """The model of `config` with no weights: `buffers="meta"` puts everything on meta,
    `buffers="real"` keeps buffers (rotary tables, position ids) real. Raises SourceError when
    transformers cannot build the architecture, or the config asks for more layers or experts
    than any model has (check_counts)."""
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
                f"transformers could not build {cls.__name__} for this config: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "upgrade transformers, or pass --trust-remote-code if the repo defines its own model",
            ) from e


def build_from(path, *, buffers: str = "meta", trust_remote_code: bool = False):
    """(config, weightless model) of the model folder `path`."""
    config = load_config(path, trust_remote_code)
    return config, build(config, buffers=buffers, trust_remote_code=trust_remote_code)
