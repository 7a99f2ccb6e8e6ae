"""The progress bar: drawn only on a terminal, with the log lines kept above it.

On a terminal (stderr is a TTY) the bar updates in place; anywhere else (a log file, a scheduler's output)
it is not drawn, and the log line of each log step is the progress, with no carriage returns.
`logs_above_bar(bar)` is the context the loop runs in: while the bar is shown, the console handlers that
shardwise's log records reach write through `tqdm.write`, so a log line never lands inside the bar.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

from tqdm import tqdm

LOGGER = "shardwise"  # the logger whose records the progress bar must not break


def progress_bar(total: int, initial: int, wanted: bool) -> tqdm:
    """The steps' bar: shown when `wanted` (train.progress_bar, on rank 0) and stderr is a terminal."""
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train",
                disable=not (wanted and sys.stderr.isatty()))


class _AboveBar(logging.StreamHandler):
    """A console handler's stand-in that writes through tqdm.write: the bar is cleared, the line written, the
    bar drawn again below it. Same stream, formatter, level and filters as the handler it stands in for."""

    def __init__(self, original: logging.StreamHandler) -> None:
        super().__init__(original.stream)
        self.setFormatter(original.formatter)
        self.setLevel(original.level)
        self.filters = list(original.filters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a handler reports its failure, never raises
            self.handleError(record)


def _console(handler: logging.Handler) -> bool:
    """A handler that prints to the terminal the bar is drawn on (not yet standing in for one)."""
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, _AboveBar)
            and handler.stream in (sys.stdout, sys.stderr))


def _loggers_reached(name: str) -> list[logging.Logger]:
    """The logger `name` and the ancestors its records propagate to (whose handlers print them)."""
    found: list[logging.Logger] = []
    logger: Optional[logging.Logger] = logging.getLogger(name)
    while logger is not None:
        found.append(logger)
        logger = logger.parent if logger.propagate else None
    return found


@contextmanager
def logs_above_bar(bar: tqdm, name: str = LOGGER) -> Iterator[None]:
    """While `bar` is shown, the plain console handlers (stdout/stderr) that logger `name`'s records reach
    write through tqdm.write, so that no log line breaks into the bar; restored on exit. Other handlers (a log
    file, the CLI's own tqdm handler) are left as they are. tqdm's logging_redirect_tqdm is not used: it adds
    a handler to a logger that has no console one (the CLI's: each line would print twice) and drops the
    handler's level."""
    if bar.disable:
        yield
        return
    saved = [(logger, logger.handlers) for logger in _loggers_reached(name)]
    try:
        for logger, handlers in saved:
            logger.handlers = [_AboveBar(h) if _console(h) else h for h in handlers]
        yield
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers
