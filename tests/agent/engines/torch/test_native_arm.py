"""Our CPU kernels on an Arm board: never used (they are x86-64 code), and the reason says so.
(A file of its own: test_native_kernels.py's module fixture patches cpu_kernels while it runs.)"""

from __future__ import annotations

import torch

from deployer.agent.engines.torch import native


def test_on_an_arm_board_torchs_kernels_serve_and_the_reason_says_ours_are_x86(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    found, why = native.cpu_kernels()
    assert (
        found is None and why == "ours are x86-64 (AVX2) code; on aarch64 torch's own kernels serve (SVE256)"
    )
