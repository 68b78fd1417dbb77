"""SGD, Adam and AdamW for M stacked members, each member's hyperparameters a tensor on the member dimension.

The formulas follow torch.optim's single-tensor implementations op for op (what `mpsrun run`
uses on the CPU), so a member's update is its solo run's: torch's `add(x, alpha=a)`,
`addcmul` and `add_(grad, alpha=-lr)` are fused multiply-adds on the CPU (one rounding), which
`_fma` reproduces exactly through float64 (the product of two float32 numbers is exact there);
Adam's bias corrections are computed in Python floats per member, as torch computes them, then
rounded to float32 as torch rounds a scalar argument. On CUDA the same formulas run in float32
on the device (step counters there too, so the step can be captured in a CUDA graph).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("sgd", "adam", "adamw")
# Arguments the fused update implements; any other set to a non-default value runs unfused (said).
KNOWN = {
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable", "fused"},
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"},
}


def why_not(name: str, group: dict[str, Any]) -> str | None:
    """None where the optimizer `name` with its resolved param group (torch's defaults filled) can run fused."""
    key = name.lower()
    if key not in KINDS:
        return f"optimizer {name} has no fused update yet (fused: sgd, adam, adamw)"
    if group.get("maximize") or group.get("amsgrad"):
        return f"optimizer {name} with {'maximize' if group.get('maximize') else 'amsgrad'} has no fused update yet"
    if key == "sgd" and group.get("nesterov") and (group.get("momentum", 0) <= 0 or group.get("dampening", 0) != 0):
        return "nesterov needs momentum and no dampening"  # torch refuses it too
    return None


@dataclass
class Hyper:
    """One member's resolved hyperparameters (its solo optimizer's param group)."""

    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    decoupled: bool = False

    @classmethod
    def of(cls, name: str, group: dict[str, Any]) -> "Hyper":
        lr = float(group["lr"])
        if name.lower() == "sgd":
            return cls(lr, float(group.get("weight_decay", 0.0)), float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0)), bool(group.get("nesterov", False)))
        b1, b2 = group.get("betas", (0.9, 0.999))
        decoupled = name.lower() == "adamw" or bool(group.get("decoupled_weight_decay", False))
        return cls(lr, float(group.get("weight_decay", 0.0)), beta1=float(b1), beta2=float(b2), eps=float(group.get("eps", 1e-8)), decoupled=decoupled)


def resolved_group(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch's defaults for `cls` with the recipe's arguments on top: what the solo optimizer's param group holds."""
    out = {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not inspect.Parameter.empty}
    out.update(kwargs)
    return out


def _fma(z: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """z + x * y with one rounding, as the CPU's fused multiply-add in torch's `add(alpha=)` and `addcmul`."""
    return torch.addcmul(z.double(), x.double(), y.double()).to(z.dtype)


class FusedOptimizer:
    """One update for every member; `exact`: the CPU's formula order (float64 multiply-adds, host-side scalars)."""

    def __init__(self, kind: str, params: list[torch.Tensor], hypers: list[Hyper], exact: bool) -> None:
        self.kind = kind.lower()
        self.params = params
        self.hypers = hypers
        self.exact = exact
        self.step_count = 0
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in params]
        dev = params[0].device
        self.device = dev
        self._tensors(dev)
        self.step_t = torch.zeros((), device=dev)  # the device's step counter (not exact: CUDA graphs read it)
        self.kernel: Any = None  # kernels/tsgd.Sgd where a graphed CUDA group takes SGD's update as one Triton kernel

    def _tensors(self, dev: torch.device) -> None:
        h = self.hypers
        f = lambda vals: torch.tensor(vals, dtype=torch.float32, device=dev)  # noqa: E731 - a scalar argument's rounding
        self.lr, self.wd = f([x.lr for x in h]), f([x.weight_decay for x in h])
        self.mom, self.damp1 = f([x.momentum for x in h]), f([1 - x.dampening for x in h])
        self.has_mom = torch.tensor([x.momentum != 0 for x in h], device=dev)
        self.nesterov = torch.tensor([x.nesterov for x in h], device=dev)
        self.has_mom8, self.nesterov8 = self.has_mom.to(torch.int8), self.nesterov.to(torch.int8)  # what a Triton kernel reads
        self.b1c, self.b2, self.b2c = f([1 - x.beta1 for x in h]), f([x.beta2 for x in h]), f([1 - x.beta2 for x in h])
        self.eps = f([x.eps for x in h])
        self.decay = f([1 - x.lr * x.weight_decay for x in h])  # AdamW: torch's `1 - lr * weight_decay`, a Python float
        self.any_wd = any(x.weight_decay != 0 for x in h)
        self.any_mom = any(x.momentum != 0 for x in h)
        self.any_damp = any(x.dampening != 0 for x in h)
        self.all_mom = all(x.momentum != 0 for x in h)
        self.neg_lr = -self.lr
        self.any_nesterov = any(x.nesterov for x in h)

    def _v(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *([1] * (like.dim() - 1)))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        self.step_t.add_(1)
        if self.kind == "sgd":
            self._sgd()
        else:
            self._adam()

    def _mad(self, z: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _fma(z, x, y) if self.exact else torch.addcmul(z, x, y)

    def _sgd(self) -> None:
        if not self.exact:
            self._sgd_device()
            return
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad
            if self.any_wd:
                g = self._mad(g, p, self._v(self.wd, p))  # grad.add(param, alpha=weight_decay)
            if self.any_mom:
                buf = st.get("buf")
                if buf is None:
                    buf = st["buf"] = g.detach().clone()
                else:
                    buf.copy_(self._mad(buf * self._v(self.mom, p), g, self._v(self.damp1, p)))  # buf.mul_(m).add_(g, alpha=1-d)
                step = buf
                if self.any_nesterov:  # grad.add(buf, alpha=momentum), computed only where a member asks for it (the hot path)
                    step = torch.where(self._v(self.nesterov, p), self._mad(g, buf, self._v(self.mom, p)), buf)
                upd = torch.where(self._v(self.has_mom, p), step, g)
            else:
                upd = g
            p.copy_(self._mad(p, upd, self._v(-self.lr, p)))  # param.add_(grad, alpha=-lr)

    def _sgd_device(self) -> None:
        """SGD's formulas in place (CUDA, MPS): every member's parameters are read and written once per tensor op, and
        with hundreds of members the update is bound by memory traffic, not arithmetic (the fused curve's profile).
        Where the group has `kernel` (kernels/tsgd.Sgd: graphed CUDA groups), a checked parameter's update is one
        Triton pass instead; the momentum buffer then starts at zero (at the first step the same as a copy of g)."""
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad
            if self.kernel is not None:
                buf = st.get("buf")
                if buf is None and self.any_mom:
                    buf = st["buf"] = torch.zeros_like(p)
                if self.kernel.use(self, p, g, buf):
                    from mpsrun.sweep.fused.kernels import tsgd

                    tsgd.step(self, p, g, buf)
                    continue
            self._sgd_one(p, g, st)

    def _sgd_one(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor]) -> None:
        """One parameter's update as torch's ops (also the Triton kernel's reference: tsgd.check)."""
        if self.any_wd:
            g.addcmul_(p, self._v(self.wd, p))  # grad.add(param, alpha=weight_decay), in the gradient's own memory
        upd = g
        if self.any_mom:
            buf = st.get("buf")
            if buf is None:  # eager's first step (under graphs the warm-up made it: zero, and damp1 is 1 at step 1)
                buf = st["buf"] = g.detach().clone()
            else:
                damp1 = self.damp1
                if self.any_damp:
                    damp1 = torch.where(self.step_t == 1, torch.ones_like(damp1), damp1)
                buf.mul_(self._v(self.mom, p)).addcmul_(g, self._v(damp1, p))
            upd = buf
            if self.any_nesterov:
                upd = torch.where(self._v(self.nesterov, p), g.addcmul(buf, self._v(self.mom, p)), buf)
            if not self.all_mom:
                upd = torch.where(self._v(self.has_mom, p), upd, g)
        p.addcmul_(upd, self._v(self.neg_lr, p))  # param.add_(grad, alpha=-lr)

    def reference(self, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None) -> None:
        """`_sgd_one` on given tensors (tsgd's check: copies of a parameter's)."""
        self._sgd_one(p, g, {"buf": buf} if buf is not None else {})

    def _adam(self) -> None:
        if self.exact:  # torch's single-tensor path: Python floats per member, rounded to float32 as arguments
            n = self.step_count
            bc1 = [1 - h.beta1 ** n for h in self.hypers]
            size = torch.tensor([-(h.lr / c) for h, c in zip(self.hypers, bc1)], dtype=torch.float32, device=self.device)
            bc2s = torch.tensor([(1 - h.beta2 ** n) ** 0.5 for h in self.hypers], dtype=torch.float32, device=self.device)
        else:  # on the device, capturable: float32 powers of the step counter
            b1 = 1 - self.b1c
            size = -self.lr / (1 - b1.pow(self.step_t))
            bc2s = (1 - self.b2.pow(self.step_t)).sqrt()
        decoupled = self.hypers[0].decoupled
        for p, st in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad
            if self.any_wd:
                if decoupled:
                    p.mul_(self._v(self.decay if self.exact else 1 - self.lr * self.wd, p))
                else:
                    g = self._mad(g, p, self._v(self.wd, p))
            if "m" not in st:
                st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
            m, v = st["m"], st["v"]
            m.lerp_(g, self._v(self.b1c, p))
            v.mul_(self._v(self.b2, p))
            v.copy_(self._mad(v, g * self._v(self.b2c, p), g))  # addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / self._v(bc2s, p)).add_(self._v(self.eps, p))
            p.add_(self._v(size, p) * m / denom)  # addcdiv_(m, denom, value=-step_size): (value * m) / denom, then +

    @torch.no_grad()
    def set_lr(self, lrs: list[float]) -> None:
        """Each member's learning rate now (its schedule's), written into the tensors in place: CUDA graphs that read
        `lr`, `neg_lr` and `decay` see it at their next replay, and the exact path reads `hypers[j].lr`."""
        if all(h.lr == lr for h, lr in zip(self.hypers, lrs)):
            return
        for h, lr in zip(self.hypers, lrs):
            h.lr = float(lr)
        f = lambda vals: torch.tensor(vals, dtype=torch.float32)  # noqa: E731 - rounded as _tensors rounds them
        self.lr.copy_(f([h.lr for h in self.hypers]))
        self.neg_lr.copy_(-self.lr)
        self.decay.copy_(f([1 - h.lr * h.weight_decay for h in self.hypers]))

    def keep(self, idx: list[int], params: list[torch.Tensor]) -> None:
        """Only these members go on: their state and hyperparameters kept, on the group's new parameter tensors."""
        at = torch.tensor(idx, device=self.device)
        self.state = [{k: t.index_select(0, at).clone() for k, t in st.items()} for st in self.state]
        self.params = params
        self.hypers = [self.hypers[j] for j in idx]
        self._tensors(self.device)
