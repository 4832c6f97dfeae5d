"""JSON Schemas of deploy.yaml and of inventory files, generated from the pydantic models.

`schemas/deploy.schema.json` and `schemas/inventory.schema.json` are this module's output
(`sits-deployer schema -o ...`); a test fails when they are stale. Editors pick them up through
the ``# yaml-language-server: $schema=...`` line at the top of each example.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from deployer.config.models import Config, Inventory

SchemaKind = Literal["deploy", "inventory"]
SCHEMA_KINDS: dict[str, type[BaseModel]] = {"deploy": Config, "inventory": Inventory}
_TITLES = {
    "deploy": "SITS-Deployer deploy.yaml",
    "inventory": "SITS-Deployer inventory (the devices of fleet.inventory)",
}


def json_schema(kind: SchemaKind = "deploy") -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a deploy.yaml or an inventory file."""
    schema = SCHEMA_KINDS[kind].model_json_schema(by_alias=True, mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://sits.dev/schemas/{kind}.schema.json",
        **schema,
        "title": _TITLES[kind],
    }


def render_schema(kind: SchemaKind = "deploy") -> str:
    """The schema as the committed file holds it: indented, keys sorted, final newline."""
    return json.dumps(json_schema(kind), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
