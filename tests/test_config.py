import json

import attrs
import pytest

from fixres_dist import FixresError, TrainerConfig


def test_json_round_trip():
    config = TrainerConfig(num_tasks=3, global_rank=2, local_rank=1, job_id="exp-1.a_b", dist_backend="gloo",
                           dist_url="tcp://127.0.0.1:1234", input_size=40, test_size=56, learning_rate=0.3)
    again = TrainerConfig.from_json(config.to_json())
    assert again == config
    assert json.loads(config.to_json())["job_id"] == "exp-1.a_b"


@pytest.mark.parametrize("fields, message", [
    ({"num_tasks": 2, "global_rank": 2}, "--global-rank 2 must be < --num-tasks 2"),
    ({"num_tasks": 2, "global_rank": -1}, "--global-rank must be >= 0"),
    ({"num_tasks": 2, "local_rank": 2}, "--local-rank 2 must be < --num-tasks 2"),
    ({"num_tasks": 0}, "--num-tasks must be > 0"),
    ({"job_id": "../escape"}, "not safe as a folder name"),
    ({"job_id": "a/b"}, "not safe as a folder name"),
    ({"job_id": ""}, "not safe as a folder name"),
    ({"dist_backend": "mpi"}, "--dist-backend must be one of gloo, nccl"),
    ({"dist_url": "http://x:1"}, "file://, tcp:// or env://"),
    ({"dist_url": "tcp://host"}, "tcp://HOST:PORT"),
    ({"mode": "finetune"}, "needs --weight-path"),
])
def test_validators(fields, message):
    with pytest.raises(FixresError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        TrainerConfig(**fields)


def test_frozen_and_unknown_keys():
    config = TrainerConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.batch = 3
    with pytest.raises(FixresError, match="unknown keys"):
        TrainerConfig.from_dict({**config.to_dict(), "bogus": 1})


SPLIT = {"architecture": "timm/test_vit", "num_tasks": 4}


@pytest.mark.parametrize("refused, nearest", [
    ({"pipeline_stages": 2, "sharding": "full"}, {"sharding": "full"}),
    ({"pipeline_stages": 2, "tensor_parallel": 2}, {"tensor_parallel": 2, "sharding": "full"}),
    ({"tensor_parallel": 2, "model_ema": True}, {"sharding": "full", "model_ema": True}),
    ({"tensor_parallel": 2, "model_ema": True}, {"pipeline_stages": 2, "model_ema": True}),
    ({"tensor_parallel": 2, "compile": "inductor"}, {"compile": "inductor"}),
    ({"pipeline_stages": 2, "amp": "fp16", "device": "cuda"}, {"pipeline_stages": 2, "amp": "bf16", "device": "cuda"}),
    ({"tensor_parallel": 2, "activation_checkpointing": True}, {"sharding": "full", "activation_checkpointing": True}),
    ({"pipeline_stages": 2, "dist_bn": "broadcast"}, {"pipeline_stages": 2}),
    ({"pipeline_stages": 2, "extract_features": "/tmp/features"}, {"extract_features": "/tmp/features"}),
    ({"tensor_parallel": 2, "sharding": "hybrid", "shard_group_size": 2}, {"tensor_parallel": 2, "sharding": "full"}),
])
def test_a_refused_composition_names_the_nearest_that_works(refused, nearest):
    """docs/sharding.md's table of compositions: a refusal names the nearest composition that runs, and that
    one passes the same checks."""
    with pytest.raises(FixresError, match="does not go with .* yet; the nearest that works: --"):
        TrainerConfig(**SPLIT, **refused)
    TrainerConfig(**SPLIT, **nearest)


def test_stages_refuse_sharding_saying_why():
    """docs/sharding.md's table: pipeline x FSDP is refused with its reason (an uneven last batch, different
    micro-batch counts, gathers that would not pair up), not only with the nearest that works."""
    with pytest.raises(FixresError, match=r"uneven last batch gives those ranks different micro-batch counts"):
        TrainerConfig(**SPLIT, pipeline_stages=2, sharding="hybrid", shard_group_size=2)


def test_pipeline_stages_take_the_ema_and_tensor_groups_do_not_yet():
    """docs/sharding.md's table: a pipeline's stages average their own part of the EMA (built); tensor groups
    refuse it, naming both compositions that run."""
    TrainerConfig(**SPLIT, pipeline_stages=2, model_ema=True)
    with pytest.raises(FixresError, match=r"--tensor-parallel 2 does not go with --model-ema yet; the nearest that "
                       r"works: --sharding full --model-ema \(the average sharded as the model is\), or "
                       r"--pipeline-stages N --model-ema"):
        TrainerConfig(**SPLIT, tensor_parallel=2, model_ema=True)


def test_pipeline_stages_take_activation_checkpointing_and_tensor_groups_do_not_yet():
    """docs/sharding.md's table: a pipeline's stages recompute their blocks (built); tensor groups refuse it,
    naming both compositions that run."""
    TrainerConfig(**SPLIT, pipeline_stages=2, activation_checkpointing=True)
    with pytest.raises(FixresError, match="--tensor-parallel 2 does not go with --activation-checkpointing yet; the "
                       "nearest that works: --sharding full --activation-checkpointing, or --pipeline-stages N "
                       "--activation-checkpointing"):
        TrainerConfig(**SPLIT, tensor_parallel=2, activation_checkpointing=True)
