"""A dense disk stream: the staged forward, the engine, its byte-bounded tiers (the
ledger) and the background reader.
"""
