"""A small seeded transformer (NNX and Linen) for demos, examples and tests."""

from ._src.toy import Block as Block
from ._src.toy import LinenBlock as LinenBlock
from ._src.toy import LinenToyTransformer as LinenToyTransformer
from ._src.toy import ToyConfig as ToyConfig
from ._src.toy import ToyTransformer as ToyTransformer

__all__ = ["Block", "LinenBlock", "LinenToyTransformer", "ToyConfig", "ToyTransformer"]
