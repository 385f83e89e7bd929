"""A benchmark's report as a JSON file (--output): written after each part too, so a cut run keeps what it
measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], output: str | None) -> None:
    """`report` as indented JSON at `output` (values JSON lacks, as their str); nothing without an output."""
    if output:
        Path(output).write_text(json.dumps(report, indent=2, default=str))
