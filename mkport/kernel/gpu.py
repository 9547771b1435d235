"""GpuTarget: what the launch-plan rule needs to know about a GPU, from a table here (the present device is read by
runtime.decoder.current_device_target, with torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import MkportError


@dataclass(frozen=True)
class GpuTarget:
    arch: str  # nvcc name, e.g. sm_90
    name: str
    sm_count: int
    smem_per_block: int  # bytes a block may opt in to
    regs_per_sm: int
    max_threads_per_sm: int

    def to_dict(self) -> dict:
        return asdict(self)


# Offline targets, one representative part per architecture (used when no GPU is present).
KNOWN_TARGETS = {
    "sm_80": GpuTarget("sm_80", "NVIDIA A100 (table)", 108, 166912, 65536, 2048),
    "sm_89": GpuTarget("sm_89", "NVIDIA RTX 4090 (table)", 128, 101376, 65536, 1536),
    "sm_90": GpuTarget("sm_90", "NVIDIA H200 SXM (table)", 132, 232448, 65536, 2048),
    "sm_100": GpuTarget("sm_100", "NVIDIA B200 (table)", 148, 232448, 65536, 2048),
    "sm_120": GpuTarget("sm_120", "NVIDIA RTX 5090 (table)", 170, 101376, 65536, 1536),
}


def target_for_arch(arch: str) -> GpuTarget:
    if arch not in KNOWN_TARGETS:
        raise MkportError(f"arch '{arch}' is not supported; supported: {', '.join(KNOWN_TARGETS)}")
    return KNOWN_TARGETS[arch]
