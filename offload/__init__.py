"""Weight placement and streaming for an offloaded target: memory plan, host store (RAM/SSD), GPU ring, NF4.

``make_plan`` decides the placement before loading; :class:`StreamedLayers` is a layer provider for
:class:`specexec.model.transformer.Transformer` that streams layers from pinned RAM or SSD
(:func:`specexec.loading.offloaded.load_offloaded` builds one). Nothing here imports the decoding layers.
"""

from offload.plan import OffloadConfig, Plan, compute_dtype, make_plan, measure_h2d_bandwidth
from offload.streamer import StreamedLayers, StreamStats

__all__ = [
    "OffloadConfig",
    "Plan",
    "StreamStats",
    "StreamedLayers",
    "compute_dtype",
    "make_plan",
    "measure_h2d_bandwidth",
]
