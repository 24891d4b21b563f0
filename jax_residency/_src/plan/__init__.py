"""The model as placement sees it, and the plan of its bytes: the split into static
leaves and layer stacks, argument checks, shardings and memory kinds, memory items,
budgets and `ModelMetadata`. Decides; moves no weight.
"""
