"""How `epp serve` writes its log: text lines, or JSON lines with zap's field names (`--zap-encoder json`,
what the reference EPP's chart asks for, so that log pipelines built for it parse these too)."""

from __future__ import annotations

import json
import logging

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ZAP_LEVEL = {"WARNING": "warn", "CRITICAL": "fatal"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `level`, `ts` (epoch seconds), `logger`, `msg`, and `stacktrace` when an
    exception is logged (zap's production encoder's keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "level": _ZAP_LEVEL.get(record.levelname, record.levelname.lower()),
            "ts": record.created,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["stacktrace"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stacktrace"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str, json_lines: bool) -> None:
    """Set up the root logger (stderr) for `epp serve`; as `logging.basicConfig`, nothing changes when the
    root logger has handlers already (an embedding program's, a test runner's)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
