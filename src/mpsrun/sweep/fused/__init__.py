"""Fused sweeps: trials that differ only in values (lr, weight decay, momentum, betas, seed, dropout,
label smoothing) train together as one step, parameters stacked on a leading member dimension.

Bottom to top: `layers` (a Sequential's layers run for M members at once: bmm for Linear, a
grouped convolution for Conv2d, per-member batch-norm statistics and dropout masks), `optim`
(SGD, Adam, AdamW with each member's hyperparameters as tensors, in torch's formula order),
`group` (which trials can fuse, and why not), `members` (a group built from its trials' recipes
exactly as `mpsrun run` builds each), `engine` (the epochs: each member's data order, losses,
validation, a member leaving), `record` (each member its own MLflow child run), `work` (the
worker's ask/tell loop for groups). HFTA (MLSys 2021) and torch.func's model ensembling are the
same idea; here each member still gets the numbers it would have had alone.
"""
