"""Test setup: 8 simulated CPU devices (set before jax initialises), GPU-marker skipping.

On a GPU machine the same kernel tests run compiled (`INTERPRET` is False there).
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
ON_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
# Mosaic kernels: compiled on sm90, the GPU interpreter on CPU, nothing on other GPUs.
needs_hopper = pytest.mark.skipif(
    ON_GPU and not ON_HOPPER, reason="compiled Mosaic GPU kernels need an sm90 GPU"
)


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled kernels); CPU runs interpret mode")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
