"""What a user writes instead of `mpsrun sweep`: one process, Optuna asking the trials, each a plain PyTorch loop,
each logged to MLflow as a nested run of one parent. The baseline of fused_sweep_bench.py's `controls` rows.

The digits MLP of fused_sweep_bench.py's DIGITS recipe (64 hidden, SGD with momentum, batch 32), the same search
(lr, weight decay, momentum; TPE), and with `--controls` what a real sweep has: a cosine schedule stepped every
optimizer step after one warm-up epoch (LinearLR from 0.1 joined by SequentialLR, as torch's documentation composes
it) and gradient clipping (clip_grad_norm_ at 1.0). Validation after every epoch, its loss and accuracy logged.
Written as a careful user would: data as tensors once, no DataLoader, `.item()` once per epoch.

    python benchmarks/user_sweep.py --trials 16 --epochs 3 --controls --store DIR
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--controls", action="store_true", help="a warm-up + cosine schedule per step and grad clipping")
    ap.add_argument("--store", required=True, help="a folder for the MLflow SQLite store")
    a = ap.parse_args(argv)

    import mlflow
    import optuna
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)  # as mpsrun's fused CPU group runs (two threads wait on each other at this size)
    x, y = load_digits(return_X_y=True)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    xtr, xva = torch.tensor(xtr / 16.0, dtype=torch.float32), torch.tensor(xva / 16.0, dtype=torch.float32)
    ytr, yva = torch.tensor(ytr), torch.tensor(yva)
    steps = -(-len(xtr) // 32)
    mlflow.set_tracking_uri(f"sqlite:///{a.store}/mlflow.db")
    mlflow.set_experiment("user_sweep")

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
        wd = trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
        mom = trial.suggest_float("momentum", 0.0, 0.95)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mom, weight_decay=wd)
        sched = None
        if a.controls:
            warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=steps)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * max(1, a.epochs - 1))
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[steps])
        loss_fn = nn.CrossEntropyLoss()
        with mlflow.start_run(run_name=f"trial {trial.number}", nested=True):
            mlflow.log_params({"lr": lr, "weight_decay": wd, "momentum": mom})
            val = float("nan")
            for epoch in range(a.epochs):
                model.train()
                order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
                total = torch.zeros(())
                for i in range(0, len(xtr), 32):
                    idx = order[i : i + 32]
                    loss = loss_fn(model(xtr[idx]), ytr[idx])
                    opt.zero_grad()
                    loss.backward()
                    if a.controls:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    if sched is not None:
                        sched.step()
                    total += loss.detach() * len(idx)
                model.eval()
                with torch.no_grad():
                    out = model(xva)
                    val = float(loss_fn(out, yva))
                    acc = float((out.argmax(1) == yva).float().mean())
                mlflow.log_metrics({"train_loss": float(total) / len(xtr), "val_loss": val, "val_accuracy": acc}, step=epoch)
        return val

    with mlflow.start_run(run_name="sweep"):
        study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
        study.optimize(objective, n_trials=a.trials)
        mlflow.log_metric("best_val_loss", study.best_value)
    print(f"user sweep: {a.trials} trials, best val_loss {study.best_value:.4f}, {time.perf_counter() - T0:.1f} s after imports began")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
