"""Efficiency factors per (engine, AcceleratorClass) from benchmark output, and the table `pdfleet simulate` prints.

Reads, from any text file, every line that is a JSON object, and understands three shapes:
- `bench/sim.py calibrate` (measured with an engine; torch is needed there, never here):
  `{"kind": "pdfleet-sim-calibration", "class": "cpu", "engine": "pdfleet"|"vllm", "prefill_mfu": ..,
  "decode_mbu": .., "step_overhead_s": .., "http_hop_s": .., ...}`, the complete calibration of one
  engine on one class (`engine` defaults to pdfleet, `http_hop_s`, one HTTP round trip to a real
  worker's first byte, is optional);
- `bench/engine.py`'s result line (`bs1_mbu`, `read_gbs`, ...): the pdfleet engine's decode MBU on the
  `cpu` class, rescaled from the bandwidth it measured to the class's `memoryBandwidthGBps`;
- `bench/pd.py`'s result line (`transfer_gbps`, `pd_ttft_overhead_ms`, `kv_bytes`): the KV link
  bandwidth of the pdfleet engine on the `cpu` class.
What a file does not give stays at `efficiency.for_pool`'s value, and the table says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import runtimes
from pdfleet_operator.sim import efficiency
from pdfleet_operator.sim.perf_model import Efficiency

Key = tuple[str, str]  # (engine, AcceleratorClass)

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


def load(paths: Iterable[str | Path], classes: Mapping[str, AcceleratorClassSpec]) -> dict[Key, Efficiency]:
    """Efficiencies per (engine, class) from benchmark files (later files refine earlier ones)."""
    out: dict[Key, Efficiency] = {}
    for p in paths:
        path = Path(p)
        objs = _objects(path)
        used = False
        for obj in objs:
            got = _from_object(obj, classes, out, path)
            used = used or got
        if not used:
            raise CalibrationError(
                f"{path}: no calibration in it (expected the JSON line of bench/sim.py calibrate, "
                "bench/engine.py or bench/pd.py)"
            )
    return out


def _check(value: Any, name: str, path: Path, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or not lo < float(value) <= hi:
        raise CalibrationError(f"{path}: {name} must be a number in ({lo}, {hi}], got {value!r}")
    return float(value)


def _base(out: Mapping[Key, Efficiency], key: Key, classes: Mapping[str, AcceleratorClassSpec]) -> Efficiency:
    return out.get(key) or efficiency.for_pool(key[0], key[1], classes[key[1]])


def _from_object(
    obj: dict[str, Any], classes: Mapping[str, AcceleratorClassSpec], out: dict[Key, Efficiency], path: Path
) -> bool:
    if obj.get("kind") == CALIBRATION_KIND:
        name = obj.get("class")
        if name not in classes:
            raise CalibrationError(f"{path}: calibration of class {name!r}, not an AcceleratorClass of this fleet")
        engine = obj.get("engine", runtimes.PDFLEET)
        if engine not in (runtimes.PDFLEET, runtimes.VLLM):
            raise CalibrationError(f"{path}: engine {engine!r} is not pdfleet or vllm")
        key = (engine, name)
        base = _base(out, key, classes)
        out[key] = replace(
            base,
            prefill_mfu=_check(obj.get("prefill_mfu"), "prefill_mfu", path, 0, 1),
            decode_mbu=_check(obj.get("decode_mbu"), "decode_mbu", path, 0, 1),
            step_overhead_s=_check(obj.get("step_overhead_s"), "step_overhead_s", path, -1e-12, 10),
            source=f"measured: {path.name}" + (f" ({obj['model']})" if obj.get("model") else ""),
        )
        if "http_hop_s" in obj:
            out[key] = replace(out[key], http_hop_s=_check(obj["http_hop_s"], "http_hop_s", path, -1e-12, 10))
        if "kv_transfer_gbps" in obj:
            out[key] = replace(
                out[key], kv_transfer_gbps=_check(obj["kv_transfer_gbps"], "kv_transfer_gbps", path, 0, 1e4)
            )
        return True
    key = (runtimes.PDFLEET, "cpu")
    if "bs1_mbu" in obj and "read_gbs" in obj and "cpu" in classes:
        mbu = _check(obj["bs1_mbu"], "bs1_mbu", path, 0, 1) * _check(obj["read_gbs"], "read_gbs", path, 0, 1e5)
        mbu /= classes["cpu"].memory_bandwidth_gbps * classes["cpu"].count
        base = _base(out, key, classes)
        out[key] = replace(
            base,
            decode_mbu=min(1.0, mbu),
            source=_join(out, key, base, f"measured: decode MBU from {path.name} (bench/engine.py)"),
        )
        return True
    if "transfer_gbps" in obj and "cpu" in classes:
        base = _base(out, key, classes)
        gbps = _check(obj["transfer_gbps"], "transfer_gbps", path, 0, 1e4)
        out[key] = replace(
            base,
            kv_transfer_gbps=gbps,
            source=_join(out, key, base, f"measured: KV link from {path.name} (bench/pd.py)"),
        )
        return True
    return False


def _join(out: Mapping[Key, Efficiency], key: Key, base: Efficiency, what: str) -> str:
    """A source naming what the files gave: appended to an earlier file's, else instead of the default's."""
    return f"{base.source}; {what}" if key in out else f"{what} (the rest: {base.source})"


def rows(
    pools: Iterable[Key], effs: Mapping[Key, Efficiency], classes: Mapping[str, AcceleratorClassSpec]
) -> list[tuple[str, ...]]:
    """(class, engine, prefill MFU, decode MBU, step overhead, HTTP hop, KV link, TP scaling, source) for the
    (engine, class) pools a run uses."""
    out = []
    for engine, name in pools:
        e = effs.get((engine, name)) or efficiency.for_pool(engine, name, classes[name])
        out.append(
            (
                name,
                engine,
                f"{e.prefill_mfu:.3f}",
                f"{e.decode_mbu:.3f}",
                f"{e.step_overhead_s * 1000:.2f} ms",
                f"{e.http_hop_s * 1000:.2f} ms",
                "class networkGBps" if e.kv_transfer_gbps is None else f"{e.kv_transfer_gbps:.2f} GB/s",
                f"{e.tensor_parallel_scaling:g}" if classes[name].count > 1 and classes[name].vendor != "cpu" else "-",
                e.source,
            )
        )
    return out


COLUMNS = (
    "class",
    "engine",
    "prefill MFU",
    "decode MBU",
    "step overhead",
    "HTTP hop",
    "KV link",
    "TP scaling",
    "source",
)


def print_table(
    pools: Iterable[Key],
    effs: Mapping[Key, Efficiency],
    classes: Mapping[str, AcceleratorClassSpec],
    console: Any = None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="efficiency per (engine, AcceleratorClass): measured or assumed (the source says which)")
    for col in COLUMNS:
        t.add_column(col)
    for row in rows(pools, effs, classes):
        t.add_row(*row)
    console.print(t)
