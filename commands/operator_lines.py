"""What the launcher itself tells the operator (where the logs are, what is served where, a node
restarted, a planner change, why it stops), in the deployment's `--log-format`.

Text: the line as it is, `pdserve ...`: start-up news on stdout, problems and what happens
while serving on stderr. JSON: the same message as one object in the form every pdserve
process logs (wire/log_format.py's JSONFormatter: ts, level, logger `pdserve.launcher`,
message), so a `--log-format json` deployment writes nothing but JSON lines.
"""

from __future__ import annotations

import logging
import sys

from pdserve.wire.log_format import JSONFormatter

LOGGER_NAME = "pdserve.launcher"


class OperatorLines:
    def __init__(self, log_format: str = "text") -> None:
        self.json = log_format == "json"
        self._formatter = JSONFormatter()

    def _line(self, message: str, level: int) -> str:
        if not self.json:
            return message
        record = logging.LogRecord(LOGGER_NAME, level, __file__, 0, message, None, None)
        return self._formatter.format(record)

    def say(self, message: str) -> None:
        """News, on stdout."""
        print(self._line(message, logging.INFO), flush=True)

    def note(self, message: str) -> None:
        """News while serving (a planner change, a drain), on stderr beside the problems."""
        print(self._line(message, logging.INFO), file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        """A problem, on stderr."""
        print(self._line(message, logging.WARNING), file=sys.stderr, flush=True)
