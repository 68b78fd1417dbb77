"""A fused group's own GPU kernels: Triton convolutions over packed members (tconv) and where they may run (convcheck)."""
