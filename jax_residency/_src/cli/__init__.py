"""The ``jax-residency`` command line: the parser and commands, the demo, the plan
table, console output.
"""
