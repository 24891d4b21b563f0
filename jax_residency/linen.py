"""Linen support: the transform that stands in for ``nn.scan`` over a layer stack."""

from ._src.placement.linen import scan as scan

__all__ = ["scan"]
