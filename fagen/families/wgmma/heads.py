"""The head dims the Hopper family takes: every multiple of 8 in 8..256 (the spec's rule), each computed in
whole 128-byte swizzle panels (:func:`~fagen.families.wgmma.panels.padded_dim`: 64, 128, 192, 256; the TMA
loads zero-fill the columns past the real head dim, so they add nothing) where that is cheaper than the
``mma`` kernel of the real head dim, declined by name otherwise (:func:`padded_reason`).

"Cheaper" is measured (``benchmarks/sass_cost.py``, instructions per 1e6 FLOPs of the *real* head dims, fp16,
sm_90a, the default tiles): the padded kernel is the panel width's kernel, so its figure is that kernel's times
the padding (:func:`padding`: padded FLOPs over real ones). Without a per-score feature it is below mma's at
every head dim, both directions (forward d = 8 / 16 / 32 / 40 / 48 / 80 / 112 / 160 / 224: 5720 / 2875 / 1468 /
1189 / 997 / 623 / 461 / 543 / 449 against 5981 / 3002 / 1713 / 1649 / 1385 / 1137 / 958 / 990 / 868; backward:
3198 / 1608 / 806 / 652 / 545 / 462 / 340 / 377 / 298 against 6738 / 2475 / 1280 / 2008 / 1569 / 1157 / 972 /
1915 / 2017), as with attn_mask or a bias (d = 8 forward: 8649 / 8821 against 31891 / 15564). The per-score
features' work scales with the padding too, and mma's is smaller (:data:`MAX_PADDING`)."""
from __future__ import annotations

from fagen.families.base import FamilySpec
from fagen.families.wgmma.panels import padded_dim

__all__ = ["MAX_PADDING", "NATIVE_HEAD_DIMS", "padded_reason", "padding"]

#: Head dims taken whatever the features (the panel widths, and d = 96 in the d = 128 tiles as it always was).
NATIVE_HEAD_DIMS = (64, 96, 128, 192, 256)
#: (direction, feature) -> (the most padding at which the padded kernel is taken, the narrowest panel width):
#: the measured break-even against mma (wgmma / mma instructions per 1e6 real FLOPs, padding in brackets).
#: softcap: mma is cheaper at every padded head dim (forward d = 8 .. 160: 1.98 / 1.97 / 1.85 / 1.61 / 1.44 /
#: 1.28 / 1.10 at d = 8 / 16 / 32 / 48 / 80 / 112 / 160; backward d = 8 / 16 / 40: 1.18 / 1.83 / 1.15).
#: ALiBi forward: 1.61 / 1.61 / 1.49 / 1.28 / 1.12 at d = 8 / 16 / 32 / 48 / 80 (the 64-wide panel: mma wins
#: at any padding), 0.99 at 112 (1.14), 0.87 at 160 (1.2). ALiBi backward: 1.15 at d = 16 (4), 0.68 at 40 (1.6).
#: Dropout forward: 0.99 / 1.01 at d = 8 / 16 (8 / 4: a tie), 0.97 / 0.89 / 0.84 at d = 32 / 48 / 80 (2 / 1.33 /
#: 1.6); the dropout backward is cheaper at every head dim (0.54 / 0.78 / 0.52 at d = 8 / 16 / 40).
MAX_PADDING: dict[tuple[str, str], tuple[float, int]] = {
    ("fwd", "softcap"): (1.0, 64), ("bwd", "softcap"): (1.0, 64),
    ("fwd", "alibi"): (1.2, 128), ("bwd", "alibi"): (2.0, 64),
    ("fwd", "dropout"): (2.0, 64),
}


def padding(fs: FamilySpec) -> float:
    """The padded kernel's tensor-core FLOPs over the real head dims' (forward 2 GEMMs: d + dv; backward 5:
    3 d + 2 dv), e.g. 8 at d = 8, 1.6 at d = 40, 1.2 at d = 160."""
    d, dv, pd, pdv = fs.head_dim, fs.dv, padded_dim(fs.head_dim), padded_dim(fs.dv)
    if fs.direction == "bwd":
        return (3 * pd + 2 * pdv) / (3 * d + 2 * dv)
    return (pd + pdv) / (d + dv)


def padded_reason(fs: FamilySpec) -> str | None:
    """Why the family declines the spec's head dims, or None: a padded head dim (outside
    :data:`NATIVE_HEAD_DIMS`) with a per-score feature whose padded kernel issues more instructions per
    real FLOP than mma's (:data:`MAX_PADDING`)."""
    for name, d in (("head_dim", fs.head_dim), ("head_dim_v", fs.dv)):
        if d % 8 or not 8 <= d <= 256:
            return f"{name}={d}: the wgmma templates take a multiple of 8 in 8..256"
    if fs.head_dim in NATIVE_HEAD_DIMS and fs.dv in NATIVE_HEAD_DIMS:
        return None
    pad, width = padding(fs), min(padded_dim(fs.head_dim), padded_dim(fs.dv))
    for feature in ("softcap", "alibi", "dropout"):
        limit = MAX_PADDING.get((fs.direction, feature))
        if limit is not None and fs.has(feature) and (pad > limit[0] or width < limit[1]):
            return (f"head_dim={fs.head_dim}, head_dim_v={fs.dv} with {feature}: the padded wgmma {fs.direction} "
                    f"({padded_dim(fs.head_dim)} / {padded_dim(fs.dv)} columns, {pad:.2f}x the FLOPs) issues more "
                    f"instructions per FLOP than mma's (benchmarks/sass_cost.py; taken up to {limit[0]}x, panels "
                    f"of at least {limit[1]} columns)")
    return None
