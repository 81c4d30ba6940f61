"""The trainer's user-facing error, a full disk's error found under another, the stop a
preemption makes, the exit status a signal's stop ends with, and SIGTERM / SIGHUP
handled as Ctrl-C is (the tools)."""

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable


class TrainingError(RuntimeError):
    """A failure the user can act on (the message says what to change)."""


# The errors a tool reports in one line, `error: <message>` (exit status 2): the run's
# settings or data (TrainingError, ValueError) and an option this setup cannot run
# (NotImplementedError: jflash names it), met by every process of a run alike.
USER_ERRORS = (TrainingError, ValueError, NotImplementedError)


# The machine's faults, not the run's settings: a full disk or quota, a read-only or
# failing file system.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
# How a full disk reads in an error of another kind (tensorstore's, under an Orbax save).
DISK_FULL_TEXT = os.strerror(errno.ENOSPC)


def disk_error(error: BaseException | None) -> OSError | None:
    """The OSError of a full disk or quota, or a read-only or failing file system
    (`DISK_ERRNOS`), that `error` is or was raised from or while handling, or one for an
    error of another kind that says the disk is full (`DISK_FULL_TEXT`); else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            return error
        if not isinstance(error, OSError) and DISK_FULL_TEXT in str(error):
            return OSError(errno.ENOSPC, DISK_FULL_TEXT)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def from_interrupt(error: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM) that caused `error`: a KeyboardInterrupt, or one being
    handled when `error` was raised; None if none did. Ctrl-C during a checkpoint save
    reaches the loop as Orbax's `RuntimeError('Event loop stopped before Future
    completed.')`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def disk_words(error: OSError) -> str:
    """`<file>: No space left on device`, the file where the error names one."""
    what = error.strerror or str(error)
    return f"{error.filename}: {what}" if error.filename else what


def signal_status(signum: int) -> int:
    """The exit status of a run that signal `signum` stopped, as a shell reports one the
    signal killed: 128 + its number (130 for Ctrl-C's SIGINT, 143 for SIGTERM)."""
    return 128 + signum


class Preempted(KeyboardInterrupt):
    """SIGTERM (or SIGHUP: `signum`) stopped the training loop after its step `step`:
    `saved` says whether a checkpoint of that step is complete on disk in `directory`
    (the `checkpoints` directory); where not, `why` names the flag that said not to save.
    A KeyboardInterrupt, as Ctrl-C is: `finally` blocks run and `except Exception` passes
    it on."""

    def __init__(
        self, step: int, directory: str, saved: bool, why: str = "", signum: int = signal.SIGTERM
    ):
        super().__init__(step)
        self.step, self.directory, self.saved, self.why = step, directory, saved, why
        self.signum = signum

    def line(self, resume: str = "--resume_from_checkpoint latest", last: str = "") -> str:
        """The one line a run stopped so ends with (`resume`: how to continue it). `last`:
        where a run that saved nothing has its last checkpoint (`no checkpoint was
        written to ...`), said after a colon."""
        if self.saved:
            return (
                f"{signal.Signals(self.signum).name}: saved a checkpoint at step {self.step} "
                f"in {self.directory}; resume with {resume}"
            )
        line = f"{STOP_SIGNALS[self.signum]} after step {self.step}, nothing saved ({self.why})"
        return f"{line}: {last}" if last else line


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`signum`) handled as Ctrl-C is (`signals_as_interrupts`):
    `finally` blocks run, and the tool ends with one line and `signal_status(signum)`."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


# What ends a tool as Ctrl-C does (a terminal closed sends SIGHUP), by the words its
# line says it with.
STOP_SIGNALS = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}


def stopped_how(error: KeyboardInterrupt) -> str:
    """How a stop came: `terminated (SIGTERM)`, `hung up (SIGHUP)` or `interrupted`."""
    return STOP_SIGNALS[error.signum] if isinstance(error, Terminated) else "interrupted"


def stop_status(error: KeyboardInterrupt) -> int:
    """The exit status of a tool `error` stopped: the signal's (`signal_status`)."""
    return signal_status(error.signum if isinstance(error, Terminated) else signal.SIGINT)


def until_stopped[T](work: Callable[[], T], kept: str) -> T:
    """`work()`, with SIGTERM and SIGHUP raising as Ctrl-C does; a stop ends the process
    with one line, `<how it stopped>: <kept>` (what the stop left in place), on stderr
    and the signal's exit status (`stop_status`), not a traceback."""
    try:
        with signals_as_interrupts():
            return work()
    except KeyboardInterrupt as e:
        sys.stdout.flush()
        print(f"{stopped_how(e)}: {kept}", file=sys.stderr, flush=True)
        sys.exit(stop_status(e))


def raise_terminated(signum, frame):
    """The signal handler of a stop signal: raises `Terminated(signum)`."""
    raise Terminated(signum)


@contextlib.contextmanager
def signals_as_interrupts():
    """Inside the block, SIGTERM and SIGHUP raise `Terminated` as Ctrl-C raises
    KeyboardInterrupt. A signal ignored (`nohup`) stays so; only in the main thread,
    where Python runs signal handlers."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, raise_terminated)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler set outside Python
                signal.signal(sig, handler)
