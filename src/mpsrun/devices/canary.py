"""Start-up canaries: known-fragile operations run on the device and on the CPU, compared.

Why. Accelerator backends have shipped silent wrong-answer bugs: on MPS, `argmax`
returned garbage (a FashionMNIST MLP trained to a falling loss while reporting
0.0% accuracy), in-place updates such as `addcdiv_` wrote wrong values through
transposed or non-contiguous views (which broke Adam-style optimizers), and int64
reductions were silently computed in 32 bits. A falling loss does not reveal any
of this. So before training on a non-CPU device the runner spends a fraction of a
second running exactly these operations on small, seeded inputs on the device and
on the CPU, plus the recipe's own model forward on a probe batch, and compares.

Outcome (recorded on the run as tags `canary.*`):
- `passed`: every operation agrees with the CPU;
- `failed`: an operation differs and `canary: on` (the default): the run stops
  with an error naming the operation and the difference (exit 1, run FAILED);
- `warned`: an operation differs and `canary: warn`: the run goes on, warned;
- `skipped (cpu)`: the run's device is the CPU, the reference itself;
- `off`: `canary: off` in the recipe.
`canary.time_s` is the checks' own time, device synchronised, after one tiny
matmul that initialises the device's math library (a one-off cost that training
would pay at its first step anyway); over one second adds `canary.slow`.
An operation that raises on the device is reported as unsupported (a warning and
the tag `canary.unsupported`), not as a wrong answer: a raised error is not
silent, and failing every run because of an operation the recipe may never use
would teach users to turn the guard off.

Comparison. Integer and boolean results must be equal. Floating-point results
are compared normwise: max|device - cpu| <= atol + rtol * max|cpu|, per output
tensor; with TF32 switched off during the check (`strict_math`) a correct device
differs from the CPU by a few fp32 rounding errors (~1e-6 relative), while the
bugs above are off by O(1). The tolerances therefore sit well clear of both.

Testing seams. `CHECKS` is a registry (add checks with `register`); `PERTURB`
maps an operation's name to a function applied to the device's output before the
comparison, which is how the tests inject a wrong result; `CPU_SELF_CHECK`
makes the canary run on a CPU device too (CPU against CPU) for those tests.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from mpsrun.devices import resolve as devices
from mpsrun.devices.parity.tolerance import Diff

# Test hooks (see module docstring); empty / off in normal use. A PERTURB function
# gets the device's outputs of that check (a tuple of CPU tensors) and returns them altered.
PERTURB: dict[str, Callable[[Any], Any]] = {}
CPU_SELF_CHECK = False

# Opt-in per process (a sweep's worker sets it): the fixed operations' results per (device, mode), checked
# once and reused by later runs in the same process; the model forward, which differs per run, still runs each time.
REUSE_OPS = False
_OPS_DONE: dict[tuple[str, str], list["OpResult"]] = {}
LAST_S = 0.0  # the last guard's wall time in this process, warm-up included (a sweep's trace reads it)

PROBE_SIZE = 8  # samples in the model-forward probe batch: enough to exercise the forward, cheap for big CPU models
BUDGET_S = 1.0  # the check is meant to take less than this; slower is recorded


# ----------------------------------------------------------------------------- comparison


def compare(value: torch.Tensor | float, ref: torch.Tensor | float, atol: float, rtol: float) -> Diff:
    """Normwise comparison of a result with its reference (both brought to the CPU, float64).

    Normwise rather than elementwise: an element that is nearly zero by
    cancellation has a meaningless elementwise relative error, while an error
    measured against the tensor's own scale is what matters downstream. Positions
    where both sides are the same non-finite value (inf, or NaN on both) agree.
    """
    # to the CPU first, then float64: MPS has no float64
    a, b = (x.detach().cpu().to(torch.float64) if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64) for x in (value, ref))
    if a.shape != b.shape:
        inf = float("inf")
        return Diff(abs=inf, rel=inf, ratio=inf, note=f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return Diff(abs=0.0, rel=0.0)
    same_nonfinite = (a.isnan() & b.isnan()) | (a.isinf() & (a == b))
    finite = a.isfinite() & b.isfinite()
    bad = ~(finite | same_nonfinite)
    note = ""
    if bad.any():
        inf = float("inf")
        return Diff(abs=inf, rel=inf, ratio=inf, note=f"{int(bad.sum())} non-finite value(s) differ")
    if same_nonfinite.any():
        note = f"{int(same_nonfinite.sum())} non-finite value(s) on both sides"
    d = (a - b).abs()[finite]
    scale = b.abs()[finite]
    dmax = float(d.max()) if d.numel() else 0.0
    smax = float(scale.max()) if scale.numel() else 0.0
    rel = dmax / smax if smax > 0 else (0.0 if dmax == 0 else float("inf"))
    limit = atol + rtol * smax
    ratio = dmax / limit if limit > 0 else (0.0 if dmax == 0 else float("inf"))
    return Diff(abs=dmax, rel=rel, ratio=ratio, limit=limit, note=note)


@contextlib.contextmanager
def strict_math() -> Iterator[None]:
    """IEEE fp32 on CUDA (TF32 off) and no cuDNN autotuning for the duration, then restore.

    PyTorch keeps TF32 off for CUDA matmuls by default but *on* for cuDNN
    convolutions; TF32 keeps 10 mantissa bits (~1e-3 relative error per product),
    which is a deliberate speed trade, not a bug, and would otherwise dominate
    any fp32 comparison with the CPU. cuDNN's benchmark mode would time every
    convolution algorithm for the probe's new shape: slow, and a moving target.
    """
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark)
    matmul.allow_tf32 = cudnn.allow_tf32 = cudnn.benchmark = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark = saved


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One fragile operation: seeded CPU inputs, and the op, run on each device's copy of them.

    Non-contiguous views are made inside `op`, because moving a strided view to
    another device may make it contiguous.
    """

    name: str
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    op: Callable[..., Any]
    why: str
    atol: float = 1e-5
    rtol: float = 1e-4


CHECKS: dict[str, Check] = {}


def register(name: str, inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]], why: str, atol: float = 1e-5, rtol: float = 1e-4) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: add `op` to the registry under `name`."""

    def deco(op: Callable[..., Any]) -> Callable[..., Any]:
        CHECKS[name] = Check(name, inputs, op, why, atol, rtol)
        return op

    return deco


def _logits(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(257, 10, generator=g),)


@register("argmax", _logits, "MPS argmax has returned wrong indices (0% accuracy with a falling loss)")
def _argmax(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.argmax(dim=1), x.t().argmax(dim=0), x[::2].argmax(dim=1), x.argmax()


def _preds(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(257, 10, generator=g)
    y = torch.randint(0, 10, (257,), generator=g)
    y[::3] = x[::3].argmax(dim=1)  # a known share of hits
    return x, y


@register("eq_count", _preds, "accuracy = (argmax == label).sum(): the count behind every reported accuracy")
def _eq_count(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hits = x.argmax(dim=1) == y
    return hits.sum(), hits.long().sum(), hits.float().sum(), (x.t().argmax(dim=0) == y).sum()


def _mats(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randn(64, 96, generator=g), torch.randn(48, 192, generator=g), torch.randn(48, 64, generator=g)


@register("matmul_noncontig", _mats, "matmul through transposed and strided views has returned wrong values on MPS")
def _matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    bt = b[:, ::2].t()  # strided and transposed (96, 48)
    a_cm = a.t().contiguous().t()  # column-major layout of a
    return a @ bt, a_cm @ bt, torch.addmm(c.t(), a, bt), (c @ a).t() @ c


def _adam_state(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    p = torch.randn(48, 32, generator=g)
    m = torch.randn(32, 48, generator=g) * 1e-2
    v = torch.rand(32, 48, generator=g) * 1e-4
    return p, m, v


@register("addcdiv_noncontig", _adam_state, "in-place addcdiv_ on non-contiguous views broke Adam updates on MPS")
def _addcdiv(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    p = p.clone()
    pt = p.t()  # a transposed view: the update must land in `p`
    pt.addcdiv_(m, v.sqrt().add_(1e-8), value=-0.1)
    q = p.clone()
    q[:, ::2].addcdiv_(m.t()[:, ::2], v.t()[:, ::2].sqrt().add_(1e-8), value=0.1)  # strided
    return p, q


def _int64s(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    big = torch.randint(-(2**40), 2**40, (4096,), generator=g, dtype=torch.int64)
    return (big,)


@register("int64_sum", _int64s, "int64 reductions silently computed in 32 bits overflow")
def _int64_sum(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.sum(), x.view(64, 64).sum(dim=1), x.view(64, 64).t().sum(dim=1), x[::3].sum()


@register("int64_cumsum", _int64s, "int64 cumsum has been unsupported or computed in 32 bits on MPS")
def _int64_cumsum(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    pos = x.abs()
    return pos.cumsum(0), pos.view(64, 64).t().cumsum(dim=1)


# ----------------------------------------------------------------------------- running


@dataclass
class OpResult:
    name: str
    ok: bool
    detail: str = ""  # what differs, for the error message and the tag
    unsupported: bool = False  # the device raised instead of answering


@dataclass
class Report:
    status: str  # passed, failed, warned, skipped (cpu), off
    mode: str
    device: str
    time_s: float = 0.0
    results: list[OpResult] = field(default_factory=list)
    when: str = ""  # where it ran when not just before training (the tag canary.when); its time_s is then not the run's cost

    @property
    def failures(self) -> list[OpResult]:
        return [r for r in self.results if not r.ok and not r.unsupported]

    @property
    def unsupported(self) -> list[OpResult]:
        return [r for r in self.results if r.unsupported]

    def message(self) -> str:
        lines = [f"{r.name}: {r.detail}" for r in self.failures]
        return (
            f"canary: {len(self.failures)} of {len(self.results)} operations on {self.device} differ from the CPU: "
            + "; ".join(lines)
            + ". This device computes wrong answers for them; results of this run could not be trusted. "
            "Update PyTorch / the OS, or set `canary: warn` (run anyway, warned) or `canary: off` in the recipe."
        )

    def tags(self) -> dict[str, str]:
        tags = {"canary.status": self.status, "canary.mode": self.mode}
        if self.results:
            tags["canary.time_s"] = f"{self.time_s:.4f}"
            tags["canary.ops"] = ",".join(r.name for r in self.results)
        if self.results and self.when:
            tags["canary.when"] = self.when
        for r in self.failures:
            tags[f"canary.op.{r.name}"] = r.detail
        if self.unsupported:
            tags["canary.unsupported"] = "; ".join(f"{r.name}: {r.detail}" for r in self.unsupported)
        if self.results and self.time_s > BUDGET_S and not self.when:  # beside an import it waits for the lock, off the run's path
            tags["canary.slow"] = f"took {self.time_s:.2f} s, over the {BUDGET_S:.0f} s budget"
        return tags


class CanaryFailed(Exception):
    """The device disagrees with the CPU on a known-fragile operation (`canary: on`)."""

    def __init__(self, report: Report) -> None:
        super().__init__(report.message())
        self.report = report


def applies(device: torch.device) -> bool:
    """The canary guards accelerators; the CPU is the reference (unless self-checking in tests)."""
    return device.type != "cpu" or CPU_SELF_CHECK


def _to(x: Any, device: torch.device) -> Any:
    """Copy inputs to `device` (the MPS mock tests replace this, there being no MPS here)."""
    return x.to(device)


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _describe(name: str, i: int, n: int, got: torch.Tensor, want: torch.Tensor, d: Diff | None) -> str:
    where = f"output {i + 1} of {n}: " if n > 1 else ""
    if d is None:  # exact comparison
        if got.shape != want.shape:
            return f"{where}shape {tuple(got.shape)} vs cpu {tuple(want.shape)}"
        neq = got.ne(want)
        k = int(neq.sum())
        idx = neq.flatten().nonzero()[:3].flatten().tolist()
        g = [got.flatten()[j].item() for j in idx]
        w = [want.flatten()[j].item() for j in idx]
        return f"{where}{k} of {want.numel()} values differ (device {g} vs cpu {w} at flat index {idx})"
    return f"{where}max abs difference {d.abs:.3g} (relative {d.rel:.3g}; allowed {d.limit:.3g})" + (f"; {d.note}" if d.note else "")


def _judge(name: str, dev_out: Any, cpu_out: Any, atol: float, rtol: float) -> OpResult:
    got_all, want_all = _as_tuple(dev_out), _as_tuple(cpu_out)
    if len(got_all) != len(want_all):
        return OpResult(name, False, f"{len(got_all)} outputs vs {len(want_all)} on the cpu")
    n = len(want_all)
    for i, (got, want) in enumerate(zip(got_all, want_all)):
        got = got.detach().cpu()
        exact = not (want.is_floating_point() or want.is_complex())
        if exact:
            if got.dtype != want.dtype:
                return OpResult(name, False, f"output {i + 1}: dtype {got.dtype} vs cpu {want.dtype}")
            if got.shape != want.shape or not torch.equal(got, want):
                return OpResult(name, False, _describe(name, i, n, got, want, None))
        else:
            d = compare(got, want, atol, rtol)
            if d.exceeded:
                return OpResult(name, False, _describe(name, i, n, got, want, d))
    return OpResult(name, True)


def run_check(check: Check, device: torch.device) -> OpResult:
    inputs = check.inputs(torch.Generator().manual_seed(0))
    cpu_out = check.op(*[t.clone() for t in inputs])
    try:
        dev_out = check.op(*[_to(t, device) for t in inputs])
        dev_out = tuple(t.detach().cpu() for t in _as_tuple(dev_out))
    except Exception as e:  # noqa: BLE001 - any failure of the backend is reported, not raised
        return OpResult(check.name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", unsupported=True)
    if check.name in PERTURB:
        dev_out = PERTURB[check.name](dev_out)
    return _judge(check.name, dev_out, cpu_out, check.atol, check.rtol)


def model_forward(model: nn.Module, probe: torch.Tensor, device: torch.device, prepare: Callable[[torch.Tensor], torch.Tensor]) -> OpResult:
    """The recipe's model on a probe batch: a CPU deep copy against the device model, eval mode.

    `prepare` is applied to the raw batch on each device (the dataset's transform,
    channels_last), as the engine does. The device model's train/eval flags are
    restored afterwards; no gradients, no state change.
    """
    name = "model_forward"
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            try:
                cpu_model = copy.deepcopy(model).to("cpu").eval()
                want = cpu_model(prepare(probe.clone())).float()
                got = model(prepare(_to(probe, device))).float().detach().cpu()
            except Exception as e:  # noqa: BLE001
                return OpResult(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", unsupported=True)
    finally:
        for m, mode in modes.items():
            m.training = mode
    outs: tuple[torch.Tensor, ...] = (got,)
    if name in PERTURB:
        outs = PERTURB[name](outs)
    return _judge(name, outs, (want,), atol=1e-5, rtol=1e-3)


def run(
    device: torch.device,
    mode: str = "on",
    model: nn.Module | None = None,
    probe: torch.Tensor | None = None,
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
    checks: Sequence[Check] | None = None,
) -> Report:
    """Run every check (and the model forward, when given) on `device` against the CPU."""
    if mode == "off":
        return Report("off", mode, str(device))
    if not applies(device):
        return Report("skipped (cpu)", mode, str(device))
    key = (str(device), mode)
    reuse = REUSE_OPS and checks is None and not PERTURB and key in _OPS_DONE
    checks = [] if reuse else list(CHECKS.values()) if checks is None else list(checks)
    results: list[OpResult] = list(_OPS_DONE[key]) if reuse else []
    with strict_math():
        # One tiny matmul first: it initialises the device's math library (cuBLAS
        # handles, MPS graph caches), a one-off cost training pays anyway; the
        # timed part is the checks themselves.
        _warm = _to(torch.ones(4, 4), device)
        (_warm @ _warm).sum().cpu()
        devices.synchronize(device)
        t0 = time.perf_counter()
        for c in checks:
            results.append(run_check(c, device))
        if model is not None and probe is not None:
            results.append(model_forward(model, probe, device, prepare or (lambda x: x)))
        devices.synchronize(device)
        elapsed = time.perf_counter() - t0
    if REUSE_OPS and not reuse and not PERTURB and len(checks) == len(CHECKS):
        _OPS_DONE[key] = [r for r in results if r.name in CHECKS]
    report = Report("passed", mode, str(device), elapsed, results)
    if report.failures:
        report.status = "failed" if mode == "on" else "warned"
    return report


# ----------------------------------------------------------------------------- runner hook


def probe_batch(dataset: Any, n: int = PROBE_SIZE) -> torch.Tensor | None:
    """The first `n` raw inputs of a dataset (CPU), or None when it yields no tensors."""
    from torch.utils.data import DataLoader

    try:
        x, *_ = next(iter(DataLoader(dataset, batch_size=n, shuffle=False)))
    except Exception:  # noqa: BLE001 - an odd dataset skips the model check, not the run
        return None
    return x if torch.is_tensor(x) else None


def check(mode: str, device: torch.device, model: nn.Module, splits: Any, channels_last: bool) -> Report:
    """The canary for a run's parts: `mode` (the recipe's `canary:`), its device, its eager model (not
    wrapped by torch.compile or DDP), its DataSplits (the probe comes from the validation split, through
    the splits' transform) and whether inputs are channels_last.

    Apart from `guard` so set-up can run it before the Setup exists (runner.prepare: while the optimizer's
    import of torch._dynamo is still under way on its thread, the main thread would only wait)."""
    transform = splits.transform

    def prepare(x: torch.Tensor) -> torch.Tensor:
        if transform is not None:
            x = transform(x)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    global LAST_S
    t0 = time.perf_counter()
    probe = probe_batch(splits.val) if applies(device) and mode != "off" else None
    report = run(device, mode, model, probe, prepare)
    LAST_S = time.perf_counter() - t0
    return report


def guard(setup: Any, set_tags: Callable[[dict[str, str]], None], note: Callable[[str], None]) -> Report:
    """The runner's hook: run the canary for a prepared Setup (or take the report set-up made, `setup.canary`),
    record tags, stop on failure.

    Raises CanaryFailed when an operation differs and the recipe says `canary: on`.
    """
    report = getattr(setup, "canary", None)
    if not isinstance(report, Report):
        model = getattr(setup.model, "_orig_mod", setup.model)  # the eager module under torch.compile
        model = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
        report = check(setup.resolved.recipe.canary, setup.choice.device, model, setup.splits, setup.options.channels_last)
    set_tags(report.tags())
    for r in report.unsupported:
        note(f"canary: {r.name} is unsupported on {report.device} ({r.detail}); not checked")
    if report.results and report.time_s > BUDGET_S and not report.when:
        note(f"canary: took {report.time_s:.2f} s, over its {BUDGET_S:.0f} s budget")
    if report.status == "failed":
        raise CanaryFailed(report)
    if report.status == "warned":
        note(report.message().replace("canary:", "canary (warn):", 1))
    return report
