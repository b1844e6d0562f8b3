"""docs/config.md is the config reference: every key of the typed config has a row
there, and the row's default is the model's (the same value, however it is spelled)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest
from pydantic import BaseModel

from lmcache_connector.settings import ConnectorConfig
from lmcache_core.config import parse_size

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def reference_rows(text: str) -> dict[str, list[str]]:
    """``key -> cells after the key`` for every table row that starts with a key."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([a-z_0-9.]+)` \|(.*)$", line)
        if m:
            rows.setdefault(m.group(1), [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))])
    return rows


def leaf_keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(name, dotted path, default)`` of every scalar key, sections walked into."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from leaf_keys(ann, f"{prefix}{name}.")
        else:
            yield name, prefix + name, field.default


def documents_default(cell: str, default: Any) -> bool:
    """Whether the default column ``cell`` says ``default``."""
    shown = cell.strip("` ")
    if default is None:
        return cell.startswith("`null`")
    if isinstance(default, bool):
        return shown == str(default).lower()
    if isinstance(default, str):
        return shown == default
    if isinstance(default, (int, float)):
        try:
            return float(shown) == float(default)
        except ValueError:
            try:
                return parse_size(shown) == default
            except ValueError:
                return False
    return True  # lists, dicts: described in prose


def missing(model: type[BaseModel], text: str) -> list[str]:
    rows = reference_rows(text)
    out = []
    for name, path, default in leaf_keys(model):
        cells = rows.get(path) or rows.get(name)
        if cells is None:
            out.append(f"{path}: no row")
        elif len(cells) > 1 and not documents_default(cells[1], default):
            out.append(f"{path}: default {default!r}, documented {cells[1]!r}")
    return out


def test_every_config_key_has_a_row_with_its_default():
    assert missing(ConnectorConfig, DOC.read_text()) == []


@pytest.mark.parametrize("change", ["drop a row", "change a default"])
def test_the_check_catches_a_stale_reference(change):
    """Negative controls: the same check on an edited copy of the reference."""
    text = DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `settle_when` |"))
    edited = row.replace("| `always` | with", "| `idle` | with") if change == "change a default" else ""
    assert edited != row
    found = missing(ConnectorConfig, text.replace(row, edited))
    assert len(found) == 1 and found[0].startswith("connector.settle_when")
