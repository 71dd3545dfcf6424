"""A stand-in for a module's logger: keeps what it logs as errors and warnings, drops the rest."""

from __future__ import annotations

from typing import Any


class Recorder:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, msg: str, *args: object, **_: object) -> None:
        self.errors.append(msg % args if args else msg)

    def warning(self, msg: str, *args: object, **_: object) -> None:
        self.warnings.append(msg % args if args else msg)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None
