"""mpgen: a declarative model-spec compiler for model-parallel PyTorch."""

__version__ = "0.1.0"
