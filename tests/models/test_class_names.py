"""Class identity travels with the weights: checkpoints record their classes, the classifier's rows
follow the class names into a finetune or an evaluation, and a resume refuses other classes."""
from __future__ import annotations

import pytest
import torch

from conftest import FAST, SCRATCH, run_main
from fixres_dist import FixresError, TrainerConfig
from fixres_dist.entry.cli import build_parser
from fixres_dist.entry.launch import build_config
from fixres_dist.models import architectures, class_names, weights
from fixres_dist.training import checkpoint
from fixres_dist.training.network import Network

NAMES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
OTHER = [f"digit{i}" for i in range(10)]


def trained_on(classes: list[str], named: bool = True) -> weights.WeightFile:
    """A resnet20 for ``classes`` as read from a fixres_dist checkpoint (``named``: recording them)."""
    torch.manual_seed(0)
    state = architectures.build_model("resnet20", len(classes)).state_dict()
    return weights.WeightFile("w.pth", state, "model", config={}, classes=tuple(classes) if named else None)


def load_for(found: weights.WeightFile, data: list[str]):
    """Load ``found`` into a fresh resnet20 for ``data``: ``(its head's rows before, after, Loaded)``."""
    torch.manual_seed(1)
    model = architectures.build_model("resnet20", len(data))
    before = torch.cat([model.fc.weight, model.fc.bias[:, None]], 1).detach().clone()
    loaded = weights.load_weights(model, found, classes=data)
    return before, torch.cat([model.fc.weight, model.fc.bias[:, None]], 1).detach(), loaded


@pytest.mark.parametrize("data, note", [
    (NAMES[::-1], "10 kept, the shared classes in another order"),
    (NAMES + ["hat"], "10 kept, 1 new (hat)"),
    (NAMES[:9], "9 kept, 1 dropped (boot)"),
    (NAMES[:7] + ["sneakers"] + NAMES[8:], "9 kept, 1 new (sneakers), 1 dropped (sneaker)"),
    (["hat", "cap", "scarf", "glove"] + NAMES[4:1:-1], "3 kept, 4 new (hat, cap, scarf and 1 more), 7 dropped "
     "(tshirt, trouser, sandal and 4 more), the shared classes in another order"),
])
def test_the_heads_rows_follow_the_class_names(data, note):
    found = trained_on(NAMES)
    rows = torch.cat([found.state_dict["fc.weight"], found.state_dict["fc.bias"][:, None]], 1)
    fresh, after, loaded = load_for(found, data)
    assert loaded.note == f"classifier rows of fc mapped by class name: {note}"
    assert loaded.warning is None and loaded.new_head_from is None
    for i, name in enumerate(data):  # a class's trained row wherever it now is; a new class's fresh one
        assert torch.equal(after[i], rows[NAMES.index(name)] if name in NAMES else fresh[i]), name


@pytest.mark.parametrize("data", [OTHER, OTHER[:7]])
def test_weights_of_other_classes_get_a_fresh_head_and_a_warning(data):
    fresh, after, loaded = load_for(trained_on(NAMES), data)
    assert torch.equal(after, fresh) and loaded.new_head_from == 10 and loaded.note is None
    assert loaded.warning == ("the weights in w.pth share no class name with the data (theirs: tshirt, trouser, "
                              "pullover and 7 more; the data's: digit0, digit1, digit2 and "
                              f"{len(data) - 3} more): a new task, so fc is a fresh {len(data)}-class head")


def test_the_same_classes_or_none_recorded_load_as_before():
    found = trained_on(NAMES)
    rows = torch.cat([found.state_dict["fc.weight"], found.state_dict["fc.bias"][:, None]], 1)
    for weight_file in (found, trained_on(NAMES, named=False)):  # unnamed: the rows load whatever the data
        _, after, loaded = load_for(weight_file, NAMES if weight_file.classes else OTHER)
        assert torch.equal(after, rows) and loaded == weights.Loaded(None)
    with pytest.raises(FixresError, match="name 9 classes but their classifier fc has 10 rows"):
        load_for(weights.WeightFile("w.pth", found.state_dict, "model", config={}, classes=tuple(NAMES[:9])), NAMES)


def test_the_network_logs_the_mapping_and_warns_of_a_new_task(tmp_path):
    """What a rank builds (before any sharding): the mapped head, one log line; a new task: a warning."""
    config = TrainerConfig(mode="finetune", architecture="resnet20", weight_path=str(tmp_path / "w.pth"))
    for data, told in ((NAMES[1:] + ["hat"], "classifier rows of fc mapped by class name: 9 kept, 1 new (hat), "
                                             "1 dropped (tshirt)"), (OTHER, "a new task, so fc is a fresh")):
        logged, warned = [], []
        network = Network(config, data, 32, trained_on(NAMES), torch.device("cpu"), logged.append, warned.append)
        assert network.classes == data and any(told in line for line in logged + warned), (logged, warned)
        assert bool(warned) == (data is OTHER) and network.new_head == ((10, 10) if data is OTHER else None)


def test_messages_shorten_long_lists():
    assert class_names.some(["a", "b"]) == "a, b"
    assert class_names.some(list("abcdefg")) == "a, b, c and 4 more"
    class_names.check_evaluable(NAMES, NAMES[3:0:-1], "w.pth")  # a subset in another order: evaluable
    class_names.check_evaluable(None, OTHER, "w.pth")  # no names recorded: nothing to check


def test_checkpoints_record_their_classes(scratch_job, finetune_job, tiny_data):
    """The session's scratch run and its finetune on the same classes (no mapping line)."""
    classes = sorted(p.name for p in (tiny_data / "train").iterdir())
    for job in (scratch_job, finetune_job.folder):  # memory-mapped: the tensors are not read
        assert torch.load(job / "checkpoint.pth", weights_only=True, mmap=True)["classes"] == classes
    assert "classifier rows" not in finetune_job.stdout and "share no class name" not in finetune_job.stdout


def test_eval_only_of_weights_without_rows_for_the_data_is_refused_at_once(tiny_data, tmp_path, capsys):
    classes = sorted(p.name for p in (tiny_data / "train").iterdir())
    weight_file = tmp_path / "w.pth"
    torch.save({"model": trained_on(NAMES).state_dict, "config": {}, "classes": classes[:6] + NAMES[:4]},
               weight_file)
    code, err = run_main(capsys, "finetune", "--eval-only", "--weight-path", weight_file, "--data-path", tiny_data,
                         "--architecture", "resnet20", "--shared-folder-path", tmp_path / "s", *FAST)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (f"--eval-only: the weights in {weight_file} have no classifier row for 4 of the data's 10 classes "
            f"({', '.join(classes[6:9])} and 1 more); they were trained on {', '.join(classes[:3])} and 7 more") in err
    assert not (tmp_path / "s").exists()


def test_a_resume_on_other_classes_is_refused_at_once(tiny_data, tmp_path, capsys):
    """The job folder's checkpoint was trained on classes the data folder no longer has (renamed)."""
    args = ["--job-id", "j", "--shared-folder-path", str(tmp_path), "--data-path", str(tiny_data), *SCRATCH]
    config, _ = build_config("scratch", build_parser("scratch").parse_args(args))
    classes = sorted(p.name for p in (tiny_data / "train").iterdir())
    saved = checkpoint.Contents(model={}, optimizer={}, epoch=1, images_in_epoch=0, global_step=5, ranks=[],
                                config=config.to_dict(), metrics=[], classes=["hat", *classes[1:]])
    (tmp_path / "j").mkdir()
    path = checkpoint.save_checkpoint(tmp_path / "j", saved.as_dict(), 5).with_name("checkpoint.pth")
    code, err = run_main(capsys, "scratch", *args)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (f"{path} was trained on other classes than {tiny_data} holds now (1 new ({classes[0]}), 1 dropped (hat)): "
            "a resumed run must see the same data") in err


def test_data_with_numbered_classes_say_how_to_name_them():
    """Shards indexed without --classes have classes named by number: refusing named weights says so."""
    with pytest.raises(FixresError, match=r"or finetune them on these\); the data's classes are numbers only: shards "
                                          r"indexed without --classes \(python -m fixres_dist.data.packing index "
                                          r"FOLDER --classes FILE names them\)$"):
        class_names.check_evaluable(["tops", "trousers"], ["0", "1"], "w.pth")
    class_names.check_evaluable(["0", "1"], ["1", "0"], "w.pth")
