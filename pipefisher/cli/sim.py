"""``pipefisher simulate | compare | demo | plot | trace``: what K-FAC will cost, before a real run.

Heavy imports (matplotlib) happen inside the commands, so ``pipefisher --help`` stays fast.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import click

from pipefisher.cli._common import margin_option, old_name, order_option, staleness_for, staleness_option
from pipefisher.cli.group import main
from pipefisher.cli.schedule import _policy_help
from pipefisher.errors import InputError
from pipefisher.schedule.problem import DEFAULT_MARGIN

DEFAULT_CONFIG = "bert-base-4stages"


def bundled_config(name: str | None = None) -> str:
    """Path of the cost model ``--config`` names: a file, or a model shipped in ``pipefisher/bundled/cost_models/``
    (package data, so the defaults work in an installed package, not only in a clone)."""
    from pipefisher.bundled import cost_model_path

    return cost_model_path(name)


def _config_help() -> str:
    from pipefisher.bundled import cost_model_names

    return (f"cost model: a YAML file, or a bundled one by name ({', '.join(cost_model_names())}) "
            f"[default: {DEFAULT_CONFIG}]")


def _cost_model(path: str) -> Any:
    """The cost model in ``path``; a run config given instead (both are YAML, both say ``--config``) is said
    to be one, with what this ``--config`` takes, rather than its sections listed as unknown keys."""
    from pipefisher.bundled import cost_model_names
    from pipefisher.runtime.job.config import is_run_config  # plain dataclasses, no torch
    from pipefisher.safe_io import load_yaml
    from pipefisher.sim import load_cost_model

    try:
        return load_cost_model(path)
    except InputError:
        data = load_yaml(path)
        if isinstance(data, dict) and "layers" not in data and is_run_config(data):
            raise InputError(path, "is a run config (for pipefisher train and run), not a cost model: this "
                                   "--config takes a cost model, a YAML file of per-layer and K-FAC times (layers, "
                                   "kfac, ...: docs/simulating.md), or a bundled one by name ("
                                   + ", ".join(cost_model_names()) + ")") from None
        raise


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(None, f"{what} must be comma-separated whole numbers, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise InputError(None, f"{what} must be whole numbers >= 1, got '{text}'")
    return values


def _mkdir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise InputError(path, f"cannot be created ({err.strerror or err})") from None


# ----------------------------------------------------------------------------------------------------
# simulate


def run_simulate(config: str, order: str | None, stages: int | None, micro_batches: int | None,
                 chunks: int | None, latency_ms: float | None, kfac_scale: float | None, out: str,
                 prefix: str | None, echo: Callable[[str], None] = click.echo) -> list[str]:
    from pipefisher.cli._outputs import check_out_folder
    from pipefisher.sim import simulate_timelines, write_timelines
    from pipefisher.sim.simulator import default_prefix, stale_node_files

    check_out_folder(out, "--out")
    if prefix is not None and (not prefix or os.sep in prefix or "/" in prefix):
        raise InputError(None, f"--prefix '{prefix}' must be a non-empty file name prefix, without '/'")
    model = _cost_model(config).replace(latency_ms=latency_ms, kfac_scale=kfac_scale)
    timelines, result = simulate_timelines(model, order, stages, micro_batches, chunks)
    pipeline = result.order
    prefix = prefix or default_prefix(model.name, pipeline)
    stale = stale_node_files(out, prefix, len(timelines))
    paths = write_timelines(out, prefix, timelines)
    chunks_note = f", {pipeline.chunks} chunks" if pipeline.chunks > 1 else ""
    echo(f"{model.name}: {pipeline.name}, {pipeline.stages} stages, {pipeline.micro_batches} micro-batches{chunks_note}")
    echo(f"pipeline time {result.makespan / 1e6:.3f} ms, bubble fraction {100 * result.bubble_fraction:.2f} %")
    echo(f"wrote {len(paths)} timelines to {os.path.join(os.path.normpath(out), prefix)}_node*_timeline.pickle"
         + (f" (removed {len(stale)} stale node file(s) of an earlier, larger job under this prefix)" if stale else ""))
    return paths


_order_options = order_option("--schedule", tail=" [default: the cost model's order]")
"""``--order`` of the commands that simulate a cost model, and its former name ``--schedule``."""


def _model_options(f: Callable) -> Callable:
    for opt in reversed([
        click.option("--config", "config", type=click.Path(dir_okay=False), default=None, help=_config_help()),
        _order_options,
        click.option("--stages", type=int, default=None, help="pipeline stages (default: the file's)"),
        click.option("--chunks", type=int, default=None,
                     help="model chunks per device (interleaved: default the file's, else 2; zb-v and "
                          "dualpipev have 2)"),
        click.option("--latency-ms", type=float, default=None, help="point-to-point latency (default: the file's)"),
        click.option("--kfac-scale", type=float, default=None, help="multiply every K-FAC cost by this"),
    ]):
        f = opt(f)
    return f


@main.command("simulate")
@_model_options
@click.option("--micro-batches", "-m", type=int, default=None, help="micro-batches per step (default: the file's)")
@click.option("--out", "out", type=click.Path(file_okay=False), required=True, help="folder for the node timelines")
@click.option("--prefix", default=None,
              help="file name prefix (default: <model>_<order>_p<stages>[_v<chunks>]_m<m>); node files of "
                   "this prefix beyond the job's nodes are removed")
def simulate_command(config: str | None, order: str | None, stages: int | None, chunks: int | None,
                     latency_ms: float | None, kfac_scale: float | None, micro_batches: int | None, out: str,
                     prefix: str | None) -> None:
    """Simulate one training step from a cost model and write per-node timelines.

    The timelines have the profiled format: pack them with ``pipefisher schedule OUT/*.pickle``.
    Flags override the file's settings.
    """
    run_simulate(bundled_config(config), order, stages, micro_batches, chunks, latency_ms, kfac_scale, out,
                 prefix)


# ----------------------------------------------------------------------------------------------------
# compare


def compare_rows(config: str, orders: Sequence[str] | None, micro_batches: Sequence[int] | None,
                 policy: str | None, stages: int | None = None, chunks: int | None = None,
                 kfac_scale: float | None = None, latency_ms: float | None = None,
                 margin: float = DEFAULT_MARGIN, staleness: Any = None) -> list[dict[str, object]]:
    """One row per (pipeline order, micro-batch count): bubble fraction, K-FAC cycle length and usage; with the
    job's staleness curve (``target``), the expected time to the target relative to first-order too."""
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.schedule.timeline import job_from_dicts
    from pipefisher.sim import order_names, simulate_timelines

    model = _cost_model(config).replace(stages=stages, kfac_scale=kfac_scale, latency_ms=latency_ms)
    chosen = get_policy(policy or DEFAULT_POLICY, staleness=staleness)
    names = list(orders) if orders else order_names()
    counts = list(micro_batches) if micro_batches else sorted({model.stages, 2 * model.stages, 4 * model.stages})
    rows: list[dict[str, object]] = []
    for name in names:
        for m in counts:
            row: dict[str, object] = {"order": name, "micro_batches": m}
            try:
                timelines, result = simulate_timelines(model, name, None, m, chunks)
            except InputError as err:
                if "unknown pipeline order" in str(err) or "layers cannot fill" in str(err):
                    raise
                row["error"] = err.problem
                rows.append(row)
                continue
            packed = chosen.pack(job_from_dicts(timelines), margin)
            its = [n.figures.iterations for n in packed.nodes]
            usage = [n.figures.usage for n in packed.nodes]
            row.update({
                "chunks": result.order.chunks,
                "pipeline_ms": result.makespan / 1e6,
                "bubble_percent": 100 * result.bubble_fraction,
                "cycle_iterations": max(its),
                "usage_percent_mean": sum(usage) / len(usage),
                "usage_percent_min": min(usage),
                "refresh_ms": max(its) * result.makespan / 1e6,
            })
            if staleness is not None and packed.tradeoff is not None:
                rel = packed.tradeoff.chosen.relative_time
                row["time_to_target"] = None if rel is None or rel == float("inf") else rel
            rows.append(row)
    return rows


def format_compare(rows: Sequence[dict[str, object]], title: str) -> list[str]:
    predicted = any("time_to_target" in r for r in rows)  # only with the job's staleness curve
    head = f"{'order':<12} {'m':>4} {'pipeline ms':>12} {'bubble %':>9} {'K-FAC cycle':>12} {'usage % (mean/min)':>19} {'refresh ms':>11}"
    head += f" {'time to target':>15}" if predicted else ""
    out = [title, head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['order']:<12} {r['micro_batches']:>4}   n/a: {r['error']}")
            continue
        usage = f"{r['usage_percent_mean']:.1f} / {r['usage_percent_min']:.1f}"
        line = (f"{r['order']:<12} {r['micro_batches']:>4} {r['pipeline_ms']:>12.1f} {r['bubble_percent']:>9.1f} "
                f"{str(r['cycle_iterations']) + ' it.':>12} {usage:>19} {r['refresh_ms']:>11.1f}")
        if predicted:
            rel = r.get("time_to_target")
            line += f" {'never' if rel is None else f'{rel:.3f}':>15}"
        out.append(line)
    out.append("K-FAC cycle: pipeline iterations per curvature refresh (the most over nodes); "
               "refresh ms = cycle x pipeline time." + (" Time to target: expected, relative to first-order's, "
                                                        "on the staleness curve given." if predicted else ""))
    return out


@main.command("compare")
@_model_options
@click.option("--orders", default=None,
              help="comma-separated pipeline orders to compare (default: all; --order gives one)")
@old_name("--schedules", "--orders", "orders")
@click.option("--micro-batches", "-m", "micro_batches", default=None,
              help="comma-separated micro-batch counts (default: p, 2p, 4p)")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write the rows as JSON")
@margin_option()
@staleness_option()
def compare_command(config: str | None, order: str | None, stages: int | None, chunks: int | None,
                    latency_ms: float | None, kfac_scale: float | None, orders: str | None,
                    micro_batches: str | None, policy: str | None, json_path: str | None,
                    margin: float, staleness: str | None) -> None:
    """Compare pipeline orders and micro-batch counts for one cost model: the table to choose from."""
    from pipefisher.safe_io import dump_json_atomic

    if order and orders:
        raise InputError(None, "give --order (one) or --orders (several), not both")
    curve = staleness_for(staleness, policy)
    config = bundled_config(config)
    names = [s.strip() for s in orders.split(",") if s.strip()] if orders else ([order] if order else None)
    rows = compare_rows(config, names, _ints(micro_batches, "--micro-batches"), policy, stages, chunks, kfac_scale,
                        latency_ms, margin, curve)
    from pipefisher.policies import DEFAULT_POLICY

    for line in format_compare(rows, f"{os.path.basename(config)} (policy {policy or DEFAULT_POLICY})"):
        click.echo(line)
    if json_path:
        dump_json_atomic(json_path, {"config": config, "policy": policy, "rows": rows})


# ----------------------------------------------------------------------------------------------------
# plot / trace


def _charts(paths: Sequence[str], policy: str | None, packed: bool, title: str | None,  # type: ignore[no-untyped-def]
            margin: float = DEFAULT_MARGIN, allow_mixed: bool = False, out: str | None = None,
            iterations: int | None = None, node: int | None = None, measured: str | None = None,
            step: int | None = None, staleness: str | None = None):
    from pipefisher.bundled import example_timelines
    from pipefisher.cli._outputs import check_out_file
    from pipefisher.outputs.plot import chart_from_job, chart_from_measured, chart_from_schedule
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.schedule.timeline import load_job

    if step is not None and measured is None:
        raise InputError(None, "--step applies to a measurements CSV: give --measured FILE.csv")
    if measured is not None:
        if paths or packed or policy or staleness:
            raise InputError(None, "--measured draws the measurements CSV on its own: "
                                   "give no TIMELINES, --packed, --policy or --staleness with it")
        check_out_file(out, "--out")
        return chart_from_measured(measured, node=node, iterations=iterations, step=step, title=title)
    if policy:
        get_policy(policy)  # a bad name refuses before any loading
    curve = staleness_for(staleness, policy)
    if curve is not None:
        packed = True
    check_out_file(out, "--out")
    if iterations is not None and not (packed or policy):
        raise InputError(None, "--iterations applies to the packed cycle (--packed or --policy) or to "
                               "--measured steps; timelines hold one step")
    job = load_job(paths or example_timelines(), allow_mixed=allow_mixed)
    if packed or policy:
        schedule = get_policy(policy or DEFAULT_POLICY, staleness=curve).pack(job, margin)
        return chart_from_schedule(schedule, job, title, iterations=iterations, node=node)
    return chart_from_job(job, title, node=node)


def _plot_args(what: str, out_help: str) -> list:  # type: ignore[type-arg]
    """plot's and trace's options; ``what`` names what --title titles (a chart, or a trace in Perfetto)."""
    return [
        click.argument("timelines", nargs=-1),
        click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help=out_help),
        click.option("--packed", is_flag=True, help=f"{what} the packed K-FAC cycle instead of the timelines"),
        click.option("--policy", default=None, help=_policy_help() + "; for --packed (implies it)"),
        click.option("--title", default=None,
                     help="chart title" if what == "draw" else "trace title (the process name Perfetto shows)"),
        margin_option(),
        click.option("--allow-mixed", is_flag=True,
                     help="load TIMELINES even if they look like several jobs' (see pipefisher schedule)"),
        click.option("--iterations", type=click.IntRange(min=1), default=None,
                     help=f"{what} only the packed cycle's first N iterations (for long cycles); with "
                          "--measured: N steps, ending at the last (or from --step)"),
        click.option("--node", type=click.IntRange(min=0), default=None, help=f"{what} only node I"),
        click.option("--measured", type=click.Path(dir_okay=False), default=None, metavar="FILE.csv",
                     help=f"{what} a run's measurements CSV (<run>_measurements.csv) instead of TIMELINES: per "
                          "node (replica 0) a planned and a measured row, over the last complete K-FAC cycle"),
        click.option("--step", type=int, default=None, metavar="S",
                     help="with --measured: start at step S (a cycle's steps, or --iterations N)"),
        staleness_option(),
    ]


def _with(args: list) -> Callable:  # type: ignore[type-arg]
    def deco(f: Callable) -> Callable:
        for a in reversed(args):
            f = a(f)
        return f
    return deco


@main.command("plot")
@_with(_plot_args("draw", "chart file, .png or .svg"))
def plot_command(timelines: tuple[str, ...], out: str, packed: bool, policy: str | None, title: str | None,
                 margin: float, allow_mixed: bool = False, iterations: int | None = None,
                 node: int | None = None, measured: str | None = None, step: int | None = None,
                 staleness: str | None = None) -> None:
    """Draw a Gantt chart (PNG or SVG, by OUT's suffix) of TIMELINES, or of their packed schedule.

    One row per node; forwards, backwards and each K-FAC kind in their own colours; idle time
    (bubbles) light grey; dashed lines at iteration boundaries; a red row label where a node's packed
    schedule does not validate. Work closer than a pixel is drawn merged, so charts of long cycles stay
    readable; --iterations and --node zoom in. With no TIMELINES, draws the bundled example.

    With --measured FILE.csv (a run's measurements), draws per node a planned row and a measured row
    over consecutive steps; a forward's or backward's wait for its input is drawn idle, and measured
    K-FAC work that overran its bubble is outlined red.
    """
    from pipefisher.outputs.plot import render

    if os.path.splitext(out)[1].lower() not in (".png", ".svg"):
        raise InputError(out, "chart files must end in .png or .svg")
    render(_charts(timelines, policy, packed, title, margin, allow_mixed, out, iterations, node, measured, step,
                   staleness), out)
    click.echo(f"wrote {os.path.normpath(out)}")


@main.command("trace")
@_with(_plot_args("trace", "trace file (JSON; open it in ui.perfetto.dev or chrome://tracing)"))
def trace_command(timelines: tuple[str, ...], out: str, packed: bool, policy: str | None, title: str | None,
                  margin: float, allow_mixed: bool = False, iterations: int | None = None,
                  node: int | None = None, measured: str | None = None, step: int | None = None,
                  staleness: str | None = None) -> None:
    """Write TIMELINES (or their packed schedule, or --measured steps) as Chrome trace / Perfetto JSON (compact)."""
    from pipefisher.outputs.trace import format_size, write_trace

    write_trace(_charts(timelines, policy, packed, title, margin, allow_mixed, out, iterations, node, measured,
                        step, staleness), out)
    click.echo(f"wrote {os.path.normpath(out)} ({format_size(os.path.getsize(out))})")


# ----------------------------------------------------------------------------------------------------
# demo


def run_demo(config: str | None, order: str | None, micro_batches: int | None, policy: str | None, out: str,
             echo: Callable[[str], None] = click.echo, margin: float = DEFAULT_MARGIN,
             staleness: str | None = None) -> dict[str, str]:
    """Simulate a bundled model, pack it, report, and write everything into ``out``. ``staleness``: the
    ``--staleness`` text (a curve file or ``k:ratio,...``); without it nothing predicts a time-to-target."""
    from pipefisher.outputs.plot import chart_from_job, chart_from_schedule, render
    from pipefisher.outputs.report import report_data, usage_lines
    from pipefisher.outputs.trace import write_trace
    from pipefisher.policies import DEFAULT_POLICY, get_policy
    from pipefisher.policies.packing import pack_job
    from pipefisher.safe_io import dump_json_atomic, write_atomic
    from pipefisher.schedule.timeline import load_job
    from pipefisher.sim import simulate_timelines, write_timelines

    from pipefisher.cli._outputs import check_out_folder
    from pipefisher.sim.simulator import default_prefix

    # options and the output folder first: no work is wasted
    chosen = get_policy(policy or DEFAULT_POLICY, staleness=staleness_for(staleness, policy))
    check_out_folder(out, "--out")
    config = bundled_config(config)
    model = _cost_model(config)
    timelines, result = simulate_timelines(model, order, None, micro_batches)
    pipeline = result.order
    _mkdir(out)
    paths = write_timelines(os.path.join(out, "timelines"), default_prefix(model.name, pipeline), timelines)
    job = load_job(paths)
    packing = pack_job(job, chosen, margin)
    packed = packing.schedule
    lines = [
        f"{model.name}: {pipeline.name}, {pipeline.stages} stages, {pipeline.micro_batches} micro-batches "
        f"(cost model {os.path.basename(config)})",
        f"simulated pipeline time {result.makespan / 1e6:.1f} ms, bubble fraction {100 * result.bubble_fraction:.1f} %",
        f"packed with policy '{chosen.name}':",
        *usage_lines(packed, job),
    ]
    for line in lines:
        echo(line)
    files = {
        "schedule": os.path.join(out, "schedule.pickle"),
        "report": os.path.join(out, "report.txt"),
        "report_json": os.path.join(out, "report.json"),
        "chart": os.path.join(out, "chart.png"),
        "timelines_chart": os.path.join(out, "timelines.png"),
        "trace": os.path.join(out, "trace.json"),
    }
    packing.save(files["schedule"])
    write_atomic(files["report"], "\n".join(lines) + "\n")
    dump_json_atomic(files["report_json"], report_data(packed, job))
    title = f"{model.name}, {pipeline.name}, m={pipeline.micro_batches}: K-FAC packed into bubbles (policy {chosen.name})"
    schedule_chart = chart_from_schedule(packed, job, title)
    render(schedule_chart, files["chart"])
    update = ", update" if model.end_of_step_ns(1) != (0, 0) else ""
    render(chart_from_job(job, f"{model.name}, {pipeline.name}, m={pipeline.micro_batches}: simulated step "
                               f"(pipeline, naive K-FAC{update})"), files["timelines_chart"])
    write_trace(schedule_chart, files["trace"])
    echo(f"wrote {len(paths)} timelines, the schedule, the report, charts and a trace to {os.path.join(os.path.normpath(out), '')}")
    return files


@main.command("demo")
@click.option("--config", type=click.Path(dir_okay=False), default=None, help=_config_help())
@_order_options
@click.option("--micro-batches", "-m", type=int, default=None, help="micro-batches (default: the file's)")
@click.option("--policy", default=None, help=_policy_help())
@click.option("--out", type=click.Path(file_okay=False), default="pipefisher-demo", show_default=True,
              help="output folder")
@margin_option()
@staleness_option()
def demo_command(config: str | None, order: str | None, micro_batches: int | None, policy: str | None,
                 out: str, margin: float, staleness: str | None) -> None:
    """Simulate a bundled BERT model, pack its K-FAC work, print the report, and save it all (with a chart)."""
    run_demo(config, order, micro_batches, policy, out, margin=margin, staleness=staleness)
