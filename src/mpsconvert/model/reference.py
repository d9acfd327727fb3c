"""The float reference model: the one place that asks transformers for a model with real weights
to compare with or to observe.

- Calibration observes the source snapshot in its own dtype (`load`, the class its config names).
- validate compares the FP8 artifact with the BF16 baseline snapshot (`load`, by task: a causal
  LM with its head, an encoder as its base model, whose hidden states are the embeddings).
- The Apple targets build the artifact's architecture in fp32 (`build`, by task) and fill it with
  the artifact's dequantized weights themselves.

Two paths stay apart on purpose: the weightless model of `definition.build` (meta device, for the
plan, the runtime's loader and sequential calibration), and a GGUF source (convert/gguf.py), which
transformers dequantizes from one file rather than loading a snapshot folder.

Importing it loads neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

from . import definition

TASKS = ("causal-lm", "encoder")


def model_class(config=None, task: str | None = None):
    """The transformers class of the reference: `task` "causal-lm" -> AutoModelForCausalLM,
    "encoder" -> AutoModel (the base model, no head); no task -> the class `config` names
    (`definition.model_class`)."""
    import transformers

    if task == "causal-lm":
        return transformers.AutoModelForCausalLM
    if task == "encoder":
        return transformers.AutoModel
    if task is not None:
        raise ValueError(f"task {task!r} is not one of {TASKS}")
    return definition.model_class(config)


def load(path, *, dtype, device=None, config=None, task: str | None = None, trust_remote_code: bool = False):
    """The model of the local snapshot folder `path` with its weights, in `dtype`, moved to
    `device` (where given), in eval mode: transformers' `from_pretrained` of the class
    `model_class(config, task)` picks. transformers' own errors reach the caller, which knows
    whose model it is (the source, the baseline)."""
    cls = model_class(config, task)
    model = cls.from_pretrained(str(Path(path)), dtype=dtype, trust_remote_code=trust_remote_code)
    if device is not None:
        model = model.to(device)
    return model.eval()


def build(config, *, task: str, dtype, **kwargs):
    """The model of `config` for `task` in `dtype`, its weights transformers' initialisation (the
    caller fills them): the auto class's `from_config`, with `kwargs` (e.g. the attention
    implementation) passed on."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {TASKS}")
    return model_class(config, task).from_config(config, dtype=dtype, **kwargs)
