"""How a run stops: SIGTERM like SIGINT (a clean unwind, exit 143 / 130), and failures of the
machine (a full disk, no memory) as one line, exit 1.

An inherited *ignored* SIGINT stays ignored: a shell starts a script's background job (`cmd &`)
with SIGINT ignored, so that Ctrl-C in the terminal reaches the foreground only, and horizon keeps
that convention (Python itself leaves an ignored SIGINT ignored). Such a run stops on SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from ..errors import HorizonError, Terminated


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM stops the run like SIGINT: an exception unwinds it (temp dirs removed, the last
    checkpoint kept) and the command exits 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def runtime_failures() -> Iterator[None]:
    """Failures of the machine while training (a full disk, no memory, no threads) are one
    `error:` line and exit status 1, not a traceback."""
    try:
        yield
    except HorizonError:
        raise
    except MemoryError:
        raise HorizonError("out of host memory (MemoryError); the last checkpoint is intact") from None
    except OSError as e:
        raise HorizonError(f"{e.filename or 'I/O'}: {e.strerror or e}") from None
    except RuntimeError as e:
        if "can't start new thread" in str(e):
            raise HorizonError(f"cannot start a thread ({e}); the last checkpoint is intact") from None
        if "out of memory" in str(e).lower():
            raise HorizonError(f"{str(e).splitlines()[0]}; the last checkpoint is intact") from None
        raise
