"""The repeated blocks of a classifier: the units that sharding and activation checkpointing act on.

FSDP2 (``torch.distributed.fsdp.fully_shard``) gathers a module's parameters as one unit before its
forward and frees them after; activation checkpointing keeps a module's input and recomputes its
inside during the backward. Both work best per residual block: a transformer encoder block, a ResNet
or CIFAR ResNet basic/bottleneck block, a ConvNeXt block, an EfficientNet/MobileNet inverted
residual, a Swin block (torchtitan and Lightning shard per transformer block; timm checkpoints per
block with ``--grad-checkpointing``). :func:`blocks` finds them by their class, torchvision's, timm's
and efficientnet-lite's, outermost first: a block inside a block is not a unit of its own.
"""
from __future__ import annotations

from torch import nn

# Class names of residual blocks in torchvision (resnet, vision_transformer, convnext, efficientnet,
# mobilenetv2/v3, swin_transformer, regnet, maxvit, shufflenetv2, mnasnet), timm (vision_transformer,
# convnext, efficientnet/mobilenet builders, swin, resnet) and efficientnet-lite-pytorch.
BLOCK_TYPES = frozenset({
    "BasicBlock", "Bottleneck", "EncoderBlock", "CNBlock", "MBConv", "FusedMBConv", "InvertedResidual",
    "SwinTransformerBlock", "SwinTransformerBlockV2", "ResBottleneckBlock", "MaxVitBlock", "_InvertedResidual",
    "Block", "ResPostBlock", "ParallelScalingBlock", "ConvNeXtBlock", "DepthwiseSeparableConv", "EdgeResidual",
    "UniversalInvertedResidual", "MBConvBlock",
})


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model``'s residual blocks as ``(qualified name, module)`` in forward order, outermost only
    (a block nested in another block is part of it); empty for a model of no known family."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in BLOCK_TYPES:
            continue
        if found and name.startswith(found[-1][0] + "."):
            continue  # inside the previous block
        found.append((name, module))
    return found
