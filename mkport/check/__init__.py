"""The check floor: the float32 reference (transformers' own classes) and the layer-by-layer diff against it."""
