"""The bench floor: decode timing against HF eager and CUDA graphs, step timings, plots."""
