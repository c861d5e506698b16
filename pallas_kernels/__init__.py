"""Fused Pallas kernels behind ``implementation="pallas"``.

Kernels take plain arrays and static integers and never import ``jaxquant``,
so the two packages cannot import each other in a circle. None is built yet:
the fused dequantize, quantized add and dynamic quantize kernels arrive with
the Pallas issue, each beside its pure-XLA reference.
"""
