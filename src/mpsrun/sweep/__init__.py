"""The sweep wing: `mpsrun sweep` searches a recipe's `sweep:` section with Optuna, every trial an MLflow child run.

space (search space, sampler, pruner) and storage (Optuna storages, lost trials, the budget)
at the bottom; trial (one trial in this process) <- worker (the ask/tell loop) <- drive
(checks, study, workers, signals); parent, results and figures write the MLflow side.
Optuna, torch and MLflow are imported only on the sweep's own path.
"""
