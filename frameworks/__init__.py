"""Framework adapters: ``grace.ops.Ops`` and Horovod's collectives over each framework, and the Horovod
wrappers (``frameworks.torch.DistributedOptimizer``, ``frameworks.tensorflow.DistributedGradientTape``,
...). Importing ``frameworks`` imports no framework; each subpackage imports its own on first use."""
