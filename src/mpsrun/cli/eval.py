"""`eval`: a logged model on a dataset section; prints the metrics and logs them as a run linked to the model."""

from __future__ import annotations

from typing import List, Optional

import typer

from mpsrun.cli.common import EXIT_FAIL, app, bad_input, console, err, recipe_errors


@app.command(name="eval")
def eval_(
    target: str = typer.Argument(..., help="A run ID (its logged model), runs:/RUN_ID/model, or models:/NAME/VERSION.", show_default=False),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Dataset overrides on the training run's recipe, e.g. dataset.root=/data dataset.val_fraction=0.5; batch_size=N.", show_default=False
    ),
    split: str = typer.Option("val", "--split", help="Which split of the dataset to evaluate on: val, test (where the dataset has one) or train."),
    device: str = typer.Option("auto", "--device", help="Device to evaluate on (auto: the best available, else cpu)."),
    tracking_uri: Optional[str] = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns/mlflow.db."
    ),
) -> None:
    """Evaluate a logged model on a dataset section and log the result as a new run linked to the model.

    The training run's own loss and task metrics: eval_accuracy for classification; eval_mae, eval_rmse, eval_r2 (in the target's units) for regression.
    """
    from mpsrun.train import eval_run
    from mpsrun.train.runner import InputError

    try:
        with recipe_errors():
            res = eval_run.evaluate(target, overrides or [], tracking_uri, device=device, split=split)
    except InputError as e:
        raise bad_input(str(e)) from None
    except typer.Exit:
        raise
    except Exception as e:  # a model that does not load or run on this data: a failure, said plainly
        err.print(f"[red]failed:[/] {type(e).__name__}: {e}", highlight=False)
        raise typer.Exit(EXIT_FAIL) from None
    console.print(f"eval {res.model_uri} (trained in run {res.source_run_id}) on the {res.split} split, {res.samples} samples, {res.device}", highlight=False)
    for k, v in res.metrics.items():
        console.print(f"  {k:<16} {v:.6g}", highlight=False)
    console.print(f"MLflow: run {res.run_id} in experiment {res.experiment_id}, linked to the model", highlight=False)
