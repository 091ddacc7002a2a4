"""``python -m fixres_dist.bench`` (issue 27): the cost table of two architectures at three
resolutions, its JSON, its plot and FixRes' trade; bad input refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import shown_commands as shown
from fixres_dist.bench import __main__ as bench
from fixres_dist.bench import cost
from fixres_dist.models import architectures


def test_the_table_of_two_architectures_at_three_resolutions(tmp_path, capsys):
    """docs/profiling.md's command, shrunk to CIFAR-sized models and images for 2 CPU cores."""
    command = shown.argv(shown.command("python -m fixres_dist.bench --architectures"))
    assert command[3:7] == ["--architectures", "resnet50,vit_b_16", "--sizes", "128,160,224"]
    photos = tmp_path / "photos"
    photos.mkdir()
    for number in range(3):  # the input pipeline's cost is measured on real image files: three small JPEGs
        Image.fromarray(np.random.default_rng(number).integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(
            photos / f"{number}.jpg", quality=90)
    costs = bench.main(["--architectures", "resnet20,resnet18", "--sizes", "32,48,64", "--batch", "4", "--steps", "3",
                        "--warmup", "1", "--num-classes", "10", "--json", str(tmp_path / "cost.json"),
                        "--plot", str(tmp_path / "cost.png"), "--input-images", str(photos)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("python -m fixres_dist.bench: 6 settings on cpu")
    assert out[1] == f"python -m fixres_dist.bench: input pipeline on 3 image files ({photos})"
    assert out[2] == "| " + " | ".join(bench.COLUMNS + bench.INPUT_COLUMNS) + " |"
    rows = [line.strip("|").split("|") for line in out[4:10]]
    assert all(float(r[-1]) > 0 and float(r[-2]) > 0 for r in rows)  # the input pipeline's ms per image
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(a, s) for a in ("resnet20", "resnet18") for s in (32, 48, 64)]
    assert all(c.error is None and c.train > 0 and c.inference > 0 and c.train_peak_gib > 0.05 for c in costs)
    for name in ("resnet20", "resnet18"):  # convolutions: compute grows with the pixels, about 4x from 32 to 64 px
        flops = [c.gflops for c in costs if c.setting.architecture == name]
        assert flops[0] < flops[1] < flops[2] and 3.5 < flops[2] / flops[0] < 4.5, flops
    # torchvision's model table: resnet18 1.81 and resnet50 4.09 GFLOPS at 224 px, a multiply-add counted once
    for name, listed in (("resnet18", 1.81), ("resnet50", 4.09)):
        counted = cost.forward_gflops(architectures.build_model(name, 1000), 224, torch.device("cpu"))
        assert abs(counted - 2 * listed) < 0.02, (name, counted)
    trade = [line for line in out if line.startswith("FixRes, ")]
    assert len(trade) == 2 and trade[0].startswith("FixRes, resnet20 b4 off: training at 32 px costs ")
    assert "of training at 64 px per image" in trade[0] and "then testing at 64 px runs at" in trade[0]
    assert "; the input pipeline (train transform, one core) " in trade[0] and " img/s per loader core)" in trade[0]
    saved = json.loads((tmp_path / "cost.json").read_text())
    assert len(saved["rows"]) == 6 and saved["fixres"] == trade
    assert [c["size"] for c in saved["input_ms_per_image"]] == [32, 48, 64]
    assert saved["rows"][0]["setting"] == {"architecture": "resnet20", "size": 32, "batch": 4, "amp": "off",
                                           "channels_last": False, "compile": None}
    assert (tmp_path / "cost.png").read_bytes()[:4] == b"\x89PNG"


def test_a_broken_input_image_is_named_before_anything_is_measured(tmp_path, capsys):
    (tmp_path / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with pytest.raises(SystemExit) as refused:
        bench.main(["--architectures", "resnet20", "--sizes", "32", "--input-images", str(tmp_path)])
    captured = capsys.readouterr()
    assert refused.value.code == 1 and captured.out == ""  # nothing measured
    assert captured.err.strip() == (f"python -m fixres_dist.bench: --input-images {tmp_path}: unreadable image "
                                    f"{tmp_path / 'a.jpg'} (OSError: Truncated File Read); remove it from the folder")


@pytest.mark.parametrize("args, status, message", [
    (["--architectures", "resnet81", "--sizes", "32"], 1, "did you mean resnet18"),
    (["--architectures", "vit_b_16", "--sizes", "100"], 1, "vit_b_16"),
    (["--architectures", "alexnet", "--sizes", "32"], 1, "the smallest size it runs at is 63 px"),
    (["--architectures", "resnet20", "--sizes", "32,0"], 2, "--sizes: must be a positive whole number"),
    (["--architectures", "resnet20", "--sizes", "32", "--amp", "fp8"], 2, "'fp8' is not one of off, bf16, fp16"),
    (["--architectures", "resnet20", "--sizes", "32,64", "--fixres", "48:64"], 1, "must be among --sizes"),
    (["--architectures", "resnet20", "--sizes", "32,64", "--fixres", "64:32"], 1, "TRAIN < TEST"),
    (["--architectures", "resnet20", "--sizes", "32,5000"], 1, "--sizes 5000: at most 4096 px"),
    (["--architectures", "resnet20", "--sizes", "32", "--compile", "bogus"], 1, "--compile bogus: not a torch.compile"),
    (["--architectures", "resnet20", "--sizes", "32", "--amp", "fp16", "--device", "cpu"], 1, "--amp fp16 needs a GPU"),
    (["--architectures", "resnet20", "--sizes", "32", "--plot", "cost.txt"], 1, "name a .png, .pdf, .svg, .jpg file"),
    (["--architectures", "resnet20", "--sizes", "32", "--input-images", "/no/such"], 1,
     "--input-images /no/such: not a folder"),
    (["--architectures", "resnet20", "--sizes", "32", "--json", "/proc/cost.json"], 1,
     "--json /proc/cost.json: cannot write there"),
])
def test_bad_input_is_one_line(args, status, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == status and len(err.splitlines()) == 1 and message in err, err
