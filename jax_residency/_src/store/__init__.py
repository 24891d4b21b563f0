"""Units at rest: the unit store's layout and read path (buffers, handles, mapped
reads), read options, and writing and checking stores.
"""
