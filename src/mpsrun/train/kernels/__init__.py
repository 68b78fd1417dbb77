"""Triton kernels that the captured CUDA steps run in place of torch's: fused layers, cross-entropy, max-pool, batch-norm statistics.

Each module imports Triton only when its kernels are first built, and only a CUDA run builds them;
each checks its answers against torch's before a capture uses them, and a mismatch falls back to
torch's ops with a note on the run.
"""


OFF = ("0", "false", "no", "off")


def switched_off(env: str) -> bool:
    """Whether the environment switch `env` (MPSRUN_FUSED_*, on by default) turns its kernels off."""
    import os

    return os.environ.get(env, "1").strip().lower() in OFF


def kernels_off(env: str) -> str | None:
    """Why the Triton kernels behind the switch `env` cannot be used here (the switch off, Triton not importable),
    in a note's words, or None. Importing Triton is the check: CUDA builds of torch ship it, others may not."""
    if switched_off(env):
        return f"{env}=0"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - said where it is missing or broken
        return f"triton is not importable ({type(e).__name__})"
    return None


def vjp(output, inputs, grad):  # type: ignore[no-untyped-def]
    """`torch.autograd.grad(output, inputs, grad)` without handing autograd a gradient tensor: the gradients of
    `(output * grad).sum()`, the same numbers (the product's gradient with respect to `output` is `grad` exactly).

    Why: given a gradient tensor, torch's `autograd.grad` checks its shape with torch.fx's symbolic shapes, whose first
    import loads sympy: 2.4-3.0 s on the H200 machine, nearly all of it compiling sympy's sources. A solo run imports
    it anyway (torch's optimizers import torch._dynamo); a fused sweep group imports neither, and paid it in its first
    max-pool check, on the clock of its first epoch (a 3.3 s check of which 2.95 s was this import).
    """
    import torch

    return torch.autograd.grad((output * grad).sum(), inputs)
