"""What Grafana would do with the dashboards, for tests: read the JSON, list each panel's PromQL, substitute the
variables."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def models() -> dict[str, dict[str, Any]]:
    """uid -> dashboard JSON model, as committed in dashboards/."""
    out = {}
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        model = json.loads(path.read_text())
        out[model["uid"]] = model
    return out


def exprs(model: dict[str, Any], *, annotations: bool = False) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target; with `annotations`, the annotation queries too."""
    found = [(p["title"], t["expr"]) for p in model.get("panels", []) for t in p.get("targets") or []]
    if annotations:
        found += [(a["name"], a["expr"]) for a in model.get("annotations", {}).get("list", []) if a.get("expr")]
    return found


def substitute(
    expr: str,
    *,
    namespace: str = ".*",
    deployment: str = ".*",
    job: str = ".*",
    rate_interval: str = "1m",
    range_s: int = 3600,
) -> str:
    """Grafana's interpolation of the variables the dashboards use. `$1` (label_replace) is not a variable and stays."""
    values = {
        "__rate_interval": rate_interval,
        "__range_s": str(range_s),
        "__range": f"{range_s}s",
        "namespace": namespace,
        "deployment": deployment,
        "job": job,
    }
    return re.sub(
        r"\$(__rate_interval|__range_s|__range|namespace|deployment|job)\b", lambda m: values[m.group(1)], expr
    )
