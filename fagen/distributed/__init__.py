"""Attention past one device: context parallelism (ring attention) over torch.distributed.

:func:`ring_flash_attn_func` shards the sequence across the ranks of a process group; K/V
shards travel around the ring by point-to-point messages while each rank runs fagen's
kernels on the pair it holds. See docs/distributed.md.
"""
from .ring import LAYOUTS, StepTimes, ring_flash_attn_func, step_times

__all__ = ["ring_flash_attn_func", "LAYOUTS", "step_times", "StepTimes"]
