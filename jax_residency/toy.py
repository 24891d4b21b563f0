"""A small seeded transformer (NNX and Linen) for demos, examples and tests."""

from ._src.models.toy import Block as Block
from ._src.models.toy import LinenBlock as LinenBlock
from ._src.models.toy import LinenToyTransformer as LinenToyTransformer
from ._src.models.toy import ToyConfig as ToyConfig
from ._src.models.toy import ToyTransformer as ToyTransformer

__all__ = ["Block", "LinenBlock", "LinenToyTransformer", "ToyConfig", "ToyTransformer"]
