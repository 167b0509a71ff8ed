"""The library's warning and exception classes."""


class AutographWarning(UserWarning):
    """A graphed function runs (some of its keys) eagerly; the message says why and where."""


class CaptureError(RuntimeError):
    """Raised instead of falling back to eager when ``strict=True`` or ``AUTOGRAPH_STRICT=1``."""
