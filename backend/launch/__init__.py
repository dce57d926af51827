"""Launching: loraplex-serve, the tritonserver wrapper, our processes."""
