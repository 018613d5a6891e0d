import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
import hp_core
from tests import dist_tasks_checkpoint_fsdp as t
from hp_core.testing.families import build_family


def checked(path):
    m = t._fsdp(build_family("llama", seed=0, **t._kv4()), "production", True)
    before = t._full(get_model_state_dict(m))
    hp_core.save_checkpoint(path, m)
    other = t._fsdp(build_family("llama", seed=1, **t._kv4()), "production", True)
    hp_core.load_checkpoint(path, other)
    return {"restored": t._excess(t._full(get_model_state_dict(other)), before)}
