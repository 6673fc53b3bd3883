"""Efficiency factors per AcceleratorClass from benchmark output, and the table `pdfleet simulate` prints.

Reads, from any text file, every line that is a JSON object, and understands three shapes:
- `bench/sim.py calibrate` (measured with the engine; torch is needed there, never here):
  `{"kind": "pdfleet-sim-calibration", "class": "cpu", "prefill_mfu": .., "decode_mbu": ..,
  "step_overhead_s": .., "http_hop_s": .., ...}`, the complete calibration of one class (`http_hop_s`,
  one HTTP round trip to a real worker's first byte, is optional);
- `bench/engine.py`'s result line (`bs1_mbu`, `read_gbs`, ...): the decode MBU of the `cpu` class,
  rescaled from the bandwidth it measured to the class's `memoryBandwidthGBps`;
- `bench/pd.py`'s result line (`transfer_gbps`, `pd_ttft_overhead_ms`, `kv_bytes`): the KV link
  bandwidth and fixed latency of the `cpu` class.
What a file does not give stays at the default of `perf_model.Efficiency`, and the table says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.sim.perf_model import Efficiency

CALIBRATION_KIND = "pdfleet-sim-calibration"


class CalibrationError(ValueError):
    """A calibration file that gives nothing usable, or numbers out of range."""


def _objects(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read calibration: {exc}") from exc
    found = []
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            whole = json.loads(stripped)
            if isinstance(whole, dict):
                return [whole]
        except json.JSONDecodeError:
            pass
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                found.append(obj)
    return found


def load(paths: Iterable[str | Path], classes: Mapping[str, AcceleratorClassSpec]) -> dict[str, Efficiency]:
    """Efficiencies per class from benchmark files (later files refine earlier ones)."""
    out: dict[str, Efficiency] = {}
    for p in paths:
        path = Path(p)
        objs = _objects(path)
        used = False
        for obj in objs:
            got = _from_object(obj, classes, out, path)
            used = used or got
        if not used:
            raise CalibrationError(f"{path}: no calibration in it (expected the JSON line of bench/sim.py calibrate, "
                                   "bench/engine.py or bench/pd.py)")
    return out


def _check(value: Any, name: str, path: Path, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or not lo < float(value) <= hi:
        raise CalibrationError(f"{path}: {name} must be a number in ({lo}, {hi}], got {value!r}")
    return float(value)


def _from_object(obj: dict[str, Any], classes: Mapping[str, AcceleratorClassSpec], out: dict[str, Efficiency],
                 path: Path) -> bool:
    if obj.get("kind") == CALIBRATION_KIND:
        name = obj.get("class")
        if name not in classes:
            raise CalibrationError(f"{path}: calibration of class {name!r}, not an AcceleratorClass of this fleet")
        base = out.get(name, Efficiency())
        out[name] = replace(
            base,
            prefill_mfu=_check(obj.get("prefill_mfu"), "prefill_mfu", path, 0, 1),
            decode_mbu=_check(obj.get("decode_mbu"), "decode_mbu", path, 0, 1),
            step_overhead_s=_check(obj.get("step_overhead_s"), "step_overhead_s", path, -1e-12, 10),
            source=f"measured: {path.name}" + (f" ({obj['model']})" if obj.get("model") else ""),
        )
        if "http_hop_s" in obj:
            out[name] = replace(out[name], http_hop_s=_check(obj["http_hop_s"], "http_hop_s", path, -1e-12, 10))
        if "kv_transfer_gbps" in obj:
            out[name] = replace(out[name], kv_transfer_gbps=_check(obj["kv_transfer_gbps"], "kv_transfer_gbps", path, 0, 1e4))
        return True
    if "bs1_mbu" in obj and "read_gbs" in obj and "cpu" in classes:
        mbu = _check(obj["bs1_mbu"], "bs1_mbu", path, 0, 1) * _check(obj["read_gbs"], "read_gbs", path, 0, 1e5)
        mbu /= classes["cpu"].memory_bandwidth_gbps
        base = out.get("cpu", Efficiency())
        out["cpu"] = replace(base, decode_mbu=min(1.0, mbu), source=_join(base, f"decode MBU from {path.name} (bench/engine.py)"))
        return True
    if "transfer_gbps" in obj and "cpu" in classes:
        base = out.get("cpu", Efficiency())
        gbps = _check(obj["transfer_gbps"], "transfer_gbps", path, 0, 1e4)
        out["cpu"] = replace(base, kv_transfer_gbps=gbps, source=_join(base, f"KV link from {path.name} (bench/pd.py)"))
        return True
    return False


def _join(base: Efficiency, what: str) -> str:
    return what if base.source == Efficiency().source else f"{base.source}; {what}"


def rows(classes: Iterable[str], effs: Mapping[str, Efficiency]) -> list[tuple[str, str, str, str, str, str, str]]:
    """(class, prefill MFU, decode MBU, step overhead, HTTP hop, KV link, source) for the classes a run uses."""
    out = []
    for name in classes:
        e = effs.get(name, Efficiency())
        out.append((name, f"{e.prefill_mfu:.3f}", f"{e.decode_mbu:.3f}", f"{e.step_overhead_s * 1000:.2f} ms",
                    f"{e.http_hop_s * 1000:.2f} ms",
                    "class networkGBps" if e.kv_transfer_gbps is None else f"{e.kv_transfer_gbps:.2f} GB/s",
                    e.source))
    return out


def print_table(classes: Iterable[str], effs: Mapping[str, Efficiency], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="calibration (efficiency factors per AcceleratorClass)")
    for col in ("class", "prefill MFU", "decode MBU", "step overhead", "HTTP hop", "KV link", "source"):
        t.add_column(col)
    for row in rows(classes, effs):
        t.add_row(*row)
    console.print(t)
