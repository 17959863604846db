"""Every error kvrag raises on purpose derives from KVRagError, so callers can catch one type."""


class KVRagError(Exception):
    """Base class for kvrag errors."""


class UnsupportedModelError(KVRagError):
    """The model's architecture or RoPE variant cannot be re-encoded exactly."""


class EmptyInputError(KVRagError, ValueError):
    """A passage list, a passage or a question was empty."""


class ContextOverflowError(KVRagError, ValueError):
    """The assembled prompt does not fit in the model's context window."""


class UnknownBlockError(KVRagError, KeyError):
    """A block id was given that this engine never indexed and the store does not hold."""


class InputEncodingError(KVRagError, ValueError):
    """A file is not valid UTF-8 text."""


class QueueFullError(KVRagError):
    """The scheduler already holds as many waiting requests as it was allowed to queue."""


class RequestTimeoutError(KVRagError, TimeoutError):
    """A request waited in the queue longer than its `max_time`."""


class ChromaUnavailableError(KVRagError, ConnectionError):
    """No Chroma server answers at the URL kvrag was given (`--chroma`, `$KVRAG_CHROMA`, `chroma_url=`)."""


class DiskFullError(KVRagError, OSError):
    """No space left (or over quota) where kvrag writes; the message names the directory and the bytes needed."""


class ModelFileError(KVRagError):
    """A file of a model directory (config, weights, tokenizer, chat template) is missing, truncated or garbage.
    `path` is that file (or the directory, where no one file is to blame)."""

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = path
