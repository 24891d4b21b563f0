"""The package version (also `jax_residency.__version__`)."""

__version__ = "0.1.0"
