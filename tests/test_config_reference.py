"""docs/configuration.md is what scripts/config_reference.py makes of the configuration dataclasses: every
setting `serve` takes is listed there with its default, and the page cannot drift from the code."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from splitserve.api.serve_config import SECTIONS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
config_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_reference)


def test_the_committed_page_is_what_the_code_generates() -> None:
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/configuration.md drifted: run python3 -P scripts/config_reference.py --write")


def test_every_setting_is_on_the_page() -> None:
    page = config_reference.render()
    missing = [f.name for _, cls in SECTIONS for f in dataclasses.fields(cls)
               if f.init and f"`{f.name}`" not in page and f"_{f.name.upper()}`" not in page]
    assert missing == []
