"""The kernel floor: model spec, GPU targets, launch plan, rendering, compiling and the build cache. Imports no
torch."""
