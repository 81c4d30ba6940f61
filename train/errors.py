"""The trainer's user-facing error."""


class TrainingError(RuntimeError):
    """A failure the user can act on (the message says what to change)."""
