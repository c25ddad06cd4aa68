"""tauflow trainer: policy optimisation on the trajectory groups the queue delivers."""

__version__ = "0.1.0"
