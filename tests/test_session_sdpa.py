"""Session(sdpa=...): which attention kernels a Session's steps may use (no GPU needed: torch's SDPA switches
are process flags)."""

from __future__ import annotations

import pytest
import torch

from concordia_ft.errors import ConfigError
from concordia_ft.session import Session, sdpa_backends


def test_reproducible_turns_cudnn_attention_off_inside_and_restores_it() -> None:
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
              torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with sdpa_backends("reproducible", "cuda"):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        with sdpa_backends("default", "cuda"):
            assert torch.backends.cuda.cudnn_sdp_enabled()
        with sdpa_backends("reproducible", "cpu"):  # a CPU session: torch's choice, unchanged
            assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before[0])


def test_an_unknown_choice_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="sdpa="):
        Session(torch.nn.Linear(2, 2), tmp_path / "log", sdpa="fast")
