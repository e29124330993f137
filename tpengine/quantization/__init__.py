"""Quantized weights: the one form every checkpoint format is read into (weights.py)."""
