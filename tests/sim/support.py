"""Small SimulatedFleet documents for the simulator's tests (an 8B model on a few nodes)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pdfleet_operator.sim import fleet

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sim" / "fleet-100.yaml"

BASE: dict[str, Any] = {
    "apiVersion": fleet.API_VERSION,
    "kind": fleet.KIND,
    "metadata": {"name": "small"},
    "acceleratorClassFiles": [str(ROOT / "examples" / "acceleratorclasses.yaml")],
    "nodes": [
        {"name": "h100", "count": 1, "accelerators": {"h100-80gb": 8}},
        {"name": "mig", "count": 1, "devices": 2, "accelerators": {"h100-mig-3g-40gb": 4}},
        {"name": "ascend", "count": 1, "accelerators": {"ascend-910b": 4}},
    ],
    "simulation": {"startup": "30s", "scrapeInterval": "5s", "sampleInterval": "30s", "drainTimeout": "10m"},
    "trace": {"preset": "conversation", "meanRatePerSecond": 5, "duration": "10m"},
    "deployment": {
        "metadata": {"name": "chat"},
        "spec": {
            "model": {
                "name": "llama-8b",
                "source": {"pvc": {"claimName": "models"}},
                "maxModelLen": 8192,
                "architecture": {"parametersBillions": 8.03, "layers": 32, "kvHeads": 8, "headDim": 128},
            },
            "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048},
            "prefill": {
                "acceleratorClasses": ["h100-80gb"],
                "minReplicas": 1,
                "maxReplicas": 4,
                "targetQueuePerReplica": 2,
            },
            "decode": {
                "acceleratorClasses": ["h100-mig-3g-40gb", "ascend-910b"],
                "minReplicas": 1,
                "maxReplicas": 8,
                "targetQueuePerReplica": 16,
            },
            "slo": {"ttft": "1s", "itl": "50ms"},
            "autoscaling": {"interval": "5s", "scaleDownStabilization": "60s", "scaleDownDelayAfterScaleUp": "30s"},
        },
    },
    "policies": [
        {"name": "dynamic", "description": "autoscaled"},
        {
            "name": "static",
            "description": "fixed",
            "spec": {
                "autoscaling": {"enabled": False},
                "prefill": {"minReplicas": 2, "maxReplicas": 2},
                "decode": {"minReplicas": 2, "maxReplicas": 2},
            },
        },
        {
            "name": "colocated",
            "description": "one pool",
            "spec": {
                "disaggregation": False,
                "prefill": None,
                "decode": None,
                "colocated": {"acceleratorClasses": ["h100-80gb"], "minReplicas": 1, "maxReplicas": 4},
            },
        },
    ],
}


def doc(**patch: Any) -> dict[str, Any]:
    """BASE with top-level keys merged (maps merge, lists replace, None deletes)."""
    return fleet.merge(copy.deepcopy(BASE), patch)


def small(**patch: Any) -> fleet.Fleet:
    return fleet.parse(doc(**patch), source="small.yaml", base_dir=ROOT)
