"""Units at rest: the unit store's layout and read path (buffers, handles, mapped
reads), writing stores, and converting checkpoints.
"""
