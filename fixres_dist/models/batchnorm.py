"""BatchNorm whose batch statistics are those of all ranks' images together (synchronised BN).

In training mode a BatchNorm normalises with its batch's mean and variance and moves its running
statistics towards them. Under DDP each rank sees only its share of the global batch, so without
synchronisation both depend on the world size. Synchronised, the forward pass, the gradients and
the running statistics of a W-rank run with b images per rank equal those of one process with the
union batch of W x b images (tested: ``tests/fixres/test_fixres.py``).

On CUDA this is ``torch.nn.SyncBatchNorm``. On CPU (gloo), where torch's SyncBatchNorm refuses to
run, :class:`AllRanksBatchNorm` does the same with two differentiable all-reduces per forward
(:class:`SumOverRanks`): the per-channel sums give the global mean, then
the centred sums of squares give the global (biased) variance; the running variance takes the
unbiased one, as ``torch.nn.functional.batch_norm`` does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class SumOverRanks(torch.autograd.Function):
    """``all_reduce(SUM)`` with a gradient: the gradient of a sum over ranks is the sum over ranks.

    Every rank's loss depends on every rank's input through the global statistics, so the backward
    pass all-reduces the incoming gradient as well (as torch's SyncBatchNorm does).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group=None) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class AllRanksBatchNorm(_BatchNorm):
    """BatchNorm (any input rank >= 2: (N, C, ...)) synchronised over the process group ``group``
    (an attribute; None: the default group).

    Same parameters, buffers and ``state_dict`` keys as ``nn.BatchNorm2d``. Outside training, or
    without an initialised process group of more than one rank, it is plain batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    group = None

    @torch.compiler.disable  # collectives inside an autograd Function: run eagerly under torch.compile
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        synchronise = self.training and dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(self.group) > 1
        if not synchronise:
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype, device=input.device)
        sums = SumOverRanks.apply(torch.cat([input.sum(dims), count]), self.group)
        total = sums[-1]
        mean = sums[:-1] / total
        centred = input - mean.view(shape)
        var = SumOverRanks.apply(centred.pow(2).sum(dims), self.group) / total
        output = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * total / max(float(total) - 1, 1.0), momentum)
        return output


def synchronise(model: nn.Module, names: list[str] | None = None, device_type: str = "cpu",
                group=None) -> list[str]:
    """Replace BatchNorm layers of ``model`` in place by synchronised ones; returns the names replaced.

    ``names``: module names to consider (default: every BatchNorm). ``device_type == "cuda"`` uses
    ``torch.nn.SyncBatchNorm``, otherwise :class:`AllRanksBatchNorm`, over the ranks of ``group`` (None:
    all; a pipeline: the data-parallel ranks of a stage). Parameters and buffers are
    moved over as they are (the same ``nn.Parameter`` objects), so an optimizer built before still
    holds them and ``state_dict`` keys do not change.
    """
    kind = nn.SyncBatchNorm if device_type == "cuda" else AllRanksBatchNorm
    modules = dict(model.named_modules())
    wanted = [n for n in (names if names is not None else modules)
              if n and isinstance(modules.get(n), _BatchNorm) and not isinstance(modules[n], kind)]
    for name in wanted:
        old = modules[name]
        new = kind(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats,
                   **({"process_group": group} if kind is nn.SyncBatchNorm else {}))
        new.group = group
        new.weight, new.bias = old.weight, old.bias
        new.running_mean, new.running_var, new.num_batches_tracked = \
            old.running_mean, old.running_var, old.num_batches_tracked
        new.train(old.training)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    return wanted

