"""What one model costs at one setting, measured on this device: forward GFLOPs per image
(``torch.utils.flop_counter.FlopCounterMode``, a multiply-add counted as 2 FLOPs: twice the figures
of torchvision's model table, e.g. resnet50 8.18 against its 4.09 at 224 px), training and
inference images per second, and peak memory.

Training runs the project's own step (:func:`fixres_dist.training.engine.train_step`: uint8 images
normalised on the device, autocast, channels-last, fp16 loss scaling; SGD with momentum) on one
random batch, inference the model in eval mode under ``torch.no_grad``; each after warm-up steps
(allocations, cuDNN's search, compilation), each step timed between device synchronisations, the
median taken. Inference is measured first. Peak memory:
CUDA ``max_memory_allocated`` of each phase on a GPU; on the CPU the process' peak resident set
(``VmHWM``, reset before each phase where Linux allows), which includes the interpreter and
libraries.
"""
from __future__ import annotations

import statistics
import time

import attrs
import torch
from torch.utils.flop_counter import FlopCounterMode

from fixres_dist.data.pipeline import to_device
from fixres_dist.errors import first_line
from fixres_dist.models import architectures
from fixres_dist.reporting.step_times import peak_memory, reset_peak_memory
from fixres_dist.training import engine


@attrs.frozen
class Setting:
    """One point of the grid: ``architecture`` at ``size`` pixels, ``batch`` images per step, ``amp``
    (``off``/``bf16``/``fp16``), ``channels_last``, ``compile`` (a torch.compile backend or None)."""

    architecture: str
    size: int
    batch: int
    amp: str = "off"
    channels_last: bool = False
    compile: str | None = None

    def variant(self) -> str:
        """The setting less architecture and size, in words: ``"b64 bf16 CL compile=inductor"``."""
        return (f"b{self.batch} {self.amp}" + (" CL" if self.channels_last else "")
                + (f" compile={self.compile}" if self.compile else ""))


@attrs.frozen
class Cost:
    """A setting's figures: ``gflops`` forward GFLOPs per image; ``train``/``inference`` images per
    second; ``train_peak_gib``/``inference_peak_gib`` GiB; ``error``: why it could not be measured
    (one line; the figures are then None)."""

    setting: Setting
    gflops: float | None = None
    train: float | None = None
    inference: float | None = None
    train_peak_gib: float | None = None
    inference_peak_gib: float | None = None
    error: str | None = None


def forward_gflops(model: torch.nn.Module, size: int, device: torch.device) -> float:
    """Forward GFLOPs for one ``size`` x ``size`` image (a batch of 2, halved: BatchNorm in eval mode)."""
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(2, 3, size, size, device=device))
    return counter.get_total_flops() / 2 / 1e9


def step_seconds(run, steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` timed calls of ``run()`` (each between device synchronisations), after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def timed(run, steps: int, warmup: int, device: torch.device) -> float:
    """Seconds per call of ``run()``: the median of :func:`step_seconds`; a median resists a burst of other work."""
    return statistics.median(step_seconds(run, steps, warmup, device))


def measure(setting: Setting, device: torch.device, num_classes: int = 1000, steps: int = 10,
            warmup: int = 3) -> Cost:
    """The :class:`Cost` of ``setting`` on ``device``: ``steps`` timed training steps and forward passes
    after ``warmup`` each. A failure while measuring (out of memory, a compiler error) is the
    cost's ``error``, not an exception."""
    try:
        model = architectures.build_model(setting.architecture, num_classes, image_size=setting.size)
        memory_format = torch.channels_last if setting.channels_last else torch.contiguous_format
        model = model.to(device, memory_format=memory_format)
        gflops = forward_gflops(model, setting.size, device)
        forward = torch.compile(model, backend=setting.compile) if setting.compile else model
        amp = engine.AMP_DTYPES[setting.amp]
        generator = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (setting.batch, 3, setting.size, setting.size), dtype=torch.uint8,
                               generator=generator).to(device)
        labels = torch.randint(0, num_classes, (setting.batch,), generator=generator).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type, enabled=setting.amp == "fp16")

        def train():
            engine.train_step(forward, optimizer, scaler, images, labels,
                              engine.StepSettings(device, amp=amp, channels_last=setting.channels_last))

        def infer():
            with torch.no_grad(), engine.autocast(device, amp):
                forward(to_device(images, device, setting.channels_last))

        model.eval()  # inference first: a CPU's resident set does not shrink after training
        reset_peak_memory(device)
        infer_seconds = timed(infer, steps, warmup, device)
        infer_peak = peak_memory(device)[0] / 2**30
        model.train()
        reset_peak_memory(device)
        train_seconds = timed(train, steps, warmup, device)
        return Cost(setting, gflops, setting.batch / train_seconds, setting.batch / infer_seconds,
                    peak_memory(device)[0] / 2**30, infer_peak)
    except (RuntimeError, ValueError, AssertionError, TypeError, NotImplementedError) as exc:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return Cost(setting, error=f"{type(exc).__name__}: {first_line(exc)}")
