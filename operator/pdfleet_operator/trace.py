"""Request traces for `pdfleet simulate` and `pdfleet load`: bursty diurnal synthetic presets and CSV import/export of
real logs.

A trace is three aligned arrays: arrival time (seconds from the trace start, sorted), prompt tokens
and output tokens per request. The synthetic generator draws a non-homogeneous Poisson process
whose rate is the mean rate x a diurnal shape x random bursts, with log-normal prompt and output
lengths; presets give conversation-like and code-like shapes.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DAY_S = 86400.0


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token counts, clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class Preset:
    """The shape of a synthetic workload; the rate comes separately (requests per second on average)."""

    name: str
    description: str
    prompt: LengthDist
    output: LengthDist
    peaks: tuple[tuple[float, float, float], ...]  # (hour of day, height, width in hours) Gaussian humps
    floor: float  # rate at night relative to the humps' baseline
    bursts_per_day: float  # Poisson number of bursts per day
    burst_minutes: float  # mean burst length (exponential)
    burst_height: tuple[float, float]  # burst multiplier, uniform in [lo, hi]
    # A second population of requests ("simple": short questions, short answers) and its share of all requests;
    # the rest follow prompt/output. Query routing sends the simple ones to a smaller model.
    simple_share: float = 0.0
    simple_prompt: LengthDist | None = None
    simple_output: LengthDist | None = None

    def shape(self, t: np.ndarray) -> np.ndarray:
        """Relative rate at times `t` (seconds from midnight), normalised to a mean of 1 over a day."""
        return self._raw(t) / self._day_mean()

    def _raw(self, t: np.ndarray) -> np.ndarray:
        hours = (np.asarray(t, dtype=float) / 3600.0) % 24.0
        rate = np.full_like(hours, self.floor)
        for hour, height, width in self.peaks:
            d = np.minimum(np.abs(hours - hour), 24.0 - np.abs(hours - hour))  # circular distance
            rate = rate + height * np.exp(-0.5 * (d / width) ** 2)
        return rate

    def _day_mean(self) -> float:
        return float(self._raw(np.arange(0.0, DAY_S, 60.0)).mean())


PRESETS: dict[str, Preset] = {
    "conversation": Preset(
        name="conversation",
        description="chat: multi-turn prompts (median 1,000 tokens with history), answers of ~250 tokens; "
        "an afternoon-and-evening peak about 4x the night; a dozen bursts a day",
        prompt=LengthDist(median=1000, sigma=0.9, lo=8, hi=6144),
        output=LengthDist(median=250, sigma=0.8, lo=1, hi=2048),
        peaks=((11.0, 1.0, 2.5), (20.0, 1.4, 3.0)),
        floor=0.45,
        bursts_per_day=12.0,
        burst_minutes=8.0,
        burst_height=(1.5, 2.5),
    ),
    "code": Preset(
        name="code",
        description="coding assistant: long prompts of repository context (median 2,500 tokens), short "
        "completions (median 100 tokens); office hours with two humps, quiet nights; "
        "frequent short bursts (CI and agents)",
        prompt=LengthDist(median=2500, sigma=0.7, lo=32, hi=7168),
        output=LengthDist(median=100, sigma=1.0, lo=1, hi=1024),
        peaks=((10.5, 1.0, 1.8), (15.5, 1.1, 2.0)),
        floor=0.15,
        bursts_per_day=30.0,
        burst_minutes=3.0,
        burst_height=(1.5, 3.0),
    ),
    "assistant": Preset(
        name="assistant",
        description="a general assistant, 40% simple / 60% complex requests: simple ones have a short prompt and no "
        "history (median 150 tokens) and a medium answer (median 200: an email, a definition, a list); "
        "complex ones carry long context (median 1,500 prompt tokens) and longer answers (median 350); "
        "the conversation preset's day. Simple requests generate about a third of the output tokens",
        prompt=LengthDist(median=1500, sigma=0.7, lo=8, hi=7168),
        output=LengthDist(median=350, sigma=0.6, lo=1, hi=2048),
        peaks=((11.0, 1.0, 2.5), (20.0, 1.4, 3.0)),
        floor=0.45,
        bursts_per_day=12.0,
        burst_minutes=8.0,
        burst_height=(1.5, 2.5),
        simple_share=0.4,
        simple_prompt=LengthDist(median=150, sigma=0.6, lo=4, hi=500),
        simple_output=LengthDist(median=200, sigma=0.5, lo=1, hi=500),
    ),
}


@dataclass(frozen=True)
class Trace:
    """Requests as aligned arrays; `arrival` is sorted, in seconds from the trace start."""

    name: str
    arrival: np.ndarray  # float64 [N]
    prompt: np.ndarray  # int64 [N]
    output: np.ndarray  # int64 [N]
    duration: float  # seconds the trace covers (>= the last arrival)

    def __post_init__(self) -> None:
        n = len(self.arrival)
        assert len(self.prompt) == n and len(self.output) == n, "trace arrays must have the same length"
        assert n == 0 or bool(np.all(np.diff(self.arrival) >= 0)), "trace arrivals must be sorted"
        assert n == 0 or (self.prompt.min() >= 1 and self.output.min() >= 1), "token counts must be >= 1"

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def mean_rate(self) -> float:
        return len(self) / self.duration if self.duration > 0 else 0.0

    def rate_series(self, bin_s: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
        """(bin starts, requests per second in each bin)."""
        edges = np.arange(0.0, self.duration + bin_s, bin_s)
        counts, _ = np.histogram(self.arrival, bins=edges)
        return edges[:-1], counts / bin_s

    def head(self, seconds: float) -> "Trace":
        """The first `seconds` of the trace."""
        n = int(np.searchsorted(self.arrival, seconds, side="left"))
        return Trace(self.name, self.arrival[:n], self.prompt[:n], self.output[:n], min(seconds, self.duration))


def synthetic(
    preset: str | Preset, *, mean_rate: float, duration: float, seed: int = 0, start_hour: float = 0.0
) -> Trace:
    """A bursty diurnal trace of `duration` seconds starting at `start_hour` o'clock, `mean_rate` req/s over a day."""
    p = PRESETS.get(preset) if isinstance(preset, str) else preset
    if p is None:
        raise ValueError(f"unknown trace preset {preset!r}; known: {', '.join(PRESETS)} (or a CSV file)")
    if not mean_rate > 0:
        raise ValueError(f"mean_rate must be > 0 requests/s, got {mean_rate}")
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    rng = np.random.default_rng(seed)
    offset = (start_hour % 24.0) * 3600.0
    bins = np.arange(0.0, duration, 1.0)
    rate = mean_rate * p.shape(bins + offset) * _bursts(p, rng, duration)
    counts = rng.poisson(rate)
    n = int(counts.sum())
    arrival = np.repeat(bins, counts) + rng.random(n)
    arrival.sort()
    arrival = np.minimum(arrival, np.nextafter(duration, 0.0))
    prompt, output = p.prompt.draw(rng, n), p.output.draw(rng, n)
    if p.simple_share > 0:
        assert p.simple_prompt is not None and p.simple_output is not None, f"preset {p.name}: simple lengths missing"
        simple = rng.random(n) < p.simple_share
        k = int(simple.sum())
        prompt[simple], output[simple] = p.simple_prompt.draw(rng, k), p.simple_output.draw(rng, k)
    return Trace(p.name, arrival, prompt, output, float(duration))


def _bursts(p: Preset, rng: np.random.Generator, duration: float) -> np.ndarray:
    """Per-second multiplier: 1 outside bursts, a burst's height inside it (ramped over a minute)."""
    mult = np.ones(int(math.ceil(duration)))
    count = rng.poisson(p.bursts_per_day * duration / DAY_S)
    for start in rng.uniform(0.0, duration, count):
        length = max(60.0, rng.exponential(p.burst_minutes * 60.0))
        height = rng.uniform(*p.burst_height)
        lo, hi = int(start), min(len(mult), int(start + length))
        if hi <= lo:
            continue
        ramp = np.minimum(1.0, np.minimum(np.arange(hi - lo) + 1, np.arange(hi - lo)[::-1] + 1) / 60.0)
        mult[lo:hi] = np.maximum(mult[lo:hi], 1.0 + (height - 1.0) * ramp)
    return mult


# --- CSV -------------------------------------------------------------------------------------------

HEADER = ("timestamp", "prompt_tokens", "output_tokens")
_HEADER_ALIASES = {
    "timestamp": {"timestamp", "time", "ts", "arrival", "arrival_time"},
    "prompt_tokens": {"prompt_tokens", "prompt", "input_tokens", "prompt_len", "context_tokens"},
    "output_tokens": {"output_tokens", "output", "completion_tokens", "generated_tokens", "output_len"},
}
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


class TraceFileError(ValueError):
    """A CSV trace that cannot be read; the message names the file, line and column."""


def read_csv(path: str | Path, *, name: str | None = None) -> Trace:
    """A trace from CSV rows `timestamp,prompt_tokens,output_tokens` (header optional).

    Timestamps are seconds (any origin, e.g. unix time) or ISO 8601 date-times; the trace starts at
    the earliest one. Rows out of order are sorted. Every problem raises `TraceFileError` naming the
    line and column.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such trace file (give conversation, code, or a CSV path)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{path}: cannot read the trace: {exc}") from exc
    rows = [(i + 1, r) for i, r in enumerate(csv.reader(text.splitlines())) if r and any(c.strip() for c in r)]
    if not rows:
        raise TraceFileError(f"{path}: empty trace file; expected rows of {','.join(HEADER)}")
    order = (0, 1, 2)
    first = [c.strip().lower() for c in rows[0][1]]
    if not _NUMBER.match(first[0]) and not _is_datetime(first[0]):
        order = _header_order(path, first)
        rows = rows[1:]
        if not rows:
            raise TraceFileError(f"{path}: the trace has a header but no requests")
    times, prompts, outputs = [], [], []
    for line, row in rows:
        if len(row) < 3:
            raise TraceFileError(f"{path}:{line}: expected 3 columns ({','.join(HEADER)}), got {len(row)}: {row!r}")
        cells = [row[i].strip() for i in order]
        times.append(_timestamp(path, line, cells[0]))
        prompts.append(_tokens(path, line, HEADER[1], cells[1], minimum=1))
        outputs.append(_tokens(path, line, HEADER[2], cells[2], minimum=1))
    t = np.asarray(times, dtype=float)
    idx = np.argsort(t, kind="stable")
    t = t[idx] - t[idx[0]]
    duration = float(t[-1]) + 1.0
    return Trace(
        name or path.stem,
        t,
        np.asarray(prompts, dtype=np.int64)[idx],
        np.asarray(outputs, dtype=np.int64)[idx],
        duration,
    )


def write_csv(trace: Trace, path: str | Path) -> None:
    """Write a trace so `read_csv` (and `pdfleet load` replays) read it back."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for t, p, o in zip(trace.arrival.tolist(), trace.prompt.tolist(), trace.output.tolist()):
            w.writerow((f"{t:.6f}", p, o))


def _header_order(path: Path, header: list[str]) -> tuple[int, int, int]:
    found = []
    for column in HEADER:
        hits = [i for i, h in enumerate(header) if h in _HEADER_ALIASES[column]]
        if not hits:
            raise TraceFileError(
                f"{path}:1: header {header!r} has no {column} column "
                f"(accepted names: {', '.join(sorted(_HEADER_ALIASES[column]))})"
            )
        found.append(hits[0])
    return found[0], found[1], found[2]


def _is_datetime(text: str) -> bool:
    try:
        dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        return True
    except ValueError:
        return False


def _timestamp(path: Path, line: int, text: str) -> float:
    if _NUMBER.match(text):
        value = float(text)
        if not math.isfinite(value):
            raise TraceFileError(f"{path}:{line}: timestamp {text!r} is not finite")
        return value
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise TraceFileError(
            f"{path}:{line}: timestamp {text!r} is neither seconds nor an ISO 8601 date-time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def _tokens(path: Path, line: int, column: str, text: str, minimum: int) -> int:
    if not _NUMBER.match(text):
        raise TraceFileError(f"{path}:{line}: {column} {text!r} is not a number")
    value = float(text)
    if value != int(value):
        raise TraceFileError(f"{path}:{line}: {column} {text!r} is not a whole number of tokens")
    if value < minimum:
        raise TraceFileError(f"{path}:{line}: {column} is {int(value)}, must be >= {minimum}")
    return int(value)


def parse_span(text: str) -> float:
    """Seconds in '86400', '90s', '15m', '6h', '1d' or '1h30m'; ValueError otherwise."""
    text = str(text).strip()
    if _NUMBER.match(text):
        value = float(text)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"invalid duration {text!r}: expected seconds or e.g. '90s', '15m', '6h', '1d'")
        unit = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S}
        value = sum(float(n) * unit[u] for n, u in parts)
    if not value > 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return value
