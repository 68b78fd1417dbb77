"""The training controls a recipe turns on: schedulers, clipping (and its kernels), early stopping, the callback contract.

The pieces the loop calls; `train/assemble.py`, one floor up, turns a recipe's sections into them.
"""
