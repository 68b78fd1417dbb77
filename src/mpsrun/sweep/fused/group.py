"""Which trials can train as one fused step, and why the others cannot (said once, in the parent's notes).

Two trials fuse when their resolved recipes are equal once the shape-free values are set
aside (FREE: the same operators on the same shapes), and nothing in the recipe asks for
what the fused step does not do (RECIPE_WHY_NOT). Checks that need the built objects (the
model's layers, the optimizer's arguments, the data) are in `members`.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

from mpsrun.recipe.load import Resolved

# Recipe paths whose values change no shape: members may differ in them.
FREE = ("seed", "optimizer.lr", "optimizer.weight_decay", "optimizer.momentum", "optimizer.dampening", "optimizer.nesterov",
        "optimizer.betas", "optimizer.eps", "model.dropout", "loss.label_smoothing", "grad_clip.max_norm",
        # each member has its own EarlyStopping (sweep/fused/controls.py): all four are its own, whether it has one is the group's
        "early_stopping.patience", "early_stopping.min_delta", "early_stopping.monitor", "early_stopping.mode")
# Sections whose every key but these is free: a schedule's arguments and warm-up are each member's own (its own
# scheduler, sweep/fused/controls.py); its class and interval stay the group's (a per-step schedule keeps graphs off).
FREE_BUT = {"scheduler": ("name", "interval")}


def schedule_why_not(section: Any) -> str | None:
    """What in a `scheduler:` section the fused step cannot follow; None when it can."""
    if section is None:
        return None
    if section.name in ("OneCycleLR", "CyclicLR") and section.kwargs.get("cycle_momentum", True):
        return f"scheduler {section.name} with cycle_momentum (it changes the momentum, which the fused update keeps fixed)"
    return None


def clip_why_not(section: Any) -> str | None:
    """What in a `grad_clip:` section the fused step cannot do; None when it can."""
    if section is not None and section.norm_type != 2.0:
        return f"grad_clip.norm_type {section.norm_type:g} (the fused step clips by the 2-norm)"
    return None


def recipe_why_not(resolved: Resolved) -> str | None:
    """What in this trial's recipe the fused step does not do; None when nothing."""
    r = resolved.recipe
    sched, clip = schedule_why_not(r.scheduler), clip_why_not(r.grad_clip)
    checks: list[tuple[bool, str]] = [
        (sched is not None, sched or ""),
        (bool(r.callbacks), "callbacks"),
        (bool(r.augment), "augment"),
        (clip is not None, clip or ""),
        (r.precision not in ("auto", "fp32", "bf16"), f"precision {r.precision}"),
        (r.compile is True, "compile: true"),
        (r.resident is False, "resident: false"),
        (r.tracking.log_model, "tracking.log_model: true (the fused trials log no model)"),
        (r.tracking.figures, "tracking.figures: true (the fused trials draw no figures)"),
        (r.checkpoint.every > 0, "checkpoint.every > 0 (the fused trials keep no checkpoints)"),
    ]
    said = [why for bad, why in checks if bad]
    return f"the recipe asks for {', '.join(said)}, which the fused step does not do" if said else None


def _drop(data: dict, path: str) -> None:
    node: Any = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(keys[-1], None)


def shape_key(resolved: Resolved) -> str:
    """The trial's recipe with the shape-free values set aside: trials with the same key can fuse."""
    data = copy.deepcopy(resolved.source.data)
    data.pop("sweep", None)
    for path in FREE:
        _drop(data, path)
    for section, kept in FREE_BUT.items():
        if isinstance(data.get(section), dict):
            data[section] = {k: v for k, v in data[section].items() if k in kept}
    return json.dumps(data, sort_keys=True, default=str)


def differing(a: Resolved, b: Resolved) -> list[str]:
    """Top-level (and section.key) paths where two trials' shape keys differ: what keeps them apart."""
    da, db = json.loads(shape_key(a)), json.loads(shape_key(b))
    out = []
    for k in sorted(set(da) | set(db)):
        va, vb = da.get(k), db.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [f"{k}.{s}" for s in sorted(set(va) | set(vb)) if va.get(s) != vb.get(s)]
        else:
            out.append(k)
    return out


def partition(items: list[Any], resolved_of: Callable[[Any], Resolved], most: int) -> tuple[list[list[Any]], list[tuple[Any, str]]]:
    """Groups (each of 2 or more, at most `most`) and the trials that run alone, with why."""
    alone: list[tuple[Any, str]] = []
    keyed: dict[str, list[Any]] = {}
    for it in items:
        why = recipe_why_not(resolved_of(it))
        if why:
            alone.append((it, why))
            continue
        keyed.setdefault(shape_key(resolved_of(it)), []).append(it)
    groups: list[list[Any]] = []
    for same in keyed.values():
        if len(same) == 1:
            other = next((g[0] for g in keyed.values() if g is not same), None)
            diff = differing(resolved_of(same[0]), resolved_of(other)) if other is not None else []
            why = (f"its {', '.join(diff)} differ{'s' if len(diff) == 1 else ''} from every other trial asked with it" if diff
                   else "no other trial was asked with it")
            alone.append((same[0], why))
            continue
        for i in range(0, len(same), most):
            part = same[i : i + most]
            if len(part) == 1:
                alone.append((part[0], "the last of its kind after full groups"))
            else:
                groups.append(part)
    return groups, alone
