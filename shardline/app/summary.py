"""What a finished command prints: the pipeline's result (its model, metrics and where to look) and a sweep's
trials, best first."""

from __future__ import annotations

import typer


def _held(reg: dict) -> str:
    """The alias the version holds: `as @champion`, or that it holds none (a later version took it)."""
    return "(it holds no alias now)" if reg["alias"] == "none" else f"as @{reg['alias']}"


def _model_uri(reg: dict) -> str:
    return f"models:/{reg['model_name']}" + (f"/{reg['version']}" if reg["alias"] == "none" else f"@{reg['alias']}")


def summary(result: dict) -> None:
    reg = result["registered"]
    tr = result["train"]
    typer.echo("\nsteps: " + ", ".join(f"{k} {v}" for k, v in result["steps"].items()))
    typer.secho(
        f"Registered {reg['model_name']} version {reg['version']} {_held(reg)}", fg=typer.colors.GREEN, bold=True
    )
    chosen = (
        f", the checkpoint of epoch {tr['best_epoch']} (best {tr['select_by']})"
        if tr.get("best_epoch") and tr.get("select_by")
        else ""
    )
    baseline = result.get("baseline_name", "the trivial baseline")
    typer.echo(
        f"trained on {tr['device']} ({tr['precision']}), {tr['steps']} optimizer steps{chosen}; test metrics "
        f"against {baseline}:\n"
    )
    typer.echo(result["table"])
    if result.get("weak"):
        typer.secho(f"\nnote: {result['weak']}", fg=typer.colors.YELLOW)
    if tr.get("cost"):
        from shardline.core.cost.ledger import describe

        typer.echo(f"\ncost: {describe(tr['cost'])}")
    if result["snapshot"]["skipped"]:
        typer.secho(f"\nskipped {len(result['snapshot']['skipped'])} raw file(s):", fg=typer.colors.YELLOW)
        for r in result["snapshot"]["skipped"]:
            typer.echo(f"  - {r['uri']}: {r['reason']}")
    typer.echo("\nInspect it:")
    if reg.get("ui_command"):
        typer.echo(f"  {reg['ui_command']}        # serves the MLflow UI at http://127.0.0.1:5000")
    if reg.get("run_page"):
        typer.echo(f"    the run:     {reg['run_page']}")
        typer.echo(f"    the version: {reg['version_page']}")
        typer.echo('    (MLflow 3 opens on its GenAI view: pick "Model training" at the top left to list runs)')
    typer.echo(
        f"  shardline predict {_model_uri(reg)} INPUT.parquet --out predictions.parquet "
        f"--tracking-uri {reg['tracking_uri']}"
    )
    _prefect_ui()


def _prefect_ui() -> None:
    """Where this run's flow runs are: the Prefect server's UI the command talked to, or (a laptop's temporary API,
    gone with the command) how to start one."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui = PREFECT_UI_URL.value() if PREFECT_API_URL.value() else None
    if ui:
        typer.echo(f"  {ui.rstrip('/')}/runs        # the Prefect UI: this run's flow runs")
    else:
        typer.echo("  prefect server start                      # the Prefect UI; runs from now on show up there")


def sweep_summary(result: dict) -> None:
    rows, best, metric = result["trials"], result["best"], result["metric"]
    typer.echo("\nsteps: " + ", ".join(f"{k} {v}" for k, v in result["steps"].items()))
    where = (
        f"{result['at_once']} at once here, {result['cpu_threads']} torch thread(s) each"
        if result["cpu_threads"]
        else f"{result['at_once']} at once on the training deployment's pool"
    )
    better = "higher" if result["direction"] == "maximize" else "lower"
    typer.echo(
        f"sweep {result['sweep_id']}: {len(rows)} {result['mode']} trial(s) over {', '.join(result['keys'])}, "
        f"{where}; compared by {metric} on the validation split ({better} is better)\n"
    )
    width = max(len(r["trial"]) for r in rows)
    for r in rows:
        score = f"{r['score']:.4f}" if r.get("score") is not None else "-"
        label = " ".join(f"{k}={v}" for k, v in r["overrides"].items())
        mark = "  <- best" if r["trial"] == best["trial"] else ""
        line = f"  {r['trial'].ljust(width)}  {score:>9}  {r['state']:<6}  {label}{mark}"
        typer.secho(line, fg=typer.colors.RED if r["state"] == "failed" else None, bold=bool(mark))
    if result.get("settings"):
        typer.echo(f"\ncross-validation: each setting's {metric} over the folds, mean ± std (chosen by the mean):")
        for st in result["settings"]:
            label = " ".join(f"{k}={v}" for k, v in st["setting"].items()) or "(the config as it is)"
            mean = f"{st['score']:.4f} ± {st['std']:.4f}" if st["score"] is not None else "failed"
            mark = "  <- best" if st["trial"] == best["trial"] else ""
            typer.secho(f"  {st['trial']}  {mean:>17}  {label}{mark}", bold=bool(mark))
        typer.echo("  the best setting retrained on all non-test data (training.fold: null) as trial 'final'")
    total = result.get("cost")
    if total:
        usd = "unpriced" if total["usd"] is None else f"about {total['usd']:.3g} USD"
        wasted = f" ({total['gpu_hours_wasted']:.3g} wasted)" if total["gpu_hours_wasted"] else ""
        typer.echo(
            f"\ncost of the trials' training: {total['gpu_hours']:.3g} GPU-hours{wasted}, {usd}, over "
            f"{total['runs']} run(s) (an estimate; each trial's own is on its MLflow run)"
        )
    failed = [r for r in rows if r["state"] == "failed"]
    if failed:
        typer.secho(f"\n{len(failed)} trial(s) failed (the others were compared):", fg=typer.colors.YELLOW)
        for r in failed:
            typer.echo(f"  - {r['trial']}: {r['error']}")
    stopped = [r["trial"] for r in rows if r["state"] == "budget"]
    if stopped:
        typer.secho(
            f"\n{len(stopped)} trial(s) stopped at their budget ({', '.join(stopped)}), after a checkpoint: raise "
            "training.max_hours or max_cost and run the same command again to finish them",
            fg=typer.colors.YELLOW,
        )
    reg = result["registered"]
    typer.echo("")
    typer.secho(
        f"Best {best['trial']} registered as {reg['model_name']} version {reg['version']} "
        f"({'no alias now' if reg['alias'] == 'none' else '@' + reg['alias']}); "
        f"its test metrics against {result.get('baseline_name', 'the trivial baseline')}:\n",
        fg=typer.colors.GREEN,
        bold=True,
    )
    typer.echo(result["table"])
    typer.echo("\nInspect it:")
    if reg.get("ui_command"):
        typer.echo(f"  {reg['ui_command']}        # serves the MLflow UI at http://127.0.0.1:5000")
    if result.get("parent_page"):
        typer.echo(f"    the sweep (its trials nested under it): {result['parent_page']}")
    if reg.get("version_page"):
        typer.echo(f"    the version: {reg['version_page']}")
    typer.echo(f"  the comparison picture: {result['plot']}")
