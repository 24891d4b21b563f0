"""Running a placement: `place`, `PlacedModel`, and the executors (jitted for
``FullyResident``/``LayerwiseHost``, dense for ``DenseDiskStream``). The only code
that picks an engine for a policy.
"""
