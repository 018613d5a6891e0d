"""Weights in and out of a parallelized model: pretrained loading, full export, checked loads.

The package imports nothing; import from its modules.
"""
