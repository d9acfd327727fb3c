"""Quiet by default: third-party progress bars, warnings and log lines that say nothing to our
user are silenced in the CLI; `mpsconvert -v ...` keeps them all.

What is silenced, and how, without importing any of those libraries here (`--help` stays
instant; they read these settings when they load):
- transformers' `Loading weights` bars and advisory lines: TRANSFORMERS_VERBOSITY=error,
  TRANSFORMERS_NO_ADVISORY_WARNINGS, and huggingface_hub's HF_HUB_DISABLE_PROGRESS_BARS (the
  switch transformers' own tqdm wrapper also reads), and bare tqdm bars (transformers' "Converting
  and de-quantizing GGUF tensors") through TQDM_DISABLE, which tqdm reads when it is imported;
- Python warnings (the `past_key_values` FutureWarnings with their source lines, torch's and
  coreai-torch's version notes): ignored, except UserWarnings raised by mpsconvert itself;
- coremltools' log lines (`scikit-learn version ... is not supported`, `Torch version ... has
  not been tested`, `Failed to load _MLModelProxy`): its loggers at ERROR, as are those of
  torch's export machinery, huggingface_hub, accelerate and compressed-tensors.
Our own progress bars (rich, cli/progress_bars.py) are not touched.
"""

from __future__ import annotations

import logging
import os
import warnings

LOGGERS = (
    "coremltools",
    "transformers",
    "huggingface_hub",
    "accelerate",
    "compressed_tensors",
    "torch._export",
    "torch.export",
    "torch._dynamo",
    "coreai",
    "coreai_torch",
    "urllib3",
    "httpx",
)
ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_DISABLE": "1",
}


class _Level(logging.Filter):
    """Drops records below ERROR on a logger whose level a library resets when it loads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def apply(verbose: bool) -> None:
    """Silence the third-party noise (nothing when `verbose`)."""
    if verbose:
        return
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", category=UserWarning, module=r"mpsconvert(\.|$)")
    for name in LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(logging.ERROR)
        if not any(isinstance(f, _Level) for f in log.filters):
            log.addFilter(_Level())
    _transformers_if_loaded()


def _transformers_if_loaded() -> None:
    """transformers sets its verbosity from the environment when it loads; if it already has
    (a Python caller of the CLI, the tests), set it directly."""
    import sys

    tf = sys.modules.get("transformers")
    if tf is not None:
        try:
            tf.utils.logging.set_verbosity_error()
            tf.utils.logging.disable_progress_bar()
        except AttributeError:
            pass
    hub = sys.modules.get("huggingface_hub")
    if hub is not None:
        try:
            hub.utils.disable_progress_bars()
        except AttributeError:
            pass
