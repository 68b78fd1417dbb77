"""Where a model's batch-norm is followed by an activation (ReLU, ReLU6, SiLU), or by a residual add and then a ReLU: one layer for fused_norm.

Why a graph: ResNets call one `nn.ReLU` module after several batch-norms and after the residual
add (`out += identity; out = self.relu(out)`), so the modules alone do not say which batch-norm
output goes only to a ReLU; torch.fx's trace of the model does. The rewritten GraphModule shares
the model's modules (and so its parameters and buffers); it stands in for the model's forward only
while GraphTrainer warms up and captures. A model that does not trace (data-dependent control flow,
untraceable calls) keeps its graph, and each batch-norm is swapped alone.

A batch-norm output is folded into the next op only when that op is its one user, so nothing
else sees the value before the activation; an add is folded only with a tensor (not a number) on
its other side and a ReLU as its one user.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
from torch import nn

_ADDS = (operator.add, operator.iadd, torch.add)
NONE, RELU, RELU6, SILU = 0, 1, 2, 3  # the activation after a batch-norm, as fused_norm's kernels take it (defined here: no import circle)
_MODULES = {nn.ReLU: RELU, nn.ReLU6: RELU6, nn.SiLU: SILU}
_FUNCTIONS = {torch.relu: RELU, torch.relu_: RELU, nn.functional.relu: RELU, nn.functional.relu6: RELU6, nn.functional.silu: SILU}
_METHODS = {"relu": RELU, "relu_": RELU}


def _only_user(node: Any) -> Optional[Any]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _activation(node: Any, arg: Any, modules: dict[str, nn.Module]) -> int:
    """The activation `node` applies to `arg` alone (RELU, RELU6, SILU), or NONE."""
    if node is None or len(node.args) != 1 or node.args[0] is not arg:
        return NONE
    if node.op == "call_module":
        return _MODULES.get(type(modules.get(node.target)), NONE) if not node.kwargs else NONE
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target, NONE) if set(node.kwargs) <= {"inplace"} else NONE
    return _METHODS.get(node.target, NONE) if node.op == "call_method" and not node.kwargs else NONE


def _residual(node: Any, arg: Any) -> Optional[Any]:
    """The add's other operand when `node` is `arg + other` (or `other + arg`) with `other` a graph value."""
    from torch import fx

    if node is None or node.kwargs or len(node.args) != 2:
        return None
    if not ((node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method" and node.target in ("add", "add_"))):
        return None
    a, b = node.args
    if node.op == "call_method" and node.target == "add_" and a is not arg:
        return None  # other.add_(bn): the other tensor changes in place; leave it to torch
    other = b if a is arg else a if b is arg else None
    return other if isinstance(other, fx.Node) and other is not arg else None


def rewrite(model: nn.Module, make: Callable[[nn.BatchNorm2d, int, bool], nn.Module],
            eligible: Callable[[Any], bool]) -> tuple[Optional[Any], list]:
    """(the model's forward as a GraphModule with each `eligible` batch-norm [+ add + ReLU | + activation] a `make(bn, act, residual)`
    module, those modules); (None, []) when the model does not trace or has no eligible batch-norm."""
    from torch import fx

    if not any(eligible(m) for m in model.modules()):
        return None, []
    try:
        gm = fx.symbolic_trace(model)
    except Exception:
        return None, []
    modules = dict(gm.named_modules())
    layers: list = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not eligible(modules.get(node.target)) or len(node.args) != 1 or node.kwargs:
            continue
        bn = modules[node.target]
        x = node.args[0]
        after = _only_user(node)
        res = _residual(after, node)
        gone = [node]
        if res is not None and _activation(_only_user(after), after, modules) == RELU:  # relu(bn(x) + res): ResNets' blocks
            gone, act = [_only_user(after), after, node], RELU
        else:
            act, res = _activation(after, node, modules), None
            if act:
                gone = [after, node]
        layer = make(bn, act, res is not None)
        name = f"mpsrun_norm_{len(layers)}"
        gm.add_submodule(name, layer)
        with gm.graph.inserting_after(gone[0]):
            new = gm.graph.call_module(name, (x,) if res is None else (x, res))
        gone[0].replace_all_uses_with(new)
        for old in gone:
            gm.graph.erase_node(old)
        layers.append(layer)
    if not layers:
        return None, []
    gm.graph.lint()
    gm.recompile()
    return gm, layers
