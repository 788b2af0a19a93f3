"""Retrievers that rank every key by a cheap inner product over r of the d dimensions and score only the best
``budget`` keys exactly: SparQ (the query's r largest channels), Loki (the keys' r leading principal components) and
Double Sparsity (the head's r heaviest channels, calibrated on the prefill)."""

from anns_lab_lowrank.double_sparsity import DoubleSparsity
from anns_lab_lowrank.loki import Loki
from anns_lab_lowrank.sparq import SparQ

__all__ = ["DoubleSparsity", "Loki", "SparQ"]
