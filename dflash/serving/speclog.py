"""The periodic spec-decoding log line, in exactly vLLM's format (``SpecDecodingLogging``)::

    SpecDecoding metrics: Mean acceptance length: 3.21, Accepted throughput: 41.20 tokens/s,
    Drafted throughput: 130.00 tokens/s, Accepted: 412 tokens, Drafted: 1300 tokens,
    Per-position acceptance rate: 0.812, 0.611, ..., Avg Draft acceptance rate: 31.7%

(one line in the log). Counts are over the window since the previous line; nothing is logged
for a window without drafts. Definitions: :mod:`dflash.core.stats`.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from dflash.core.stats import AcceptanceCounter

FORMAT = ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
          "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
          "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%")
_NUM = r"([-+0-9.naif]+)"
LINE_RE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: " + _NUM + r", Accepted throughput: " + _NUM +
    r" tokens/s, Drafted throughput: " + _NUM + r" tokens/s, Accepted: (\d+) tokens, Drafted: "
    r"(\d+) tokens, Per-position acceptance rate: ([0-9., ]*), Avg Draft acceptance rate: " + _NUM + "%")


def format_line(c: AcceptanceCounter, elapsed_s: float) -> str:
    rates = ", ".join(f"{p:.3f}" for p in c.per_position_rate)
    pct = 100.0 * c.accepted_tokens / c.draft_tokens if c.draft_tokens else float("nan")
    el = elapsed_s if elapsed_s > 0 else float("inf")
    return FORMAT % (c.mean_acceptance_length, c.accepted_tokens / el, c.draft_tokens / el,
                     c.accepted_tokens, c.draft_tokens, rates, pct)


def parse_line(line: str) -> dict:
    """The numbers of one line (for tests and log scrapers). Raises ValueError when none."""
    m = LINE_RE.search(line)
    if not m:
        raise ValueError(f"not a SpecDecoding metrics line: {line!r}")
    g = m.groups()
    return {"mean_acceptance_length": float(g[0]), "accepted_throughput": float(g[1]),
            "drafted_throughput": float(g[2]), "accepted": int(g[3]), "drafted": int(g[4]),
            "per_position": [float(x) for x in g[5].split(",") if x.strip()],
            "draft_acceptance_rate": float(g[6])}


class SpecDecodingLogger:
    """Window of acceptance counts, emitted as the vLLM line and reset.

    ``record`` is called per verify step (any thread); ``emit`` by the timer thread of
    :meth:`start`, or directly.
    """

    def __init__(self, logger: logging.Logger | None = None, clock=time.monotonic):
        self.log = logger or logging.getLogger("dflash.verifier")
        self.clock = clock
        self._lock = threading.Lock()
        self._window = AcceptanceCounter()
        self._since = clock()

    def record(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self._window.record(drafted, accepted)

    def emit(self) -> str | None:
        """Log and return the line for the window so far, then start a new window."""
        with self._lock:
            c, self._window = self._window, AcceptanceCounter()
            now = self.clock()
            elapsed, self._since = now - self._since, now
        if not c.drafts:
            return None
        line = format_line(c, elapsed)
        self.log.info("%s", line)
        return line

    def start(self, interval_s: float) -> threading.Event:
        """Emit every ``interval_s`` seconds on a daemon thread; set the returned event to stop."""
        stop = threading.Event()

        def run():
            while not stop.wait(interval_s):
                self.emit()

        if interval_s > 0:
            threading.Thread(target=run, daemon=True, name="spec-decode-log").start()
        return stop
