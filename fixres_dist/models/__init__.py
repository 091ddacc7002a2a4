"""The networks: architectures (torchvision, timm, CIFAR ResNets), weight files, the lineage of
weights (the resolutions they were trained at), input preprocessing, the sizes a model runs at,
synchronised BatchNorm, the weights' EMA, the residual blocks that sharding acts on, and the
memory a training step needs (estimated before a run starts)."""
