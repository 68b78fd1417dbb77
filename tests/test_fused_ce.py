"""The fused cross-entropy (train/kernels/fused_ce.py): its kernel's arithmetic, and when a run uses it.

The kernel runs here in Triton's CPU interpreter (TRITON_INTERPRET=1, a child process);
on a CUDA machine the `_cuda` test runs the compiled kernel against torch's.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from mpsrun.train.kernels import fused_ce
from mpsrun.train.loop.losses import TaskLoss
from tests.proc_helpers import in_triton_interpreter

CHECK = """
import torch, json
from mpsrun.train.kernels import fused_ce
torch.manual_seed(0)
out = []
# (rows, classes): the fashion step, a short tail batch, several row blocks, many classes, bf16 logits
for n, c, dtype in [(64, 10, torch.float32), (7, 3, torch.float32), (300, 100, torch.float32), (33, 1000, torch.float32), (64, 10, torch.bfloat16)]:
    x = (torch.randn(n, c) * 4).to(dtype).requires_grad_()
    y = torch.randint(0, c, (n,))
    y[1] = -100  # ignored, as torch's ignore_index
    s = torch.tensor(1.5)
    loss = fused_ce.cross_entropy(x, y, s)
    loss.backward(torch.tensor(2.0))
    x2 = x.detach().clone().requires_grad_()
    ref = nn_loss = torch.nn.functional.cross_entropy(x2.float(), y)
    (ref * 2).backward()
    with torch.no_grad():
        plain = fused_ce.cross_entropy(x, y)
    out.append([n, c, str(dtype), abs(loss.item() - ref.item()), (x.grad.float() - x2.grad.float()).abs().max().item(),
                abs(s.item() - (1.5 + ref.item() * n)), abs(plain.item() - ref.item()), str(x.grad.dtype)])
print(json.dumps(out))
"""


def test_fused_cross_entropy_matches_torch_in_tritons_interpreter() -> None:
    rows = in_triton_interpreter(CHECK)
    assert len(rows) == 5
    for n, c, dtype, dloss, dgrad, dsum, dplain, gdtype in rows:
        tol = 1e-2 if "bfloat16" in dtype else 1e-5
        assert dloss < tol and dplain < tol, (n, c, dtype, dloss, dplain)
        assert dgrad < tol, (n, c, dtype, dgrad)  # (softmax - onehot) / n, zero on the ignored row, times the incoming 2
        assert dsum < tol * n, (n, c, dtype, dsum)  # the epoch's sum got mean * n in the same kernel
        assert gdtype == dtype.replace("torch.", "torch.")  # the gradient in the logits' own dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cross_entropy_matches_torch_cuda() -> None:
    torch.manual_seed(0)
    for n, c in [(64, 10), (256, 1000), (5, 2)]:
        x = torch.randn(n, c, device="cuda", requires_grad=True)
        y = torch.randint(0, c, (n,), device="cuda")
        s = torch.zeros((), device="cuda")
        loss = fused_ce.cross_entropy(x, y, s)
        loss.backward()
        x2 = x.detach().clone().requires_grad_()
        ref = nn.functional.cross_entropy(x2, y)
        ref.backward()
        assert abs(loss.item() - ref.item()) < 1e-5 and abs(s.item() - ref.item() * n) < 1e-3 * n
        assert (x.grad - x2.grad).abs().max().item() < 1e-6


def test_which_losses_fuse_and_what_the_run_is_told() -> None:
    """Only plain cross-entropy on CUDA fuses; a CUDA run that cannot is told why; other devices hear nothing."""
    cuda = torch.device("cuda")
    plain = TaskLoss(nn.CrossEntropyLoss(), "classification", "cross_entropy")
    assert plain.fuse(torch.device("cpu"), 64, 10) == "" and not plain.fused
    smooth = TaskLoss(nn.CrossEntropyLoss(label_smoothing=0.1), "classification", "cross_entropy")
    assert "label smoothing" in smooth.fuse(cuda, 64, 10) and not smooth.fused
    big = TaskLoss(nn.CrossEntropyLoss(), "classification", "cross_entropy")
    assert "above the one-program kernel" in big.fuse(cuda, 4096, 1000) and not big.fused
    mse = TaskLoss(nn.MSELoss(), "regression", "mse")
    assert mse.fuse(cuda, 64, 1) == "" and not mse.fused
    pytest.importorskip("triton")
    assert plain.fuse(cuda, 64, 10) == "" and plain.fused


def test_summed_adds_mean_times_rows_on_the_torch_path() -> None:
    """What the step adds to the epoch's loss sum, unfused (every device but CUDA): mean * len(y)."""
    loss = TaskLoss(nn.CrossEntropyLoss(), "classification", "cross_entropy")
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    s = torch.tensor(2.0)
    out = loss.summed(x, y, s)
    ref = nn.functional.cross_entropy(x, y)
    assert out.item() == pytest.approx(ref.item()) and s.item() == pytest.approx(2.0 + 6 * ref.item())
