"""Putting a model's weights in place: the model split, the budget plan, shardings and
memory kinds, the unit loop, and `place`.
"""
