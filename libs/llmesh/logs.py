"""JSON logs, one object per line, with the request id of the task that logged.

Prompts and generated text are never passed to a logger; log sizes and counts.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Mapping

import orjson

from llmesh.telemetry import trace_id_var

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {
    "message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, fields: Mapping[str, object] | None = None):
        """``fields``: added to every line (a worker process's index)."""
        super().__init__()
        self.service = service
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
            **self.fields,
        }
        rid = request_id_var.get()
        if rid:
            out["request_id"] = rid
        tid = trace_id_var.get()
        if tid:
            out["trace_id"] = tid
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(service: str, level: str = "info", fields: Mapping[str, object] | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, fields))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn and grpc bring their own handlers; route them through ours.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # watchfiles logs every batch of changes in the config file's folder at INFO: with a log
    # file in that folder each line would report the last one, without end.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)

