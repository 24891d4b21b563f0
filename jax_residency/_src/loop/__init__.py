"""The layer loop models call (`scan_units`, the Linen `scan`), the context a
placement sets for it, and finding a model's stacks by tracing its forward.
"""
