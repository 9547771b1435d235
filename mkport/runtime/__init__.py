"""The runtime floor: the torch side that loads weights and runs the compiled decode step (and its references in
torch: the CPU model, CUDA graphs, the prefill)."""
