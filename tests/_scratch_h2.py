import copy, torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from tests import dist_tasks_checkpoint_fsdp as t
from hp_core.testing.families import build_family


def dbg():
    par = t._fsdp(build_family("llama", seed=0, **t._kv4()), "production", True)
    sd = par.state_dict()
    g = get_model_state_dict(par)
    hooks = par._state_dict_hooks
    return {
        "sd": {k: t._spec(v) + (tuple(v.shape),) for k, v in list(sd.items())[:3]},
        "g": {k: t._spec(v) + (tuple(v.shape),) for k, v in list(g.items())[:3]},
        "hooks": str(hooks),
    }


def dbg2():
    from hp_core.runtime.fsdp_views import is_fsdp_shard, _local_shape_and_offset

    par = t._fsdp(build_family("llama", seed=0, **t._kv4()), "production", True)
    h = list(par._state_dict_hooks.values())[0].__self__
    name = "model.layers.0.self_attn.q_proj.weight"
    lay = h.layouts.get(name)
    p = dict(par.named_parameters())[name]
    return {
        "n": len(h.layouts),
        "keys": list(h.layouts)[:3],
        "lay": lay and (lay.mesh.mesh_dim_names, lay.placements, lay.shape),
        "local": lay and _local_shape_and_offset(lay.shape, lay.mesh, lay.placements),
        "is": lay and is_fsdp_shard(p, lay),
    }
