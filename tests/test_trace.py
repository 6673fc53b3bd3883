"""Traces: the synthetic generator's rate, diurnal shape, bursts and lengths; CSV import and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from pdfleet_operator import trace as tr


def test_synthetic_rate_and_lengths_follow_the_preset() -> None:
    t = tr.synthetic("conversation", mean_rate=10.0, duration=tr.DAY_S, seed=1)
    assert 0.9 * 864_000 < len(t) < 1.15 * 864_000  # bursts only add
    assert np.all(np.diff(t.arrival) >= 0) and t.arrival[0] >= 0 and t.arrival[-1] < tr.DAY_S
    p = tr.PRESETS["conversation"]
    assert p.prompt.lo <= t.prompt.min() and t.prompt.max() <= p.prompt.hi
    assert p.output.lo <= t.output.min() and t.output.max() <= p.output.hi
    assert abs(np.median(t.prompt) - p.prompt.median) < 0.05 * p.prompt.median
    assert abs(np.median(t.output) - p.output.median) < 0.05 * p.output.median


def test_diurnal_shape_peaks_in_the_evening_and_dips_at_night() -> None:
    t = tr.synthetic("conversation", mean_rate=5.0, duration=tr.DAY_S, seed=2)
    per_hour = np.bincount((t.arrival // 3600).astype(int), minlength=24)
    assert per_hour[18:23].mean() > 2.5 * per_hour[2:7].mean()  # bursts add noise, the day shape holds
    shape = tr.PRESETS["conversation"].shape(np.arange(24) * 3600.0)
    assert shape.argmax() in range(18, 23) and shape.argmin() in range(2, 7)


def test_code_preset_has_longer_prompts_shorter_outputs_and_quiet_nights() -> None:
    conv = tr.synthetic("conversation", mean_rate=2.0, duration=tr.DAY_S, seed=3)
    code = tr.synthetic("code", mean_rate=2.0, duration=tr.DAY_S, seed=3)
    assert np.median(code.prompt) > 2 * np.median(conv.prompt)
    assert np.median(code.output) < np.median(conv.output)
    hours = np.bincount((code.arrival // 3600).astype(int), minlength=24)
    assert hours[9:17].sum() > 4 * hours[0:8].sum()


def test_bursts_raise_the_rate_above_the_diurnal_curve() -> None:
    preset = tr.PRESETS["code"]
    flat = tr.Preset(
        "flat",
        "",
        preset.prompt,
        preset.output,
        peaks=(),
        floor=1.0,
        bursts_per_day=40.0,
        burst_minutes=5.0,
        burst_height=(3.0, 3.0),
    )
    t = tr.synthetic(flat, mean_rate=4.0, duration=6 * 3600, seed=4)
    per_min = np.bincount((t.arrival // 60).astype(int)) / 60.0
    assert per_min.max() > 2.2 * 4.0  # a 3x burst
    assert np.median(per_min) < 1.5 * 4.0


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = tr.synthetic("code", mean_rate=3.0, duration=600, seed=5)
    b = tr.synthetic("code", mean_rate=3.0, duration=600, seed=5)
    c = tr.synthetic("code", mean_rate=3.0, duration=600, seed=6)
    assert np.array_equal(a.arrival, b.arrival) and np.array_equal(a.prompt, b.prompt)
    assert not np.array_equal(a.prompt[:50], c.prompt[:50])


def test_start_hour_shifts_the_day() -> None:
    night = tr.synthetic("conversation", mean_rate=5.0, duration=3600, seed=7, start_hour=4)
    evening = tr.synthetic("conversation", mean_rate=5.0, duration=3600, seed=7, start_hour=20)
    assert len(evening) > 2.5 * len(night)


def test_synthetic_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown trace preset 'chat'"):
        tr.synthetic("chat", mean_rate=1, duration=10)
    with pytest.raises(ValueError, match="mean_rate"):
        tr.synthetic("code", mean_rate=0, duration=10)
    with pytest.raises(ValueError, match="duration"):
        tr.synthetic("code", mean_rate=1, duration=0)


def test_csv_round_trip(tmp_path) -> None:
    t = tr.synthetic("conversation", mean_rate=3.0, duration=300, seed=8)
    path = tmp_path / "t.csv"
    tr.write_csv(t, path)
    back = tr.read_csv(path)
    assert len(back) == len(t)
    assert np.allclose(back.arrival, t.arrival - t.arrival[0], atol=1e-5)
    assert np.array_equal(back.prompt, t.prompt) and np.array_equal(back.output, t.output)


def test_csv_without_header_with_aliases_iso_times_and_out_of_order_rows(tmp_path) -> None:
    plain = tmp_path / "plain.csv"
    plain.write_text("1700000010,100,5\n1700000000,200,7\n\n1700000005,300,9\n")
    t = tr.read_csv(plain)
    assert t.arrival.tolist() == [0.0, 5.0, 10.0]
    assert t.prompt.tolist() == [200, 300, 100] and t.output.tolist() == [7, 9, 5]
    aliased = tmp_path / "aliased.csv"
    aliased.write_text("completion_tokens,time,input_tokens\n3,2024-05-01T10:00:00Z,50\n4,2024-05-01T10:00:02.5Z,60\n")
    t = tr.read_csv(aliased)
    assert t.arrival.tolist() == [0.0, 2.5] and t.prompt.tolist() == [50, 60] and t.output.tolist() == [3, 4]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty trace file"),
        ("timestamp,prompt_tokens,output_tokens\n", "has a header but no requests"),
        ("timestamp,prompt,tokens_out\n1,2,3\n", "no output_tokens column"),
        ("0,10,5\n1,20\n", ":2: expected 3 columns"),
        ("0,10,5\n1,twenty,5\n", ":2: prompt_tokens 'twenty' is not a number"),
        ("0,10,5\n1,10,-3\n", ":2: output_tokens is -3, must be >= 1"),
        ("0,10,5\n1,10.5,3\n", ":2: prompt_tokens '10.5' is not a whole number"),
        ("0,10,5\nyesterday,10,3\n", ":2: timestamp 'yesterday' is neither seconds nor an ISO 8601"),
        ("0,0,5\n", ":1: prompt_tokens is 0, must be >= 1"),
    ],
)
def test_bad_csv_names_line_and_column(tmp_path, content, message) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(tr.TraceFileError, match=message.replace("(", r"\(").replace(".", r"\.")):
        tr.read_csv(path)


def test_missing_csv() -> None:
    with pytest.raises(tr.TraceFileError, match="no such trace file"):
        tr.read_csv("/nonexistent/trace.csv")


def test_head_and_spans() -> None:
    t = tr.synthetic("code", mean_rate=3.0, duration=600, seed=9)
    h = t.head(60)
    assert h.duration == 60 and len(h) and h.arrival.max() < 60
    assert tr.parse_span("1d") == 86400 and tr.parse_span("1h30m") == 5400 and tr.parse_span("90") == 90
    with pytest.raises(ValueError, match="invalid duration"):
        tr.parse_span("ten minutes")
