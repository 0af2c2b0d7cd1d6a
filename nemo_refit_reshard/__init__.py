"""nemo-refit-reshard: refit as a reshard between training and inference layouts."""

__version__ = "0.1.0"
