"""The networks: architectures (torchvision, timm, CIFAR ResNets), weight files, the lineage of
weights (the resolutions they were trained at), input preprocessing, the sizes a model runs at,
synchronised BatchNorm and the weights' EMA."""
