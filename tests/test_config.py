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
