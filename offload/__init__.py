"""Weight placement and streaming for an offloaded target: memory plan, host store (RAM/SSD), GPU ring, NF4.

``load_offloaded(path, device, dtype_str, OffloadConfig(...))`` returns a :class:`specexec.model.Transformer` whose
layer provider streams layers from pinned RAM or SSD; ``make_plan`` decides the placement before loading.
"""

from offload.load import load_offloaded, target_compute_dtype
from offload.plan import OffloadConfig, Plan, compute_dtype, make_plan, measure_h2d_bandwidth
from offload.streamer import StreamedLayers, StreamStats

__all__ = [
    "OffloadConfig",
    "Plan",
    "StreamStats",
    "StreamedLayers",
    "compute_dtype",
    "load_offloaded",
    "make_plan",
    "measure_h2d_bandwidth",
    "target_compute_dtype",
]
