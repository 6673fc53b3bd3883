"""Table responses (``Accept: application/json;as=Table;...``) from a CRD's ``additionalPrinterColumns``, so
that ``kubectl get`` shows printer columns. Mixed into the emulator."""

from __future__ import annotations

import json
from typing import Any

from tests.support.k8s.clock import age
from tests.support.k8s.jsonpath import jsonpath
from tests.support.k8s.resources import ApiResource


class TablesMixin:
    """kubectl's tables."""

    def _columns(self, res: ApiResource) -> list[dict]:
        columns = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "priority": 0,
                "description": "Name must be unique within a namespace.",
                "jsonPath": ".metadata.name",
            }
        ]
        version = res.crd_version
        printer = (version or {}).get("additionalPrinterColumns") if version is not None else None
        if printer is None and res.crd is not None:
            printer = res.crd["spec"].get("additionalPrinterColumns")
        if printer:
            for col in printer:
                columns.append(
                    {
                        "name": col["name"],
                        "type": col.get("type", "string"),
                        "format": col.get("format", ""),
                        "description": col.get("description", ""),
                        "priority": col.get("priority", 0),
                        "jsonPath": col.get("jsonPath") or col.get("JSONPath"),
                    }
                )
            return columns
        if (res.group, res.plural) == ("", "namespaces"):
            columns.append(
                {
                    "name": "Status",
                    "type": "string",
                    "format": "",
                    "priority": 0,
                    "description": "The phase of the namespace.",
                    "jsonPath": ".status.phase",
                }
            )
        columns.append(
            {
                "name": "Age",
                "type": "date",
                "format": "",
                "priority": 0,
                "description": (
                    "CreationTimestamp is a timestamp representing the server time when this object was created."
                ),
                "jsonPath": ".metadata.creationTimestamp",
            }
        )
        return columns

    def _cell(self, column: dict, obj: dict) -> Any:
        try:
            values = jsonpath(obj, column["jsonPath"])
        except ValueError:
            return None
        if not values:
            return None
        if column["type"] == "date":
            return age(values[0], self.clock.time()) if isinstance(values[0], str) else None
        if len(values) > 1:
            return ",".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in values)
        value = values[0]
        if isinstance(value, (dict, list)):
            return json.dumps(value, separators=(",", ":"))
        if column["type"] == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        if column["type"] == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if column["type"] == "boolean" and isinstance(value, bool):
            return value
        if column["type"] == "string":
            return str(value).lower() if isinstance(value, bool) else str(value)
        return value

    def _table(
        self, res: ApiResource, objs: list[dict], include_object: str | None, *, with_columns: bool = True
    ) -> dict:
        columns = self._columns(res)
        rows = []
        for obj in objs:
            if include_object == "Object":
                embedded: Any = obj
            elif include_object == "None":
                embedded = None
            else:
                embedded = {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                }
            rows.append({"cells": [self._cell(c, obj) for c in columns], "object": embedded})
        table = {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self._rv)},
            "rows": rows,
        }
        if with_columns:
            table["columnDefinitions"] = [{k: v for k, v in c.items() if k != "jsonPath"} for c in columns]
        return table
