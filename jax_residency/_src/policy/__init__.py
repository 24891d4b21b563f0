"""What a user asks for: the policy types, their load options, and byte sizes.

Pure Python (no JAX, no NumPy); imports only ``errors`` below it.
"""
