"""Which image sizes a model runs at, measured before anything is written.

Many architectures run only at some sizes: alexnet needs 63 px or more, inception_v3 75 px,
maxvit_t sizes whose feature maps its 7x7 windows tile (the smallest is 221 px), a ViT multiples of
its patch size, a timm model without dynamic sizes only the size it was built for. Rather than a
table of rules, :func:`check_run_sizes` *measures*: it builds the model with its parameters and
buffers on the meta device (:func:`build_on_meta`: no memory, no initialisation, no weights) and
runs one forward pass of a batch of zeros at every size the run will use, in the mode it will be
used in (training: the trainable layers in training mode, with ``min(batch, 2)`` images, which is
what a BatchNorm on 1x1 maps refuses at batch 1; evaluation: eval mode, 2 images), under
``torch.no_grad``. A forward pass that needs real numbers (an operation without a meta kernel)
is repeated on the CPU. A size that fails is refused in one line with the model's own error and
the sizes it runs at nearby, also measured (:func:`supported_sizes_near`): the smallest size when
the requested one is too small, else the nearest below and above.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from fixres_dist.config import MAX_RESOLUTION
from fixres_dist.errors import FixresError, first_line
from fixres_dist.fixres import finetuning
from fixres_dist.models import architectures

# Steps of the sizes tried around a size that fails: multiples of these (7: window sizes, 14/16: patches).
_GRIDS = (1, 2, 4, 7, 8, 14, 16, 28, 32)
_PROBE_ERRORS = (RuntimeError, ValueError, AssertionError, TypeError, IndexError, NotImplementedError, FixresError)


class NotLogits(FixresError):
    """The model's output is not a (batch, classes) tensor of logits (e.g. auxiliary outputs in training)."""


def _needs_real_numbers(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


@contextlib.contextmanager
def _registered_on_meta():
    """Parameters and buffers go to the meta device as modules register them; other tensors (a
    builder's own arithmetic: RegNet computes its widths with tensors) stay on the CPU."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def buffer(module, name, tensor, persistent=True):
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def build_on_meta(name: str, num_classes: int, image_size: int, low_res_stem: bool = False) -> nn.Module:
    """:func:`fixres_dist.models.architectures.build_model` with every parameter and buffer on the meta device."""
    def build():
        return architectures.build_model(name, num_classes, image_size=image_size, low_res_stem=low_res_stem)
    try:
        with torch.device("meta"):
            return build()
    except _PROBE_ERRORS as exc:
        if not _needs_real_numbers(exc):
            raise
    with _registered_on_meta():
        return build()


class Probe:
    """Forward passes of zeros through architecture ``name`` (as :func:`fixres_dist.models.architectures.build_model`
    builds it for ``build_size`` pixels) at other sizes; results cached per (size, training)."""

    def __init__(self, name: str, num_classes: int, build_size: int, *, low_res_stem: bool = False,
                 batch: int = 2, prepare: Callable[[nn.Module, int], None] | None = None):
        self.name, self.num_classes, self.build_size, self.low_res_stem = name, num_classes, build_size, low_res_stem
        self.batch, self.prepare = batch, prepare
        self._models: dict[str, nn.Module] = {}
        self._results: dict[tuple[int, bool], BaseException | None] = {}

    def _model(self, device: str) -> nn.Module:
        if device not in self._models:
            if device == "meta":
                self._models[device] = build_on_meta(self.name, self.num_classes, self.build_size, self.low_res_stem)
            else:
                self._models[device] = architectures.build_model(self.name, self.num_classes,
                                                                 image_size=self.build_size,
                                                                 low_res_stem=self.low_res_stem)
        return self._models[device]

    def _forward(self, device: str, size: int, training: bool) -> None:
        model = architectures.for_resolution(self._model(device), size)
        if training and self.prepare is not None:
            self.prepare(model, size)
        else:
            model.train(training)
        images = torch.zeros(min(self.batch, 2) if training else 2, 3, size, size, device=device)
        with torch.no_grad():
            out = model(images)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(images), self.num_classes):
            what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of shape {tuple(out.shape)}"
            raise NotLogits(f"{self.name} returns {what} in {'training' if training else 'eval'} mode, not "
                            f"(batch, {self.num_classes}) logits")

    def failure(self, size: int, training: bool = False) -> BaseException | None:
        """None if the model runs on ``size`` x ``size`` images (pixels), else the exception it raised."""
        key = (size, training)
        if key not in self._results:
            try:
                try:
                    self._forward("meta", size, training)
                except _PROBE_ERRORS as exc:
                    if not _needs_real_numbers(exc):
                        raise
                    self._forward("cpu", size, training)
                self._results[key] = None
            except _PROBE_ERRORS as exc:
                self._results[key] = exc
        return self._results[key]

    def runs(self, size: int, training: bool = False) -> bool:
        """Whether a forward pass at ``size`` completes (its output may still not be logits: :class:`NotLogits`)."""
        return 1 <= size <= MAX_RESOLUTION and isinstance(self.failure(size, training), (NotLogits, type(None)))

    def not_logits(self, training: bool) -> NotLogits | None:
        """The :class:`NotLogits` failure of any size probed so far in this mode, or None."""
        return next((f for (_, mode), f in self._results.items() if mode == training and isinstance(f, NotLogits)),
                    None)


def supported_sizes_near(probe: Probe, size: int, training: bool = False) -> str:
    """Where the model runs, near ``size`` (pixels), in words: ``"the smallest size it runs at is 63 px"``,
    ``"nearest sizes it runs at: 32 and 48 px"`` or ``"it runs at no size up to 4096 px"``."""
    tries = sorted({c for g in _GRIDS for c in ((size - 1) // g * g, (size // g + 1) * g)} - {0, size})
    below = next((c for c in reversed(tries) if c < size and probe.runs(c, training)), None)
    above = next((c for c in tries if c > size and probe.runs(c, training)), None)
    if below is None:  # too small, or a coarser grid than tried: grow until it runs, then bisect down
        high = above or next((s for s in _doubling(max(size + 1, architectures.DEFAULT_SIZE))
                              if probe.runs(s, training)), None)
        if high is None:
            return f"it runs at no size up to {MAX_RESOLUTION} px"
        low = size  # fails
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if probe.runs(middle, training) else (middle, high)
        return f"the smallest size it runs at is {high} px"
    return f"nearest sizes it runs at: {below} and {above} px" if above else f"nearest size it runs at: {below} px"


def _doubling(start: int):
    size = start
    while size <= MAX_RESOLUTION:
        yield size
        size *= 2


def _not_logits(failure: NotLogits, training: bool) -> FixresError:
    return FixresError(f"{failure}: it cannot be {'trained' if training else 'evaluated'} here"
                       + (" (main_finetune.py keeps all but the head and last norm in eval mode)" if training else ""))


def check_sizes(probe: Probe, train_sizes, test_sizes) -> None:
    """Raise a one-line :class:`FixresError` for the first size the model cannot run at (train sizes in
    training mode, test sizes in eval mode), naming the size, the model's error and nearby sizes,
    or when its output is not logits (asked first at :data:`fixres_dist.models.architectures.DEFAULT_SIZE`, as
    what a model returns does not depend on the size, and at the sizes tried nearby)."""
    for training, sizes in ((True, train_sizes), (False, test_sizes)):
        if not sizes:
            continue
        probe.failure(architectures.DEFAULT_SIZE, training)
        for size in sorted(set(sizes)):
            failure = probe.failure(size, training)
            near = supported_sizes_near(probe, size, training) if failure is not None else ""
            if probe.not_logits(training):  # where it runs, measured so far
                raise _not_logits(probe.not_logits(training), training)
            if failure is not None:
                what = (f"cannot train on {size} px images with {min(probe.batch, 2)} per rank" if training
                        else f"cannot run on {size} px images")
                raise FixresError(f"{probe.name} {what} ({type(failure).__name__}: {first_line(failure)}); "
                                  f"{near} (measured by a forward pass of zeros)")


def run_sizes(config, trained_at: int | None = None) -> tuple[list[int], list[int]]:
    """``(training sizes, evaluation sizes)`` in pixels that a run of ``config`` (a TrainerConfig) uses.

    ``trained_at``: the resolution the ``--weight-path`` weights were trained at (a fixres_dist
    checkpoint's ``input_size``), evaluated before a finetune; ``config.train_size`` wins over it.
    """
    auto = config.input_size == "auto"
    train = [] if config.eval_only else list(config.test_sizes) if auto else [config.input_size]
    evaluate = list(config.test_sizes or ())
    if not auto:
        evaluate.append(config.test_size or config.input_size)
    if config.mode == "finetune" and not config.eval_only and (config.train_size or trained_at):
        evaluate.append(config.train_size or trained_at)
    if config.eval_only and config.test_sizes:
        evaluate = list(config.test_sizes)
    return train, evaluate


def build_size(config) -> int:
    """The size (pixels) a run of ``config`` builds its model for: the training resolution (the first
    of ``--test-sizes`` with ``--input-size auto``), or with ``--eval-only`` the first size evaluated."""
    if config.eval_only:
        return (config.test_sizes or (config.test_size or config.input_size,))[0]
    return config.input_size if config.input_size != "auto" else config.test_sizes[0]


def check_run_sizes(config, num_classes: int, trained_at: int | None = None) -> None:
    """Refuse, in one line, a run of ``config`` at a size its architecture cannot run at (see the
    module docstring); nothing is allocated or written. Raises :class:`FixresError`."""
    build = build_size(config)

    def prepare(model: nn.Module, size: int) -> None:
        if config.mode == "finetune":  # only what the finetune trains is in training mode
            with contextlib.suppress(FixresError):  # a bad scope is refused by the finetune's own check
                finetuning.freeze_for_finetune(model, size, config.finetune_scope, config.last_norm)
            finetuning.set_train_mode(model)
        else:
            model.train()

    train, evaluate = run_sizes(config, trained_at)
    probe = Probe(config.architecture, num_classes, build, low_res_stem=config.low_res_stem, batch=config.batch,
                  prepare=prepare)
    check_sizes(probe, train, evaluate)
