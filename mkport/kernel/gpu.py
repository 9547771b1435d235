"""GpuTarget: what the tiling rule needs to know about a GPU, read from the device or from a table."""

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
    "sm_120": GpuTarget("sm_120", "NVIDIA RTX 5090 (table)", 170, 101376, 65536, 1536),
}


def target_for_arch(arch: str) -> GpuTarget:
    if arch not in KNOWN_TARGETS:
        raise MkportError(f"arch '{arch}' is not supported; supported: {', '.join(KNOWN_TARGETS)}")
    return KNOWN_TARGETS[arch]


def current_device_target(device_index: int = 0) -> GpuTarget:
    """The target read off the present CUDA device (needs torch with CUDA)."""
    import torch

    if not torch.cuda.is_available():
        raise MkportError("no CUDA GPU is visible; the megakernel needs one (use --arch to render/compile only)")
    props = torch.cuda.get_device_properties(device_index)
    arch = f"sm_{props.major}{props.minor}"
    smem = getattr(props, "shared_memory_per_block_optin", 0) or KNOWN_TARGETS.get(arch, KNOWN_TARGETS["sm_80"]).smem_per_block
    return GpuTarget(
        arch=arch,
        name=props.name,
        sm_count=props.multi_processor_count,
        smem_per_block=int(smem),
        regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
        max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 2048)),
    )
