"""What a command prints: our log lines, the libraries' kept to what matters, progress bars on lines of their own.

    setup_console(debug=False, verbose=False)   # scaletrain.cli calls it once, before any heavy import

* Our logger ``scaletrain``: INFO on rank 0 (WARNING on the other ranks), ``HH:MM:SS message`` on stdout,
  line-buffered, so a header printed before a progress bar is on the screen (or in the log file) before it.
* The libraries (DeepSpeed, Accelerate, MLflow and alembic, matplotlib, the C compiler's distutils log,
  torch.distributed, urllib3, git): their INFO/DEBUG records are dropped and a short list of known
  non-facts is dropped at WARNING too (DeepSpeed's "Setting accelerator to CPU", the deepspeed runner's
  "Unable to find hostfile", matplotlib's "building the font cache"); their other warnings and errors are
  kept. MLflow configures its own handler from ``MLFLOW_LOGGING_LEVEL`` when it is imported: set to WARNING
  unless the user chose a level.
* Progress bars (tqdm, stderr): on a terminal as usual. Into a file or pipe a redrawing bar is one long line
  of ``\\r`` updates with the next output glued to its end; there stderr is wrapped by :class:`LineProgress`,
  which writes a bar's states as lines of their own: for a task still running after 5 s, at most one per
  15 s and its last state; nothing for a task done sooner (no stale "0%" line).
* ``--verbose`` (or ``SCALETRAIN_VERBOSE=1``; ``--debug`` implies it): every library's records at INFO,
  DEBUG with ``--debug``, nothing filtered.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import time

VERBOSE_ENV = "SCALETRAIN_VERBOSE"
LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "accelerate", "mlflow", "alembic", "matplotlib", "distutils",
                   "setuptools", "torch.distributed", "urllib3", "git", "PIL", "filelock", "numexpr")
# WARNING records of the libraries that state no fact the user can act on (matched as substrings)
NOISE = (
    "Setting accelerator to CPU",  # DeepSpeed on a machine without GPU
    "Unable to find hostfile, will proceed with training with local resources only",  # deepspeed runner, 1 node
    "Matplotlib is building the font cache",
)


def verbose_from_env(env=None) -> bool:
    env = os.environ if env is None else env
    return str(env.get(VERBOSE_ENV, "")).strip().lower() not in ("", "0", "false", "no")


class LibraryFilter(logging.Filter):
    """Keep a library record at WARNING or above unless it is a known non-fact (:data:`NOISE`)."""

    def __init__(self, min_level: int = logging.WARNING):
        super().__init__()
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return False
        if record.levelno >= logging.ERROR:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to fix
            return True
        return not any(n in msg for n in NOISE)


_FILTER = LibraryFilter()


def quiet_libraries(verbose: bool) -> None:
    """Attach (or, verbose, remove) the library filter. A filter on the named logger survives the library
    configuring that logger later (DeepSpeed sets its level and handler when it is imported)."""
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        if verbose:
            lg.removeFilter(_FILTER)
        elif _FILTER not in lg.filters:
            lg.addFilter(_FILTER)
            if lg.level == logging.NOTSET or lg.level < logging.WARNING:
                lg.setLevel(logging.WARNING)  # the children's records are checked against this too
    if not verbose:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        import warnings

        # libraries' start-up advice (e.g. torch.distributed's), not facts of the run
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(deepspeed|accelerate|mlflow)\b")


class LineProgress(io.TextIOBase):
    """A text stream for stderr into a file or pipe. Text ended by ``\r`` is a progress redraw: the states of
    a bar that runs ``delay`` s or longer are written as lines of their own, at most one per ``interval``
    s, and its last state when it ends (cleared or closed); a bar done sooner leaves no line unless it is
    closed with a final ``\n`` (tqdm's ``leave=True``), which writes that final state. Blank redraws are
    dropped; other text passes unchanged. Throttled here, not through tqdm's ``TQDM_*`` variables, so no
    setting leaks into child processes that may have a terminal."""

    def __init__(self, raw, interval: float = 15.0, delay: float = 5.0, clock=time.monotonic):
        super().__init__()
        self.raw, self.interval, self.delay, self.clock = raw, interval, delay, clock
        self._pending = ""
        self._redraw = False  # the pending text followed a \r
        self._open = False  # a partial line (flushed without its end) is on the output
        self._bar_start = None  # when the current bar's first state completed
        self._held = ""  # the bar's latest state not written yet
        self._last = float("-inf")  # when a state was last written

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return getattr(self.raw, "encoding", "utf-8")

    def fileno(self) -> int:
        return self.raw.fileno()

    def isatty(self) -> bool:
        return False

    def _state(self, seg: str, out: list) -> None:
        """A redraw state completed (a \r followed it)."""
        now = self.clock()
        if self._bar_start is None:
            self._bar_start = now
        self._held = seg.rstrip()
        if now - self._bar_start >= self.delay and now - self._last >= self.interval:
            out.append(self._held + "\n")
            self._held, self._last = "", now

    def _end_bar(self, out: list, final: str = "") -> None:
        """The bar was cleared (``final`` empty) or closed on a line of its own (``final``)."""
        if final.strip():
            out.append(final.rstrip() + "\n")
        elif self._held and self._bar_start is not None and self.clock() - self._bar_start >= self.delay:
            out.append(self._held + "\n")
        self._bar_start, self._held = None, ""

    def write(self, s: str) -> int:
        out: list[str] = []
        text = self._pending + s
        start = 0
        for i, ch in enumerate(text):
            if ch not in "\r\n":
                continue
            seg = text[start:i]
            start = i + 1
            if self._open:  # a flushed partial line ends here
                out.append(seg + "\n")
                self._open = False
            elif ch == "\n":
                if self._redraw:
                    self._end_bar(out, seg)
                else:
                    out.append(seg + "\n")
            elif seg.strip():
                self._state(seg, out)
            elif self._redraw:
                self._end_bar(out)
            self._redraw = ch == "\r"
        self._pending = text[start:]
        if out:
            self.raw.write("".join(out))
        return len(s)

    def flush(self) -> None:
        if self._pending and not self._redraw:
            self.raw.write(self._pending)
            self._pending, self._open = "", True
        self.raw.flush()


def _line_safe_streams() -> None:
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):  # replaced by a test harness or embedded use
        pass
    err = sys.stderr
    if isinstance(err, LineProgress) or not hasattr(err, "fileno"):
        return
    try:
        tty = err.isatty()
        err.fileno()
    except (OSError, ValueError, AttributeError):
        return
    if not tty:
        sys.stderr = LineProgress(err)


def setup_console(debug: bool = False, verbose: bool = False, log_stream=None) -> bool:
    """Logging and streams for one command (log lines on ``log_stream``, default stdout); returns whether
    verbose is on."""
    verbose = verbose or debug or verbose_from_env()
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # ranks started from here (launchers) inherit it
    rank = int(os.environ.get("RANK", "0") or 0)
    level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    _line_safe_streams()
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout if log_stream is None else log_stream)
    logging.getLogger("scaletrain").setLevel(level)
    quiet_libraries(verbose)
    if verbose:
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.INFO)
    return verbose
