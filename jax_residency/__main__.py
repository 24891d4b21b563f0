"""``python -m jax_residency``: the ``jax-residency`` command line."""

import sys

from jax_residency._src.cli.main import main

if __name__ == "__main__":
  sys.exit(main())
