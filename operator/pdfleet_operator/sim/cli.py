"""`pdfleet simulate`: argument parsing and the run (trace -> policies -> report.json, tables, plots); `register(subparsers)` adds it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pdfleet_operator import trace as tr
from pdfleet_operator.api import parse_duration
from pdfleet_operator.sim import calibration, report
from pdfleet_operator.sim import fleet as fleet_file
from pdfleet_operator.sim.simulator import Simulator


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate a fleet and policies on a request trace: $ per 1M tokens, TTFT/ITL, SLO attainment",
        description="Drive the operator's placement, autoscaler and rollback code against a simulated fleet "
                    "(examples/sim/fleet-100.yaml) and a request trace; write DIR/report.json and PNG plots.")
    p.add_argument("--fleet", required=True, metavar="FILE", help="SimulatedFleet YAML (nodes, classes, deployment, policies)")
    p.add_argument("--trace", required=True, metavar="conversation|code|FILE.csv",
                   help="a synthetic preset or a CSV of timestamp,prompt_tokens,output_tokens")
    p.add_argument("--policy", nargs="+", metavar="NAME", help="policies of the fleet file to run (default: the first)")
    p.add_argument("--compare", action="store_true", help="run the fleet file's comparison set side by side")
    p.add_argument("--out", required=True, metavar="DIR", help="where report.json and the plots go")
    p.add_argument("--duration", metavar="SPAN", help="simulated time, e.g. 1d, 6h, 900s (default: the fleet file's trace.duration)")
    p.add_argument("--rate", type=float, metavar="REQ_PER_S", help="mean request rate of a synthetic trace over a day")
    p.add_argument("--start-hour", type=float, metavar="H", help="hour of day a synthetic trace starts at")
    p.add_argument("--warmup", metavar="SPAN",
                   help="unmeasured lead-in that brings the fleet to a steady state: a synthetic trace is generated "
                        "that much earlier (default 30m); for a CSV, its first SPAN is left out (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the synthetic trace and the tier split")
    p.add_argument("--calibration", nargs="+", default=[], metavar="FILE",
                   help="benchmark JSON (bench/sim.py calibrate, bench/engine.py, bench/pd.py) to calibrate classes")
    p.add_argument("--save-trace", metavar="FILE.csv", help="also write the trace as CSV (to replay it elsewhere)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


DEFAULT_WARMUP_S = 1800.0


def _trace(args: argparse.Namespace, fl: fleet_file.Fleet) -> tuple[tr.Trace, float]:
    """The trace to run and its unmeasured lead-in (seconds at its start)."""
    duration = tr.parse_span(args.duration) if args.duration else None
    if args.trace in tr.PRESETS:
        warmup = tr.parse_span(args.warmup) if args.warmup else DEFAULT_WARMUP_S
        start = fl.trace.start_hour if args.start_hour is None else args.start_hour
        got = tr.synthetic(args.trace, mean_rate=args.rate or fl.trace.mean_rate,
                           duration=(duration or fl.trace.duration_s) + warmup, seed=args.seed,
                           start_hour=start - warmup / 3600.0)
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
    used = sorted({c for p in policies for d in p.deployments for rs in d.spec.roles().values()
                   for c in rs.accelerator_classes})
    console.print(f"fleet {fl.name}: {len(fl.nodes)} nodes, {fl.devices} accelerators; trace {trace.name}: "
                  f"{len(trace):,} requests over {trace.duration / 3600:.2f} h (mean {trace.mean_rate:.2f}/s), "
                  f"the first {warmup / 60:.0f} min a warm-up", 
                  highlight=False)
    calibration.print_table(used, effs, console)

    sims: list[Simulator] = []
    entries: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}
    for policy in policies:
        started = time.perf_counter()
        sim = _run_one(fl, policy, trace, warmup, effs, args, console)
        walls[policy.name] = round(time.perf_counter() - started, 2)
        sims.append(sim)
        entries[policy.name] = report.summarize(sim)
        console.print(f"  {policy.name}: simulated in {walls[policy.name]:.1f} s", highlight=False)

    report.print_tables(entries, console)
    comparison = None
    pair = fl.headline if fl.headline and all(n in entries for n in fl.headline) else None
    if pair is None and len(entries) > 1:
        pair = (names[0], names[-1])
    if pair:
        comparison = report.compare(entries, *pair)
        comparison["conditions"] = conditions(fl, policies, trace, warmup, args)
        comparison["text"] = report.comparison_text(comparison, comparison["conditions"])
        console.print(comparison["text"], highlight=False)
    doc = {
        "fleet": fl.name, "fleet_file": str(args.fleet), "nodes": len(fl.nodes), "devices": fl.devices,
        "trace": {"name": trace.name, "source": args.trace, "requests": len(trace), "duration_s": trace.duration,
                  "warmup_s": warmup, "mean_rate": round(trace.mean_rate, 4), "seed": args.seed},
        "calibration": {row[0]: dict(zip(("prefill_mfu", "decode_mbu", "step_overhead", "http_hop", "kv_link", "source"), row[1:]))
                        for row in calibration.rows(used, effs)},
        "policies": entries,
        "comparison": comparison,
        "wall_s": walls,
    }
    report.write_json(out / "report.json", doc)
    written = [out / "report.json"]
    if not args.no_plots:
        written += report.plot(sims, out)
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)
    return 0


def _run_one(fl: fleet_file.Fleet, policy: fleet_file.Policy, trace: tr.Trace, warmup: float, effs: dict,
             args: argparse.Namespace, console: Any) -> Simulator:
    if args.quiet or not console.is_terminal:
        return Simulator(fl, policy, trace, efficiencies=effs, seed=args.seed, warmup_s=warmup).run()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}% of simulated time"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(policy.name, total=trace.duration)
        return Simulator(fl, policy, trace, efficiencies=effs, seed=args.seed, warmup_s=warmup,
                         progress=lambda t: bar.update(task, completed=t)).run()


def conditions(fl: fleet_file.Fleet, policies: list[fleet_file.Policy], trace: tr.Trace, warmup: float,
               args: argparse.Namespace) -> str:
    """The exact conditions of a comparison, for the README."""
    dep = policies[0].deployments[0].spec
    arch = dep.model.architecture
    slos = sorted({(d.spec.slo.ttft, d.spec.slo.itl) for p in policies for d in p.deployments})
    model = f"{dep.model.name} ({arch.parameters_billions:g}B, {dep.model.dtype})" if arch else dep.model.name
    return (f"`pdfleet simulate --fleet {args.fleet} --trace {args.trace}"
            + (f" --duration {args.duration}" if args.duration else "")
            + (f" --rate {args.rate:g}" if args.rate else "")
            + f" --seed {args.seed}`; fleet {fl.name} ({fl.devices} accelerators on {len(fl.nodes)} nodes); "
            f"{int((trace.arrival >= warmup).sum()):,} requests over {(trace.duration - warmup) / 3600:.1f} h of the "
            f"{trace.name} trace (after a {warmup / 60:.0f}-min unmeasured warm-up); model {model}; "
            f"SLO per request " + ", ".join(f"TTFT <= {a} and time per output token <= {b}" for a, b in slos)
            + f"; prices = AcceleratorClass costPerHour; pod start-up {fl.settings.startup_s:g} s; "
            f"autoscaling interval {parse_duration(dep.autoscaling.interval):g} s.")


def main(argv: list[str] | None = None) -> int:
    """`python -m pdfleet_operator.sim.cli ...` until the lead wires `simulate` into `pdfleet`."""
    parser = argparse.ArgumentParser(prog="pdfleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
