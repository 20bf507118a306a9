"""The refit the planner expects: bytes and seconds to move the new policy into the SGLang servers, from the
model's size, the layout and the link bandwidths; and the bucket buffers the sync phase holds.

The node-local update (rollout/sglang/updates.py): every trainer GPU ends up with every full HF tensor --
the TP all-gather inside its stage, the PP broadcast of the other stages -- and copies it bucket by bucket
into the buffer its colocated server rank reads (CUDA IPC); the leader posts one request per bucket and
server.
  S           = params x bytes per param (the model's dtype)
  per GPU     TP all-gather (TP-1)/TP x S/PP; routed experts from their expert-parallel owner (EP-1)/EP x
              E/PP (E: the experts' bytes); PP broadcast of the other stages (PP-1)/PP x S. A group inside
              one node runs over NVLink, one that spans nodes over the GPU's InfiniBand NIC (Megatron orders
              ranks TP, EP/DP, PP: with DP > 1 the stages of a replica sit on different nodes)
  copies      2 S / HBM bandwidth (the bucket copy reads and writes every byte)
  buckets     ceil(S / bucket) x the per-bucket overhead (an HTTP round trip, SGLang's TP barrier)
  refit       = the sum (the steps of a bucket follow one another)
  cross-node  per node: what its GPUs receive over InfiniBand; 0 when a node holds whole replicas
  sync phase  the trainer GPU holds one bucket of gathered tensors and its flat copy (distributed: the
              broadcast's flat copy; disk: the gathered tensors only), a bucket at least the largest tensor
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_dapo.config import Config
from megatron_dapo.plan.core import Hardware, Links, Refit
from megatron_dapo.plan.memory import expert_params, total_params

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec

def _spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def largest_tensor_bytes(spec: ModelSpec, dtype_bytes: int) -> float:
    """The largest HF tensor: the embedding (or LM head), or an MLP projection (a MoE expert's: smaller)."""
    moe = spec.moe
    ffn = spec.ffn_hidden_size if moe is None else max(moe.ffn_hidden_size, moe.shared_expert_size)
    return dtype_bytes * spec.hidden_size * max(spec.vocab_size, ffn)


def plan_refit(cfg: Config, spec: ModelSpec, hw: Hardware, links: Links = Links()) -> Refit:
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    tp, pp, ep = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.expert_parallel
    world, g = hw.world_size, hw.gpus_per_node
    s = float(total_params(spec) * dtype_bytes)
    bucket = cfg.rollout.bucket_mb() * 2**20
    largest = max(bucket, largest_tensor_bytes(spec, dtype_bytes))
    stride = max(world // pp, 1)
    tp_link = "IB" if _spans_nodes(list(range(tp)), g) else "NVLink"
    pp_spans = _spans_nodes([i * stride for i in range(pp)], g)
    pp_link = "-" if pp == 1 else "IB" if pp_spans else "NVLink"
    ep_link = "-" if ep == 1 else "IB" if _spans_nodes([i * tp for i in range(ep)], g) else "NVLink"
    experts = spec.num_layers * expert_params(spec) * dtype_bytes
    tp_bytes, pp_bytes = (tp - 1) / tp * s / pp, (pp - 1) / pp * s
    ep_bytes = (ep - 1) / ep * experts / pp
    bw = {"NVLink": links.nvlink, "IB": links.ib, "-": math.inf}
    gather_s = (tp_bytes / bw[tp_link] + ep_bytes / bw[ep_link] + pp_bytes / bw[pp_link]) / 1e9
    buckets = math.ceil(s / bucket)
    receives = ((tp_bytes, tp_link), (ep_bytes, ep_link), (pp_bytes, pp_link))
    over_ib = sum(b for b, link in receives if link == "IB")
    transport = cfg.rollout.sglang.weight_sync
    return Refit(model_bytes=s, bucket_bytes=bucket, largest_bucket_bytes=largest, buckets=buckets,
                 tp_gather_bytes=tp_bytes, ep_receive_bytes=ep_bytes, ep_link=ep_link,
                 pp_receive_bytes=pp_bytes, tp_link=tp_link, pp_link=pp_link,
                 cross_node_bytes_per_node=g * over_ib, gather_s=gather_s,
                 copy_s=2 * s / (links.hbm * 1e9), overhead_s=buckets * links.bucket_overhead_s,
                 sync_buffer_bytes=largest * (1 if transport == "disk" else 2))
