"""The trainer's user-facing error, the stop a preemption makes, and the exit status a
signal's stop ends with."""


class TrainingError(RuntimeError):
    """A failure the user can act on (the message says what to change)."""


def signal_status(signum: int) -> int:
    """The exit status of a run that signal `signum` stopped, as a shell reports one the
    signal killed: 128 + its number (130 for Ctrl-C's SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class Preempted(KeyboardInterrupt):
    """SIGTERM stopped the training loop after its step `step`: `saved` says whether a
    checkpoint of that step is complete on disk in `directory` (the `checkpoints`
    directory); where not, `why` names the flag that said not to save. A
    KeyboardInterrupt, as Ctrl-C is: `finally` blocks run and `except Exception` passes
    it on."""

    def __init__(self, step: int, directory: str, saved: bool, why: str = ""):
        super().__init__(step)
        self.step, self.directory, self.saved, self.why = step, directory, saved, why

    def line(self, resume: str = "--resume_from_checkpoint latest", last: str = "") -> str:
        """The one line a run stopped so ends with (`resume`: how to continue it). `last`:
        where a run that saved nothing has its last checkpoint (`no checkpoint was
        written to ...`), said after a colon."""
        if self.saved:
            return (
                f"SIGTERM: saved a checkpoint at step {self.step} in {self.directory}; "
                f"resume with {resume}"
            )
        line = f"terminated (SIGTERM) after step {self.step}, nothing saved ({self.why})"
        return f"{line}: {last}" if last else line
