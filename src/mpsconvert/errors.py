"""Every error mpsconvert raises on purpose, in one hierarchy rooted at `MpsconvertError`.

Each is a problem the user can act on: `str(err)` is one line, the problem then the fix after
"; ". The CLI prints it as `error: ...` and exits with `exit_code` (2); anything that is not an
MpsconvertError is a bug and keeps its traceback. Catch `MpsconvertError` to handle them all,
or a subclass for one kind of trouble (as huggingface_hub's errors are meant to be used).
"""


class MpsconvertError(Exception):
    """A problem with the user's input or environment, with what to do about it.

    `str(err)` is a single line: the problem, then the fix after "; ".
    """

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class SourceError(MpsconvertError):
    """The model source (repo id or folder) cannot be used."""


class QuantizationError(MpsconvertError):
    """A tensor cannot be quantized (NaN/inf, unsupported dtype), or a scheme's inputs are missing."""


class ArtifactError(MpsconvertError):
    """An artifact is missing, incomplete, tampered with or inconsistent."""


class DeviceError(MpsconvertError):
    """The requested device is not available or ran out of memory."""


class DataError(MpsconvertError):
    """Calibration or evaluation text that cannot be read or is empty."""


class ExportError(MpsconvertError):
    """The artifact cannot be exported to an Apple format (architecture, op or weights)."""


class EvalError(MpsconvertError):
    """The reference evaluation of an exported program could not run one of its ops."""


class MissingExtraError(MpsconvertError):
    """An optional dependency is not installed; the message names the extra that brings it."""


class UploadError(MpsconvertError):
    """The hub refused an upload, could not be reached, or offline mode is on."""


class PromptError(MpsconvertError):
    """A prompt or chat message that cannot be used as it is (not UTF-8, too long for the limit
    or the model's context); `chat` says it and goes on."""
