"""A Sequential model run for M members at once: parameters stacked on a leading member dimension.

Why our own layers rather than torch.func's vmap: on the CPU a batched matmul (`baddbmm`)
gives each member bit for bit what `nn.Linear` gives it alone (checked in
tests/test_sweep_fused.py), dropout can draw each member's mask from that member's own
generator in the order its solo run draws it, and batch-norm keeps per-member running
statistics: a fused trial's numbers are its solo run's. Activations have no parameters and
act elementwise, so the solo module runs on the stacked tensor as it is.

Shapes: activations are [M, B, ...]; a stacked Linear weight is [M, out, in].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpsrun.sweep.fused.amp import amp_cast
from mpsrun.sweep.fused.packed import ELEMENTWISE, PACKED, POOLS, pack, packed_layer, shared_conv, unpack

WITH_PARAMS = (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.BatchNorm1d)
SUPPORTED = (nn.Flatten, nn.Dropout, *ELEMENTWISE, *POOLS, *WITH_PARAMS)


def flat_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order, nested Sequentials opened."""
    out: list[nn.Module] = []
    for m in model.children() if isinstance(model, nn.Sequential) else [model]:
        out.extend(flat_layers(m) if isinstance(m, nn.Sequential) else [m])
    return out


def why_not(model: nn.Module) -> str | None:
    """None where the model can run fused; else why not (said in the parent's notes)."""
    if not isinstance(model, nn.Sequential):
        return f"the model is a {type(model).__name__}, not an nn.Sequential of layers the fused step knows"
    for m in flat_layers(model):
        if not isinstance(m, SUPPORTED):
            return f"its layer {type(m).__name__} has no fused form yet (fused: {', '.join(sorted({t.__name__ for t in SUPPORTED}))})"
        if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or m.groups != 1):
            return "a Conv2d with groups or a padding mode other than zeros has no fused form yet"
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) and (not m.track_running_stats or m.momentum is None):
            return "a batch-norm without running statistics or with a cumulative average has no fused form yet"
    return None


def signature(model: nn.Module) -> tuple:
    """What must be equal for two members' models to stack: layer types, their settings and parameter shapes."""
    sig = []
    for m in flat_layers(model):
        shapes = tuple((k, tuple(v.shape)) for k, v in m.state_dict().items())
        extra = m.extra_repr() if not isinstance(m, nn.Dropout) else ""  # a dropout's p is a member's own value
        sig.append((type(m).__name__, extra, shapes))
    return tuple(sig)


class Stacked:
    """M members' models as one: `forward(x)` for x [M, B, ...]; `params` are leaf tensors [M, ...]."""

    def __init__(self, models: list[nn.Module], generators: list[torch.Generator] | None = None) -> None:
        self.layers = flat_layers(models[0])
        per = [flat_layers(m) for m in models]
        self.params: list[torch.Tensor] = []
        self.where: list[dict[str, torch.Tensor]] = []  # per layer: name -> stacked parameter or buffer
        self.p_drop: list[list[float]] = []  # per layer: each member's dropout probability (dropout layers)
        for i, layer in enumerate(self.layers):
            slot: dict[str, torch.Tensor] = {}
            if isinstance(layer, WITH_PARAMS):
                for name, _ in layer.named_parameters(recurse=False):
                    t = torch.stack([getattr(p[i], name).detach() for p in per]).clone().requires_grad_(True)
                    slot[name] = t
                    self.params.append(t)
                for name, b in layer.named_buffers(recurse=False):
                    if b is not None:
                        slot[name] = torch.stack([getattr(p[i], name).detach() for p in per]).clone()
            self.where.append(slot)
            self.p_drop.append([float(p[i].p) for p in per] if isinstance(layer, nn.Dropout) else [])
        self.generators = generators  # each member's own (dropout), as its solo run's global generator
        self.training = True
        self.exact = bool(self.params) and self.params[0].device.type == "cpu"  # each member's own kernels, bit for bit
        # Convolution stages kept packed (graphed.group_for turns it on for CUDA; packed.py): no transposes between
        # the layers, channels_last as a solo conv run on CUDA has it
        self.pack = False
        self.channels_last = False
        self.pools: Any = None  # packed.FastPools: the packed stage's max-pools as Triton kernels (graphed.group_for, CUDA)
        self.convs: Any = None  # convcheck.Convs: the packed stage's convolutions as Triton kernels (graphed.group_for, CUDA)
        self._order: tuple[bool, list[int]] | None = None  # (pack, the layers' order) as order() worked it out

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def eval(self) -> None:
        self.training = False

    def keep(self, idx: list[int]) -> None:
        """Only these members go on (the others left the group): every stacked tensor narrowed to them."""
        at = torch.tensor(idx, device=self.params[0].device if self.params else "cpu")
        new: list[torch.Tensor] = []
        for slot in self.where:
            for k, t in list(slot.items()):
                kept = t.detach().index_select(0, at).clone()
                if t.requires_grad:
                    kept.requires_grad_(True)
                    new.append(kept)
                slot[k] = kept
        self.params = new
        self.p_drop = [[p[j] for j in idx] if p else [] for p in self.p_drop]
        if self.generators is not None:
            self.generators = [self.generators[j] for j in idx]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pack:
            for layer, slot, p in zip(self.layers, self.where, self.p_drop):
                x = self._layer(layer, slot, p, x)
            return x
        m = x.shape[0]
        packed = False  # x as [B, M*C, H, W]: the members' channels side by side, from a convolution to the flatten
        for i in self.order():
            layer, slot, p = self.layers[i], self.where[i], self.p_drop[i]
            if isinstance(layer, nn.Conv2d) or (packed and isinstance(layer, PACKED)):
                if not packed and isinstance(layer, nn.Conv2d) and x.stride(0) == 0 and m > 1:
                    x, packed = shared_conv(layer, slot, x[0], self.channels_last, self.convs), True  # one batch for all: no groups
                    continue
                if not packed:
                    x, packed = pack(x, self.channels_last), True
                if isinstance(layer, nn.MaxPool2d) and self.pools is not None:
                    x = self.pools(layer, x)
                    continue
                x = packed_layer(layer, slot, x, m, self.training, self.convs)
                continue
            if packed:
                x, packed = unpack(x, m), False
            x = self._layer(layer, slot, p, x)
        return unpack(x, m) if packed else x

    __call__ = forward

    def order(self) -> list[int]:
        """The layers' order for the packed layout: a ReLU right before a MaxPool2d runs after it instead.

        Why: max(relu(a), relu(b)) = relu(max(a, b)) and the gradient reaches the same input (the window's
        first maximum, times relu's 0 or 1): the same numbers, bit for bit, with the ReLU's passes over a
        quarter of the tensor (a 2x2 pool) — on a 16-member CNN's first stage, hundreds of megabytes a step."""
        if self._order is None or self._order[0] != self.pack:
            idx = list(range(len(self.layers)))
            if self.pack:
                i = 0
                while i + 1 < len(idx):
                    if type(self.layers[idx[i]]) is nn.ReLU and type(self.layers[idx[i + 1]]) is nn.MaxPool2d:
                        idx[i], idx[i + 1] = idx[i + 1], idx[i]
                        i += 1
                    i += 1
            self._order = (self.pack, idx)
        return self._order[1]

    def _layer(self, layer: nn.Module, slot: dict[str, torch.Tensor], p: list[float], x: torch.Tensor) -> torch.Tensor:
        m, b = x.shape[0], x.shape[1]
        if isinstance(layer, nn.Linear):
            if x.dim() != 3:  # [M, B, ..., in]: the batch's extra dimensions folded in
                y = _Linear.apply(x.reshape(m, -1, x.shape[-1]), slot["weight"], slot.get("bias"), self.exact)
                return y.reshape(*x.shape[:-1], y.shape[-1])
            return _Linear.apply(x, slot["weight"], slot.get("bias"), self.exact)
        if isinstance(layer, nn.Flatten):
            start = layer.start_dim + 1 if layer.start_dim >= 0 else layer.start_dim
            end = layer.end_dim + 1 if layer.end_dim >= 0 else layer.end_dim
            return x.flatten(start, end)
        if isinstance(layer, ELEMENTWISE):
            return layer(x)
        if isinstance(layer, POOLS):
            y = layer(x.reshape(m * b, *x.shape[2:]))
            return y.reshape(m, b, *y.shape[1:])
        if isinstance(layer, nn.Conv2d):
            return _conv(layer, slot, x)
        if isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
            return _norm(layer, slot, x, self.training)
        if isinstance(layer, nn.Dropout):
            return self._dropout(p, x)
        raise TypeError(f"no fused form for {type(layer).__name__}")  # why_not() said so before

    def _dropout(self, p: list[float], x: torch.Tensor) -> torch.Tensor:
        """Each member's mask from its own generator, drawn as torch's CPU dropout draws it alone:
        `empty_like(x).bernoulli_(1 - p)`, divided by 1 - p, times x (ATen's _dropout_impl)."""
        if not self.training or max(p) == 0:
            return x
        outs = []
        for j in range(x.shape[0]):
            if p[j] == 0:
                outs.append(x[j])
                continue
            if p[j] == 1:
                outs.append(x[j] * 0)
                continue
            gen = self.generators[j] if self.generators is not None else None
            noise = torch.empty_like(x[j]).bernoulli_(1 - p[j], generator=gen)
            noise.div_(1 - p[j])
            outs.append(x[j] * noise)
        return torch.stack(outs)


class _Linear(torch.autograd.Function):
    """`nn.Linear` for M members: x [M, B, in], weight [M, out, in], bias [M, out].

    The backward computes what `addmm`'s backward computes for one member, in its orientation:
    grad_weight = grad_out^T @ x, grad_input = grad_out @ weight, grad_bias = grad_out summed over the batch.
    (autograd's own bmm backward computes x^T @ grad_out, the same sums in another order: 1e-8 apart.)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, exact: bool) -> torch.Tensor:  # type: ignore[override]
        x, w, b = amp_cast(x, w, b)
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.exact = b is not None, exact
        if exact:  # the CPU: each member's own addmm, as F.linear calls it (bmm's kernels sum in another order)
            return torch.stack([torch.addmm(b[j], x[j], w[j].t()) if b is not None else x[j].mm(w[j].t()) for j in range(x.shape[0])])
        wt = w.transpose(1, 2)
        return torch.baddbmm(b.unsqueeze(1), x, wt) if b is not None else torch.bmm(x, wt)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)  # bf16 under autocast: the backward in the forward's dtype (the inputs' grads cast back by autograd)
        n = range(x.shape[0])
        if ctx.exact:  # addmm's backward, member by member: grad.mm(weight), grad.t().mm(input), grad.sum(0)
            gx = torch.stack([g[j].mm(w[j]) for j in n]) if ctx.needs_input_grad[0] else None
            gw = torch.stack([g[j].t().mm(x[j]) for j in n]) if ctx.needs_input_grad[1] else None
            gb = torch.stack([g[j].sum(0) for j in n]) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return gx, gw, gb, None
        gx = torch.bmm(g, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def _conv(layer: nn.Conv2d, slot: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A grouped convolution: the members' channels side by side, one group each."""
    m, b = x.shape[0], x.shape[1]
    w = slot["weight"]  # [M, out, in, kh, kw]
    xin = x.transpose(0, 1).reshape(b, m * x.shape[2], *x.shape[3:])
    bias = slot["bias"].reshape(-1) if "bias" in slot else None
    y = F.conv2d(xin, w.reshape(m * w.shape[1], *w.shape[2:]), bias, layer.stride, layer.padding, layer.dilation, groups=m)
    return y.reshape(b, m, w.shape[1], *y.shape[2:]).transpose(0, 1)


def _norm(layer: Any, slot: dict[str, torch.Tensor], x: torch.Tensor, training: bool) -> torch.Tensor:
    """Batch-norm with each member's own statistics: members' channels side by side, one batch-norm over them."""
    m, b, c = x.shape[0], x.shape[1], x.shape[2]
    xin = x.transpose(0, 1).reshape(b, m * c, *x.shape[3:])
    rm, rv = slot.get("running_mean"), slot.get("running_var")
    w, bias = slot.get("weight"), slot.get("bias")
    flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731 - views: running stats update in place
    if training and "num_batches_tracked" in slot:
        slot["num_batches_tracked"].add_(1)
    y = F.batch_norm(xin, flat(rm), flat(rv), flat(w), flat(bias), training, layer.momentum, layer.eps)
    return y.reshape(b, m, c, *y.shape[2:]).transpose(0, 1)
