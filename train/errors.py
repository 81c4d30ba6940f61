"""The trainer's user-facing error, and the stop a preemption makes."""


class TrainingError(RuntimeError):
    """A failure the user can act on (the message says what to change)."""


class Preempted(KeyboardInterrupt):
    """SIGTERM stopped the training loop after its step `step`: `saved` says whether a
    checkpoint of that step is complete on disk in `directory` (the `checkpoints`
    directory); where not, `why` names the flag that said not to save. A
    KeyboardInterrupt, as Ctrl-C is: `finally` blocks run and `except Exception` passes
    it on."""

    def __init__(self, step: int, directory: str, saved: bool, why: str = ""):
        super().__init__(step)
        self.step, self.directory, self.saved, self.why = step, directory, saved, why

    def line(self, resume: str = "--resume_from_checkpoint latest") -> str:
        """The one line a run stopped so ends with (`resume`: how to continue it)."""
        if self.saved:
            return (
                f"SIGTERM: saved a checkpoint at step {self.step} in {self.directory}; "
                f"resume with {resume}"
            )
        return f"terminated (SIGTERM) after step {self.step}, nothing saved ({self.why})"
