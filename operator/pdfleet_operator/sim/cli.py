"""`pdfleet simulate`: argument parsing and the run (trace -> policies -> report.json, tables, plots);
`register(subparsers)` adds it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from pdfleet_operator import trace as tr
from pdfleet_operator.api import parse_duration
from pdfleet_operator.decide import runtimes
from pdfleet_operator.sim import calibration, native, report, search
from pdfleet_operator.sim import fleet as fleet_file
from pdfleet_operator.sim.simulator import Simulator


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a fleet and policies on a request trace: $ per 1M tokens, TTFT/ITL, SLO attainment",
        description="Drive the operator's placement, autoscaler and rollback code against a simulated fleet "
        "(examples/sim/fleet-100.yaml) and a request trace; write DIR/report.json and PNG plots.",
    )
    p.add_argument(
        "--fleet", required=True, metavar="FILE", help="SimulatedFleet YAML (nodes, classes, deployment, policies)"
    )
    p.add_argument(
        "--trace",
        required=True,
        metavar="conversation|code|FILE.csv",
        help="a synthetic preset or a CSV of timestamp,prompt_tokens,output_tokens",
    )
    p.add_argument("--policy", nargs="+", metavar="NAME", help="policies of the fleet file to run (default: the first)")
    p.add_argument("--compare", action="store_true", help="run the fleet file's comparison set side by side")
    p.add_argument("--out", required=True, metavar="DIR", help="where report.json and the plots go")
    p.add_argument(
        "--duration",
        metavar="SPAN",
        help="simulated time, e.g. 1d, 6h, 900s (default: the fleet file's trace.duration)",
    )
    p.add_argument("--rate", type=float, metavar="REQ_PER_S", help="mean request rate of a synthetic trace over a day")
    p.add_argument("--start-hour", type=float, metavar="H", help="hour of day a synthetic trace starts at")
    p.add_argument(
        "--warmup",
        metavar="SPAN",
        help="unmeasured lead-in that brings the fleet to a steady state: a synthetic trace is generated "
        "that much earlier (default 30m); for a CSV, its first SPAN is left out (default 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the synthetic trace and the tier split")
    p.add_argument(
        "--calibration",
        nargs="+",
        default=[],
        metavar="FILE",
        help="benchmark JSON (bench/sim.py calibrate, bench/engine.py, bench/pd.py) to calibrate classes",
    )
    p.add_argument("--save-trace", metavar="FILE.csv", help="also write the trace as CSV (to replay it elsewhere)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="processes running policies (and the equal-SLO sweep) side by side (default: the cores)",
    )
    p.add_argument(
        "--no-equal-slo",
        action="store_true",
        help="with --compare, skip the fleet file's equalSlo sweep (its fields are then absent)",
    )
    p.add_argument(
        "--full-variants",
        action="store_true",
        help="run every equal-SLO variant over the whole trace (default: a variant stops as soon as the SLO "
        "misses it has counted make the target's attainment unreachable; its cost is then not reported)",
    )
    p.set_defaults(func=run)


DEFAULT_WARMUP_S = 1800.0


def _trace(args: argparse.Namespace, fl: fleet_file.Fleet) -> tuple[tr.Trace, float]:
    """The trace to run and its unmeasured lead-in (seconds at its start)."""
    duration = tr.parse_span(args.duration) if args.duration else None
    if args.trace in tr.PRESETS:
        warmup = tr.parse_span(args.warmup) if args.warmup else DEFAULT_WARMUP_S
        start = fl.trace.start_hour if args.start_hour is None else args.start_hour
        got = tr.synthetic(
            args.trace,
            mean_rate=args.rate or fl.trace.mean_rate,
            duration=(duration or fl.trace.duration_s) + warmup,
            seed=args.seed,
            start_hour=start - warmup / 3600.0,
        )
        return got, warmup
    if args.rate or args.start_hour is not None:
        raise ValueError("--rate and --start-hour apply to synthetic traces only, not to a CSV")
    got = tr.read_csv(args.trace)
    warmup = tr.parse_span(args.warmup) if args.warmup else 0.0
    if duration:
        got = got.head(warmup + duration)
    if warmup >= got.duration:
        raise ValueError(f"--warmup {args.warmup} covers the whole trace ({got.duration:.0f} s)")
    return got, warmup


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    try:
        fl = fleet_file.load(args.fleet)
        names = list(fl.compare) if args.compare else (args.policy or [next(iter(fl.policies))])
        if args.compare and args.policy:
            names += [n for n in args.policy if n not in names]
        policies = [fl.policy(n) for n in names]
        trace, warmup = _trace(args, fl)
        effs = calibration.load(args.calibration, fl.classes)
    except (fleet_file.FleetError, tr.TraceFileError, calibration.CalibrationError, ValueError) as exc:
        print(f"pdfleet simulate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.save_trace:
        tr.write_csv(trace, args.save_trace)
    sweep = fl.equal_slo if args.compare and fl.equal_slo and not args.no_equal_slo else None
    variants = [v for p in policies for v in (sweep.variants.get(p.name, ()) if sweep else ())]
    runs = [(p, "") for p in policies] + [(v, v.variant) for v in variants]
    # the target first: the searches wait for its attainment
    order = sorted(
        range(len(runs)), key=lambda i: (not (sweep and not runs[i][1] and runs[i][0].name == sweep.target), i)
    )
    searches = {
        p.name: sweep.search[p.name] for p in policies if sweep and p.name in sweep.search and sweep.target in names
    }
    searched = [v for vs in searches.values() for v in vs]
    pools = sorted(
        {
            (runtimes.engine_of(d.spec, fl.classes[c]), c)
            for p, _ in runs
            for d in p.deployments
            for rs in d.spec.roles().values()
            for c in rs.accelerator_classes
        }
        | {
            (runtimes.engine_of(d.spec, fl.classes[c]), c)
            for p in searched
            for d in p.deployments
            for rs in d.spec.roles().values()
            for c in rs.accelerator_classes
        }
    )
    console.print(
        f"fleet {fl.name}: {len(fl.nodes)} nodes, {fl.devices} accelerators; trace {trace.name}: "
        f"{len(trace):,} requests over {trace.duration / 3600:.2f} h (mean {trace.mean_rate:.2f}/s), "
        f"the first {warmup / 60:.0f} min a warm-up; {len(runs)} run(s)"
        + (
            f" and a bisection over {len(searched)} equal-SLO variant(s) of {len(searches)} "
            f"polic{'y' if len(searches) == 1 else 'ies'}"
            if searches
            else ""
        )
        + f" in {max(1, min(args.jobs, len(runs) + len(searches)))} process(es)",
        highlight=False,
    )
    calibration.print_table(pools, effs, fl.classes, console)
    interpreted = native.note()
    if interpreted:
        print(f"note: {interpreted}", file=sys.stderr)
    for name in sorted(
        {
            f"{p.name}/{d.spec.model.name}"
            for p, _ in runs
            for d in p.deployments
            if d.spec.engine.kv_offload is not None
        }
    ):
        # NOTE: said, not silently dropped: the engine model has no prefix cache for the tiers to keep.
        console.print(
            f"note: {name}: spec.engine.kvOffload is not modelled (the simulator has no prefix cache); "
            f"preemption swap is",
            highlight=False,
        )

    started = time.perf_counter()
    done, probes = _run_all(
        fl, [runs[i] for i in order], searches, sweep.target if sweep else None, trace, warmup, effs, args, console
    )
    done = [done[order.index(i)] for i in range(len(runs))]
    total_wall = round(time.perf_counter() - started, 2)
    entries: dict[str, dict[str, Any]] = {}
    swept: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, float] = {}
    plots = []
    for (policy, variant), (summary, data, wall) in zip(runs, done):
        if variant:
            swept.setdefault(policy.name, []).append({**summary, "variant": variant})
            walls[f"{policy.name} [{variant}]"] = wall
        else:
            entries[policy.name] = summary
            walls[policy.name] = wall
            plots.append(data)
    for name, ran in probes.items():
        for i, (summary, _, wall) in sorted(ran.items()):
            swept.setdefault(name, []).append({**summary, "variant": searches[name][i].variant})
            walls[f"{name} [{searches[name][i].variant}]"] = wall
    day_wall = max(walls[p.name] for p in policies)

    report.print_tables(entries, console)
    equal = None
    if sweep is not None and sweep.target in entries:
        equal = report.equal_slo(entries, swept, sweep.target)
        equal["search"] = {
            name: report.search_summary(searches[name], probes[name], equal["target_attainment"]) for name in searches
        }
        for name, e in entries.items():
            got = equal["policies"][name]
            e["equal_slo_cost_per_1m_tokens"] = got["cost_per_1m_tokens"]
            e["equal_slo_attainment"] = got["attainment"]
            e["equal_slo_variant"] = got["variant"]
        report.print_equal_slo(equal, console)
    comparison = None
    pair = fl.headline if fl.headline and all(n in entries for n in fl.headline) else None
    if pair is None and len(entries) > 1:
        pair = (names[0], names[-1])
    if pair:
        comparison = report.compare(entries, *pair, goal=equal["target_attainment"] if equal else None)
        comparison["conditions"] = conditions(fl, policies, trace, warmup, args)
        comparison["text"] = report.comparison_text(comparison, comparison["conditions"])
        console.print(comparison["text"], highlight=False)
    n_runs = len(runs) + sum(len(ran) for ran in probes.values())
    console.print(
        f"wall: {total_wall:.1f} s for {n_runs} run(s); the policies as configured ran in "
        f"{day_wall:.1f} s each at most ({'compiled' if native.active() else 'interpreted'})",
        highlight=False,
    )
    doc = {
        "fleet": fl.name,
        "fleet_file": str(args.fleet),
        "nodes": len(fl.nodes),
        "devices": fl.devices,
        "trace": {
            "name": trace.name,
            "source": args.trace,
            "requests": len(trace),
            "duration_s": trace.duration,
            "warmup_s": warmup,
            "mean_rate": round(trace.mean_rate, 4),
            "seed": args.seed,
        },
        "calibration": {
            f"{row[1]}@{row[0]}": dict(zip(calibration.COLUMNS[2:], row[2:]))
            for row in calibration.rows(pools, effs, fl.classes)
        },
        "policies": entries,
        "equal_slo": equal,
        "comparison": comparison,
        "wall_s": walls,
        "total_wall_s": total_wall,
        "compiled": native.active(),  # the event loop compiled (sim/native.py): about twice as fast
    }
    report.write_json(out / "report.json", doc)
    written = [out / "report.json"]
    if not args.no_plots:
        written += report.plot(plots, out)
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)
    return 0


# What forked workers inherit (set just before the pool starts): the fleet, trace and calibration.
_WORK: dict[str, Any] = {}


def _run_one(job: tuple[fleet_file.Policy, str], goal: float | None = None) -> tuple[dict[str, Any], Any, float]:
    """One run in a worker: its summary, its plot data (None for a sweep variant) and its wall time. A variant
    given the target's attainment (`goal`) stops once it cannot reach it (`Simulator(stop_below=...)`)."""
    policy, variant = job
    w = _WORK
    started, cpu = time.perf_counter(), time.process_time()
    sim = Simulator(
        w["fleet"],
        policy,
        w["trace"],
        efficiencies=w["effs"],
        seed=w["seed"],
        warmup_s=w["warmup"],
        stop_below=goal if variant and not w["full_variants"] else None,
    ).run()
    summary = report.summarize(sim)
    data = None if variant or w["no_plots"] else report.plot_data(sim)
    # NOTE: CPU seconds too: on a machine other jobs share, the wall time says as much about them
    summary["run_cpu_s"] = round(time.process_time() - cpu, 2)
    return summary, data, round(time.perf_counter() - started, 2)


def _run_all(
    fl: fleet_file.Fleet,
    runs: list[tuple[fleet_file.Policy, str]],
    searches: dict[str, tuple[fleet_file.Policy, ...]],
    target: str | None,
    trace: tr.Trace,
    warmup: float,
    effs: dict,
    args: argparse.Namespace,
    console: Any,
) -> tuple[list[tuple[dict[str, Any], Any, float]], dict[str, dict[int, tuple]]]:
    """Every run of `runs`, and the bisection of each search (`sim.search`), side by side in `--jobs` processes
    (forked: they share the parsed fleet and trace). Returns the runs' results in order, and per searched
    policy the variants run (index -> result). A search waits for the target's run (its goal); when a process
    frees, a search's next variant goes first (each is one step of a chain), then the runs in order."""
    _WORK.update(
        fleet=fl,
        trace=trace,
        effs=effs,
        seed=args.seed,
        warmup=warmup,
        no_plots=args.no_plots,
        full_variants=args.full_variants,
    )
    goal: float | None = None  # the target's attainment, once its run is done
    results: list[Any] = [None] * len(runs)
    bisect = {name: search.Bisection(len(variants)) for name, variants in searches.items()}
    probes: dict[str, dict[int, tuple]] = {name: {} for name in searches}
    queue = list(range(len(runs)))
    busy: set[str] = set()  # searches with a variant running

    def next_job() -> tuple[str, int] | None:
        for name, b in bisect.items():
            i = None if name in busy else b.next()
            if i is not None:
                busy.add(name)
                return name, i
        return ("", queue.pop(0)) if queue else None

    def finished(key: tuple[str, int], got: tuple[dict[str, Any], Any, float]) -> None:
        nonlocal goal
        name, i = key
        if name:
            probes[name][i] = got
            bisect[name].attained[i] = got[0]["slo_attainment"]
            busy.discard(name)
            job = (searches[name][i], searches[name][i].variant)
        else:
            results[i] = got
            job = runs[i]
            if target is not None and not job[1] and job[0].name == target:
                goal = got[0]["slo_attainment"]
                for b in bisect.values():
                    b.goal = goal
        if not args.quiet:
            stopped = got[0].get("stopped")
            console.print(
                f"  {_label(job)}: simulated in {got[2]:.1f} s ({got[0]['run_cpu_s']:.1f} CPU-s)"
                + (
                    f", attainment {report.stopped_text(stopped)}"
                    if stopped
                    else f", attainment {_pct(got[0]['slo_attainment'])}"
                    if name or job[1]
                    else ""
                ),
                highlight=False,
                markup=False,
            )

    def job_of(key: tuple[str, int]) -> tuple[fleet_file.Policy, str]:
        name, i = key
        return (searches[name][i], searches[name][i].variant) if name else runs[i]

    jobs = max(1, args.jobs)
    if jobs == 1:
        while (key := next_job()) is not None:
            finished(key, _run_one(job_of(key), goal))
        return results, probes
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    running: dict[Any, tuple[str, int]] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        while True:
            while len(running) < jobs and (key := next_job()) is not None:
                running[pool.submit(_run_one, job_of(key), goal)] = key
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                finished(running.pop(future), future.result())
    return results, probes


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _label(run: tuple[fleet_file.Policy, str]) -> str:
    return run[0].name + (f" [{run[1]}]" if run[1] else "")


def conditions(
    fl: fleet_file.Fleet, policies: list[fleet_file.Policy], trace: tr.Trace, warmup: float, args: argparse.Namespace
) -> str:
    """The exact conditions of a comparison, for docs/planning.md and bench/README.md."""
    dep = policies[0].deployments[0].spec
    arch = dep.model.architecture
    slos = sorted({(d.spec.slo.ttft, d.spec.slo.itl) for p in policies for d in p.deployments})
    model = f"{dep.model.name} ({arch.parameters_billions:g}B, {dep.model.dtype})" if arch else dep.model.name
    return (
        f"`pdfleet simulate --fleet {args.fleet} --trace {args.trace}"
        + (f" --duration {args.duration}" if args.duration else "")
        + (f" --rate {args.rate:g}" if args.rate else "")
        + f" --seed {args.seed}`; fleet {fl.name} ({fl.devices} accelerators on {len(fl.nodes)} nodes); "
        f"{int((trace.arrival >= warmup).sum()):,} requests over {(trace.duration - warmup) / 3600:.1f} h of the "
        f"{trace.name} trace (after a {warmup / 60:.0f}-min unmeasured warm-up); model {model}; "
        f"SLO per request "
        + ", ".join(f"TTFT <= {a} and time per output token <= {b}" for a, b in slos)
        + f"; prices = AcceleratorClass costPerHour; pod start-up {fl.settings.startup_s:g} s; "
        f"autoscaling interval {parse_duration(dep.autoscaling.interval):g} s."
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m pdfleet_operator.sim.cli ...` until the lead wires `simulate` into `pdfleet`."""
    parser = argparse.ArgumentParser(prog="pdfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
