"""What is trained: models, data (partitioners, loaders) and local training / evaluation.

Both sides use it: devices train with it, the coordinator builds the initial model,
evaluates centrally and exports bundles with it.
"""
