"""How every pdserve process logs: `LogSettings` (from `--log-level`, `--log-format text|json`,
and in the router `--uvicorn-log-level`), applied once by `python -m pdserve.router` and by each
node
(node/cli.py) to the root logger.

Text: `TIME LEVEL LOGGER: MESSAGE`, control characters in the message escaped. JSON: one object per line with `ts` (ISO 8601, UTC),
`level`, `logger` and `message`, plus the fields a record carries in `fields` (the access line
and the stats line put theirs there: router/api/access_log.py, router/cluster/stats_log.py) and
`exception` when there is a traceback. uvicorn's own loggers propagate to the same handler, at
`--uvicorn-log-level`.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pdserve.wire.config_flags import option

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: MESSAGE`, one line per record: control characters in the message
    (a newline inside a client's string, say) are written as escapes, so no text a client sends
    can start a forged line. A traceback still follows on lines of its own."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_CONTROL_ESCAPES)
        return super().formatMessage(record)


# C0 controls and DEL, written as Python writes them in a repr: "\n", "\x1b", ...
_CONTROL_ESCAPES = {code: repr(chr(code))[1:-1] for code in (*range(0x20), 0x7F)}


class JSONFormatter(logging.Formatter):
    """One JSON object per record; a record's `fields` (a dict, given as
    `extra={"fields": ...}`) are merged in at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update((k, v) for k, v in fields.items() if k not in line)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


@dataclass
class LogSettings:
    """Flags generated from the `option` metadata (wire/config_flags.py)."""

    level: str = option(
        "info", flag="--log-level", type=str.lower, choices=LOG_LEVELS, help="log level"
    )
    log_format: str = option(
        "text", flag="--log-format", choices=LOG_FORMATS,
        help="text, or json: one object per line with ts, level, logger, message",
    )
    uvicorn_level: str = option(
        "warning", flag="--uvicorn-log-level", type=str.lower, choices=LOG_LEVELS,
        roles=("router",), help="uvicorn's own loggers in the router; at info they add "
        "uvicorn's access lines",
    )

    def __post_init__(self) -> None:
        self.level, self.uvicorn_level = self.level.lower(), self.uvicorn_level.lower()
        for name in ("level", "uvicorn_level"):
            value = getattr(self, name)
            if value not in LOG_LEVELS:
                raise ValueError(f"{name} is {value!r}; expected one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log_format is {self.log_format!r}; expected one of {', '.join(LOG_FORMATS)}"
            )

    def formatter(self) -> logging.Formatter:
        return JSONFormatter() if self.log_format == "json" else TextFormatter(TEXT_FORMAT)

    def apply(self) -> None:
        """Sets the root logger up: one stderr handler with this format, at `level`."""
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(self.formatter())
        logging.basicConfig(level=self.level.upper(), handlers=[handler], force=True)
