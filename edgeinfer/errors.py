"""Errors a user can cause. Each carries one line that names the problem.

Front ends (CLI, TUI, REST) catch `EdgeInferError` and show its message; anything
else is a bug and keeps its traceback.
"""


class EdgeInferError(Exception):
    """A problem with the user's input: printed as one line, never a traceback."""


class GGUFError(EdgeInferError):
    """The file is not a GGUF edgeinfer can load (bad magic, truncated, unknown type...)."""


class MetadataError(GGUFError):
    """A metadata value of the wrong type or out of range; the line names the key and the file."""


class UnsupportedModelError(EdgeInferError):
    """A valid GGUF whose architecture or tensor types edgeinfer does not run."""


class ModelNotFoundError(EdgeInferError):
    """A model name that is neither a local file, an alias nor an hf.co reference."""


class DownloadError(EdgeInferError):
    """A download failed: offline, missing file, size or checksum mismatch."""


class TokenizerError(EdgeInferError):
    """Tokenizer metadata that edgeinfer cannot build a tokenizer from."""


class TemplateError(EdgeInferError):
    """A chat template that fails to parse or render."""


class ContextOverflowError(EdgeInferError):
    """A prompt that does not fit in the context window (its tokens and the window's, where known)."""

    def __init__(self, message: str, n_prompt: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message)
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


class GrammarError(EdgeInferError, ValueError):
    """A JSON schema, grammar or regex that cannot be compiled (the line names why)."""
