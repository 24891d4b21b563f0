"""Quantized weights at rest: the schemes (int8 per output channel, int4 in groups),
encoding on the host and decoding in JAX. Imports only ``errors`` below it.
"""
