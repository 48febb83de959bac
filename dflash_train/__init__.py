"""dflash-train: train DFlash block-diffusion drafters for speculative decoding."""

import logging as _logging

__version__ = "0.1.0"

# transformers imports torchao (the `fp8` extra) whenever it is installed. torchao then warns
# about native extensions it cannot load (its float8 training needs none) and, through torch,
# about how it registers its enums: noise on every run, kept out of our logs.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
