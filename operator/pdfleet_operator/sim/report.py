"""What a simulation run says: per-policy summaries, `report.json`, the printed tables and the PNG plots.

Definitions (docs/planning.md quotes them):
- cost: every pod holding accelerators is billed `count x costPerHour` from the moment it is bound to
  a node (start-up included) until it is gone (drain included), plus the router's CPU cores at the
  cheapest `cpu` class price (`cost.plan_cost`); `cost_per_1m_tokens` is $ per 1M *generated* tokens,
  as the operator's `pdfleet:cost_per_million_tokens` rule computes it (`cost.per_million_tokens`).
- TTFT: arrival to first token (the prefill step that computes the prompt's last token samples it).
- ITL: engine step time weighted by the tokens each step produced, plus every request's first gap
  (first token -> second token: KV hand-off and decode admission); `tpot` is per request.
- SLO attainment: requests with TTFT <= slo.ttft and time per output token <= slo.itl, over all
  requests that were not invalid (rejected 503s and unfinished requests count as misses).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdfleet_operator.api import parse_duration
from pdfleet_operator.decide import cost as costs
from pdfleet_operator.sim import engine as eng
from pdfleet_operator.sim import search
from pdfleet_operator.sim.simulator import Simulator
from pdfleet_operator.sim.stats import Histogram, percentile

REQUIRED_KEYS = ("cost_per_1m_tokens", "ttft_p99_s", "itl_p99_s", "slo_attainment", "accelerator_hours")


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), nd)


def summarize(sim: Simulator) -> dict[str, Any]:
    """The numbers of one policy's run (JSON-ready)."""
    if sim.stopped is not None:
        return _stopped(sim)
    r = sim.reqs
    arrival = _floats(r.arrival)
    status = _ints(r.status)
    output = _ints(r.output)
    prompt = _ints(r.prompt)
    t_first = _floats(r.t_first)
    t_done = _floats(r.t_done)
    dep = _ints(r.deployment)
    measured = arrival >= sim.warmup
    done = (status == eng.DONE) & measured
    gaps = _floats(r.second_gap)
    # In PD the client's first token is not the prefill's: the router drops it (the prefill call asks for
    # max_tokens=1) and streams the decode worker's, which comes after the hand-off (router -> decode hop,
    # KV pull, admission, one decode step) -- the simulated second token. The hand-off is therefore TTFT,
    # not an inter-token gap. (A one-token request ends at its prefill here: its decode leg is not modelled.)
    pd = np.array([bool(d.spec.disaggregation) for d in sim.deps], dtype=bool)[dep] if len(dep) else np.zeros(0, bool)
    handoff = pd & (output > 1) & np.isfinite(gaps)
    first = np.where(handoff, t_first + np.where(handoff, gaps, 0.0), t_first)
    ttft = first - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (t_done - first) / np.maximum(output - 1 - handoff, 1), 0.0)
    slo_ttft = np.array([parse_duration(d.spec.slo.ttft) for d in sim.deps])[dep]
    slo_itl = np.array([parse_duration(d.spec.slo.itl) for d in sim.deps])[dep]
    valid = (status != eng.TOO_LONG) & measured
    met = done & (ttft <= slo_ttft) & (tpot <= slo_itl)
    itl = Histogram()
    for d in sim.deps:
        itl.merge(d.itl)
    colo_gaps = gaps[measured & ~pd]
    for g in colo_gaps[np.isfinite(colo_gaps)].tolist():
        itl.add(g, 1.0)

    hours: dict[str, float] = {}
    spend: dict[str, float] = {}
    busy: dict[str, float] = {}
    for rep in sim.all_replicas:
        cls = sim.classes[rep.accelerator_class]
        ended = rep.removed_at if rep.removed_at is not None else sim.end
        life = max(0.0, ended - max(rep.created_at, sim.warmup)) / 3600.0
        hours[rep.accelerator_class] = hours.get(rep.accelerator_class, 0.0) + life * cls.count
        spend[rep.accelerator_class] = spend.get(rep.accelerator_class, 0.0) + life * cls.count * cls.cost_per_hour
        busy[rep.accelerator_class] = busy.get(rep.accelerator_class, 0.0) + rep.busy_s / 3600.0 * cls.count
    router_per_hour = sum(
        d.spec.router.replicas
        * costs.router_cores(d.spec.router.resources.requests)
        * costs.cpu_core_price(sim.classes)
        for d in sim.deps
    )
    span = sim.end - sim.warmup
    router_cost = router_per_hour * span / 3600.0
    total_cost = sum(spend.values()) + router_cost
    generated = float(sum(rep.gen_tokens for rep in sim.all_replicas) - sim.gen_at_warmup)
    prompt_done = float(prompt[done].sum())
    per_1m = costs.per_million_tokens(total_cost / (span / 3600.0), generated / span) if span > 0 else None
    per_1m_all = (
        costs.per_million_tokens(total_cost / (span / 3600.0), (generated + prompt_done) / span) if span > 0 else None
    )

    ups = [e for e in sim.scale_events if e.desired > e.current]
    downs = [e for e in sim.scale_events if e.desired < e.current]
    pools: dict[str, dict[str, float]] = {}
    times = np.array([s.t for s in sim.samples])
    for key in sorted({k for s in sim.samples for k in s.replicas}):
        series = np.array([s.replicas.get(key, 0) for s in sim.samples], dtype=float)
        pools[key] = {"mean": _round(_time_mean(times, series), 2), "max": int(series.max()) if len(series) else 0}
    ratios = _pd_ratio_series(sim)
    reasons: dict[str, int] = {}
    for e in sim.scale_events:
        reasons[e.reason] = reasons.get(e.reason, 0) + 1
    counted = int(valid.sum())
    return {
        "name": sim.policy.name,
        "description": sim.policy.description,
        "deployments": [
            {
                "name": d.name,
                "share": d.plan.share,
                "tier": d.spec.tier,
                "disaggregation": d.spec.disaggregation,
                "autoscaling": d.spec.autoscaling.enabled,
                "slo": {"ttft_s": parse_duration(d.spec.slo.ttft), "itl_s": parse_duration(d.spec.slo.itl)},
                "classes": {role: list(rs.accelerator_classes) for role, rs in d.spec.roles().items()},
            }
            for d in sim.deps
        ],
        "cost_per_1m_tokens": _round(per_1m, 5),
        "cost_per_1m_total_tokens": _round(per_1m_all, 5),
        "cost_usd": _round(total_cost, 2),
        "cost_by_class_usd": {k: _round(v, 2) for k, v in sorted(spend.items())},
        "router_cost_usd": _round(router_cost, 2),
        "accelerator_hours": {k: _round(v, 2) for k, v in sorted(hours.items())},
        "busy_fraction": {k: _round(busy[k] / hours[k], 3) if hours[k] else None for k in sorted(hours)},
        "ttft_p50_s": _round(percentile(ttft[done], 50)),
        "ttft_p99_s": _round(percentile(ttft[done], 99)),
        "itl_p50_s": _round(itl.quantile(0.50)),
        "itl_p99_s": _round(itl.quantile(0.99)),
        "tpot_p50_s": _round(percentile(tpot[done & (output > 1)], 50)),
        "tpot_p99_s": _round(percentile(tpot[done & (output > 1)], 99)),
        "slo_attainment": _round(float(met.sum()) / counted if counted else None),
        "slo_met": int(met.sum()),  # requests that met it, of
        "slo_counted": counted,  # the measured requests not refused as too long
        "requests": int(measured.sum()),
        "routed_share": _round(float(sim.routed[measured].mean()) if measured.any() else None),  # to a routing target
        "completed": int(done.sum()),
        "rejected": int(((status == eng.REJECTED) & measured).sum()),
        "too_long": int(((status == eng.TOO_LONG) & measured).sum()),
        "unfinished": int(((status == eng.UNFINISHED) & measured).sum()),
        "preemptions": int(_ints(r.preemptions)[measured].sum()),
        "prompt_tokens": int(prompt_done),
        "generated_tokens": int(generated),
        "simulated_s": _round(span, 1),
        "warmup_s": _round(sim.warmup, 1),
        "scale_events": {"up": len(ups), "down": len(downs), "decisions": sim.decisions, "by_reason": reasons},
        "pools": pools,
        "pd_ratio": {
            "mean": _round(float(np.mean(ratios)), 3) if len(ratios) else None,
            "min": _round(float(np.min(ratios)), 3) if len(ratios) else None,
            "max": _round(float(np.max(ratios)), 3) if len(ratios) else None,
        },
        "rollback_actions": [
            {"t": _round(t, 1), "kind": k, "message": m} for d in sim.deps for t, k, m in d.rollback_actions
        ],
    }


def _stopped(sim: Simulator) -> dict[str, Any]:
    """A run stopped once it could no longer reach its goal (`Simulator(stop_below=...)`): what it shows is that
    bound; its cost and latencies cover part of the trace and are not reported (None) rather than compared."""
    st = sim.stopped
    assert st is not None
    return {
        "name": sim.policy.name,
        "description": sim.policy.description,
        **{key: None for key in REQUIRED_KEYS},
        "stopped": {
            "at_s": _round(st.t, 1),
            "goal": st.goal,
            "misses": st.misses,
            "allowed_misses": int(st.allowed),
            "requests": st.counted,
            "slo_attainment_at_most": st.at_most,
        },
    }


def _floats(values: list[float]) -> np.ndarray:
    """A request column as an array (np.fromiter: a day is a million entries; asarray inspects each for its type)."""
    return np.fromiter(values, dtype=np.float64, count=len(values))


def _ints(values: list[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _time_mean(t: np.ndarray, y: np.ndarray) -> float:
    if len(t) < 2:
        return float(y.mean()) if len(y) else 0.0
    return float(np.sum(y[:-1] * np.diff(t)) / (t[-1] - t[0]))


def _pd_ratio_series(sim: Simulator) -> np.ndarray:
    out = []
    for s in sim.samples:
        for d in sim.deps:
            if not d.spec.disaggregation:
                continue
            p = sum(v for k, v in s.ready.items() if k.startswith(f"{d.name}/prefill/"))
            q = sum(v for k, v in s.ready.items() if k.startswith(f"{d.name}/decode/"))
            if q:
                out.append(p / q)
    return np.asarray(out)


def cost_series(sim: Simulator) -> tuple[np.ndarray, np.ndarray]:
    """(sample times, cumulative $ up to each) from exact pod lifetimes (the router included)."""
    times = np.array([s.t for s in sim.samples])
    created = np.array([max(r.created_at, sim.warmup) for r in sim.all_replicas])
    ended = np.array([r.removed_at if r.removed_at is not None else sim.end for r in sim.all_replicas])
    price = np.array(
        [
            sim.classes[r.accelerator_class].count * sim.classes[r.accelerator_class].cost_per_hour
            for r in sim.all_replicas
        ]
    )
    if not len(price):
        return times, np.zeros_like(times)
    overlap = np.clip(np.minimum(ended[None, :], times[:, None]) - created[None, :], 0.0, None)
    router = sum(
        d.spec.router.replicas * costs.router_cores(d.spec.router.resources.requests) for d in sim.deps
    ) * costs.cpu_core_price(sim.classes)
    return times, (overlap * price[None, :]).sum(axis=1) / 3600.0 + router * (times - sim.warmup) / 3600.0


# --- comparison ----------------------------------------------------------------------------------------


def compare(
    entries: Mapping[str, Mapping[str, Any]], baseline: str, candidate: str, goal: float | None = None
) -> dict[str, Any]:
    """How much cheaper per 1M generated tokens `candidate` is than `baseline`, and at what SLO attainment;
    with the equal-SLO fields (`equal_slo`, whose target attainment is `goal`), how much at equal attainment."""
    b, c = entries[baseline], entries[candidate]
    saving = None
    if b["cost_per_1m_tokens"] and c["cost_per_1m_tokens"] is not None:
        saving = 1.0 - c["cost_per_1m_tokens"] / b["cost_per_1m_tokens"]
    out = {
        "baseline": baseline,
        "candidate": candidate,
        "baseline_cost_per_1m_tokens": b["cost_per_1m_tokens"],
        "candidate_cost_per_1m_tokens": c["cost_per_1m_tokens"],
        "saving": _round(saving, 4),
        "cost_ratio": _round(1.0 - saving, 4) if saving is not None else None,
        "baseline_slo_attainment": b["slo_attainment"],
        "candidate_slo_attainment": c["slo_attainment"],
        "slo_attainment_gap": _round((c["slo_attainment"] or 0) - (b["slo_attainment"] or 0), 4),
    }
    if "equal_slo_cost_per_1m_tokens" in b and "equal_slo_cost_per_1m_tokens" in c:
        be, ce = b["equal_slo_cost_per_1m_tokens"], c["equal_slo_cost_per_1m_tokens"]
        out.update(
            baseline_equal_slo_cost_per_1m_tokens=be,
            candidate_equal_slo_cost_per_1m_tokens=ce,
            equal_slo_attainment=goal,
            equal_slo_saving=_round(1.0 - ce / be, 4) if be and ce is not None else None,
        )
    return out


def equal_slo(
    entries: Mapping[str, Mapping[str, Any]], variants: Mapping[str, Sequence[Mapping[str, Any]]], target: str
) -> dict[str, Any]:
    """Each policy's cheapest run (itself or one of its sweep `variants`) whose SLO attainment reaches
    `target`'s: {"target", "target_attainment", "policies": {name: {cost, attainment, variant, runs}}}.

    NOTE: "reaches" is >= the target's attainment rounded to 4 decimals (0.01 points), as report.json
    rounds it. A policy none of whose runs reaches it gets cost None and says how close it came.
    """
    goal = entries[target]["slo_attainment"]
    out: dict[str, Any] = {"target": target, "target_attainment": goal, "policies": {}}
    for name, e in entries.items():
        runs = [
            {
                "variant": "as configured",
                "cost_per_1m_tokens": e["cost_per_1m_tokens"],
                "slo_attainment": e["slo_attainment"],
            }
        ]
        runs += [
            {
                "variant": v["variant"],
                "cost_per_1m_tokens": v["cost_per_1m_tokens"],
                "slo_attainment": v["slo_attainment"],
                **({"stopped": v["stopped"]} if v.get("stopped") else {}),
            }
            for v in variants.get(name, ())
        ]
        ok = [
            r
            for r in runs
            if goal is not None
            and r["slo_attainment"] is not None
            and r["cost_per_1m_tokens"] is not None
            and r["slo_attainment"] >= goal
        ]
        best = min(ok, key=lambda r: r["cost_per_1m_tokens"]) if ok else None
        closest = max(
            (r for r in runs if r["slo_attainment"] is not None), key=lambda r: r["slo_attainment"], default=None
        )
        out["policies"][name] = {
            "cost_per_1m_tokens": best["cost_per_1m_tokens"] if best else None,
            "attainment": best["slo_attainment"] if best else None,
            "variant": best["variant"] if best else None,
            "best_attainment": closest["slo_attainment"] if closest else None,
            "runs": runs,
        }
    return out


def search_summary(variants: Sequence[Any], ran: Mapping[int, tuple], goal: float | None) -> dict[str, Any]:
    """What the bisection of one policy's `equalSlo.search` did: the variants in order, those it ran (with their
    attainment) in the order of the list, the first that reaches `goal`, and whether the runs kept the order."""
    b = search.Bisection(len(variants), goal, {i: got[0]["slo_attainment"] for i, got in ran.items()})
    found = b.found()
    return {
        "variants": [v.variant for v in variants],
        "ran": [
            {
                "variant": variants[i].variant,
                "slo_attainment": ran[i][0]["slo_attainment"],
                **({"stopped": ran[i][0]["stopped"]} if ran[i][0].get("stopped") else {}),
            }
            for i in sorted(ran)
        ],
        "first_reaching": variants[found].variant if found is not None else None,
        "monotone": b.monotone(),
    }


def comparison_text(cmp: Mapping[str, Any], conditions: str) -> str:
    saving = cmp["saving"]
    if saving is None:
        return f"{cmp['candidate']} vs {cmp['baseline']}: no tokens served, no comparison.\n"
    word = "cheaper" if saving >= 0 else "more expensive"
    text = (
        f"{cmp['candidate']} costs ${cmp['candidate_cost_per_1m_tokens']:.4f} per 1M generated tokens against "
        f"${cmp['baseline_cost_per_1m_tokens']:.4f} for {cmp['baseline']} ({1 - saving:.3f}x): {abs(saving):.1%} "
        f"{word}, at SLO "
        f"attainment {cmp['candidate_slo_attainment']:.2%} vs {cmp['baseline_slo_attainment']:.2%}. "
    )
    eq = cmp.get("equal_slo_saving")
    if "equal_slo_saving" in cmp:
        text += f"At equal SLO attainment (>= {cmp['equal_slo_attainment']:.2%}): " + (
            f"{abs(eq):.1%} {'cheaper' if eq >= 0 else 'more expensive'} "
            f"(${cmp['candidate_equal_slo_cost_per_1m_tokens']:.4f} against "
            f"${cmp['baseline_equal_slo_cost_per_1m_tokens']:.4f}). "
            if eq is not None
            else "no configuration swept reaches it for one of the two. "
        )
    return text + f"Conditions: {conditions}\n"


# --- output ----------------------------------------------------------------------------------------------


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def print_equal_slo(eq: Mapping[str, Any], console: Any = None) -> None:
    """Every run of the equal-SLO sweep and each policy's cheapest that reaches the target's attainment."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(
        title=f"equal SLO attainment: the cheapest run reaching {eq['target']}'s "
        f"{_fmt(eq['target_attainment'], '{:.2%}')}"
    )
    for col in ("policy", "variant", "$/1M tok", "SLO att.", "chosen"):
        t.add_column(col)
    for name, p in eq["policies"].items():
        for r in p["runs"]:
            t.add_row(
                name,
                r["variant"],
                _fmt(r["cost_per_1m_tokens"], "${:.4f}"),
                stopped_text(r["stopped"]) if r.get("stopped") else _fmt(r["slo_attainment"], "{:.2%}"),
                "<-" if p["variant"] == r["variant"] else "",
            )
    console.print(t)
    for name, got in (eq.get("search") or {}).items():
        skipped = [v for v in got["variants"] if v not in {r["variant"] for r in got["ran"]}]
        console.print(
            f"search {name}: {len(got['ran'])} of {len(got['variants'])} variants run (bisection, least to "
            f"most headroom); the first reaching the target: {got['first_reaching'] or 'none'}"
            + ("" if got["monotone"] else "; NOTE the runs contradict the list's order")
            + (f"; not run: {', '.join(skipped)}" if skipped else ""),
            highlight=False,
            markup=False,
        )


def stopped_text(st: Mapping[str, Any]) -> str:
    """A stopped run's attainment column: the bound it showed and when."""
    return (
        f"<= {st['slo_attainment_at_most']:.2%} (stopped at {st['at_s'] / 3600:.1f} h: "
        f"{st['misses']:,} misses > {st['allowed_misses']:,})"
    )


def print_tables(entries: Mapping[str, Mapping[str, Any]], console: Any = None) -> None:
    """The summary per policy and accelerator-hours by class, as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="pdfleet simulate: per policy", show_lines=False)
    for col in (
        "policy",
        "$/1M tok",
        "$ total",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "SLO att.",
        "scale up/down",
        "P:D mean",
        "rejected",
        "requests",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, e in entries.items():
        t.add_row(
            name,
            _fmt(e["cost_per_1m_tokens"], "${:.4f}"),
            _fmt(e["cost_usd"], "${:,.0f}"),
            _fmt(e["ttft_p50_s"], "{:.3f}s"),
            _fmt(e["ttft_p99_s"], "{:.3f}s"),
            _fmt(e["itl_p50_s"], "{:.1f}ms", 1000),
            _fmt(e["itl_p99_s"], "{:.1f}ms", 1000),
            _fmt(e["slo_attainment"], "{:.2%}"),
            f"{e['scale_events']['up']}/{e['scale_events']['down']}",
            _fmt(e["pd_ratio"]["mean"], "{:.2f}"),
            f"{e['rejected']:,}",
            f"{e['requests']:,}",
        )
    console.print(t)
    classes = sorted({c for e in entries.values() for c in e["accelerator_hours"]})
    h = Table(title="accelerator-hours by class (units x hours; $ in brackets)")
    h.add_column("class")
    for name in entries:
        h.add_column(name, justify="right")
    for c in classes:
        h.add_row(
            c,
            *[
                (
                    f"{e['accelerator_hours'][c]:,.1f} (${e['cost_by_class_usd'][c]:,.0f})"
                    if c in e["accelerator_hours"]
                    else "-"
                )
                for e in entries.values()
            ],
        )
    console.print(h)


def _fmt(x: float | None, pattern: str, scale: float = 1.0) -> str:
    return "-" if x is None else pattern.format(x * scale)


@dataclass(frozen=True)
class PlotData:
    """What the plots need of one run, small enough to come back from a worker process."""

    name: str
    hours: np.ndarray  # sample times, hours since the measured start
    replicas: dict[str, np.ndarray]  # "deployment/role/class" -> pods at each sample
    waiting: dict[str, np.ndarray]  # "deployment/role" -> requests waiting at each sample
    cost_per_hour: np.ndarray
    cumulative_hours: np.ndarray
    cumulative_cost: np.ndarray
    trace_hours: np.ndarray  # the trace's request rate (the same for every policy)
    trace_rate: np.ndarray


def plot_data(sim: Simulator) -> PlotData:
    t = (np.array([s.t for s in sim.samples]) - sim.warmup) / 3600.0
    keys = sorted({k for s in sim.samples for k in s.replicas})
    queues = sorted({k for s in sim.samples for k in s.waiting})
    ct, cum = cost_series(sim)
    tt, rate = sim.trace.rate_series(max(60.0, sim.trace.duration / 400))
    keep = tt >= sim.warmup
    return PlotData(
        sim.policy.name,
        t,
        {k: np.array([s.replicas.get(k, 0) for s in sim.samples], dtype=float) for k in keys},
        {k: np.array([s.waiting.get(k, 0.0) for s in sim.samples]) for k in queues},
        np.array([s.cost_per_hour for s in sim.samples]),
        (ct - sim.warmup) / 3600.0,
        cum,
        (tt[keep] - sim.warmup) / 3600.0,
        rate[keep],
    )


def plot(runs: Sequence[Simulator | PlotData], out: Path) -> list[Path]:
    """replicas.png, queues.png and cost.png with one row per policy; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [r if isinstance(r, PlotData) else plot_data(r) for r in runs]
    paths = []
    n = len(data)
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.8 * n + 0.6), sharex=True, squeeze=False)
    for ax, d in zip(axes[:, 0], data):
        if d.replicas:
            ax.stackplot(d.hours, np.array(list(d.replicas.values())), labels=list(d.replicas), step="post", alpha=0.85)
        ax.set_title(f"{d.name}: pods per pool (deployment/role/class)", fontsize=9)
        ax.set_ylabel("replicas")
        ax.legend(loc="upper left", fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("hours since the measured start")
    fig.tight_layout()
    paths.append(_save(fig, out / "replicas.png"))

    fig, axes = plt.subplots(n, 1, figsize=(11, 2.6 * n + 0.6), sharex=True, squeeze=False)
    for ax, d in zip(axes[:, 0], data):
        for k, ys in d.waiting.items():
            ax.plot(d.hours, ys, label=f"{k} waiting", lw=1)
        ax.set_title(f"{d.name}: requests waiting per role", fontsize=9)
        ax.set_ylabel("requests")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("hours since the measured start")
    fig.tight_layout()
    paths.append(_save(fig, out / "queues.png"))

    fig, (rate_ax, cum_ax) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for d in data:
        rate_ax.step(d.hours, d.cost_per_hour, where="post", label=d.name, lw=1.2)
        cum_ax.plot(d.cumulative_hours, d.cumulative_cost, label=d.name, lw=1.2)
    rate_ax.set_ylabel("$/h (pods holding accelerators)")
    rate_ax.legend(fontsize=8)
    rate_ax.set_title("cost over time", fontsize=9)
    cum_ax.set_ylabel("cumulative $")
    cum_ax.set_xlabel("hours")
    if data:
        twin = rate_ax.twinx()
        twin.plot(data[0].trace_hours, data[0].trace_rate, color="grey", lw=0.6, alpha=0.6)
        twin.set_ylabel("requests/s (trace)", color="grey")
    fig.tight_layout()
    paths.append(_save(fig, out / "cost.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
