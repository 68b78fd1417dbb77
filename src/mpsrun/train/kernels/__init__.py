"""Triton kernels that the captured CUDA steps run in place of torch's: fused layers, cross-entropy, max-pool, batch-norm statistics.

Each module imports Triton only when its kernels are first built, and only a CUDA run builds them;
each checks its answers against torch's before a capture uses them, and a mismatch falls back to
torch's ops with a note on the run.
"""
