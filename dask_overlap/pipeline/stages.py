"""The pipeline's stages as every outlet names and colours them.

The runtime's timeline writes a stage as ``staging``, ``h2d``, ``compute``, ``d2h`` or
``unstaging`` (the engine's stage names, lower case); the fine performance metrics label
it ``overlap-<stage>``, the dashboard shows it under its display name, and the dashboard
and NVTX ranges draw it in one colour.

Beside the stages, the dashboard draws the worker's incoming transfers (``transfer``):
partitions Dask moved to it from other workers, from distributed's own transfer log, on a
lane of their own (:data:`TRANSFER_LANE`). They are not a stage of the pipeline: no
sub-chunk runs them and the runtime's counters leave them out.
"""

from __future__ import annotations

__all__ = [
    "COLORS",
    "DISPLAY_NAMES",
    "OTHER_COLOR",
    "STAGES",
    "TRANSFER",
    "TRANSFER_LANE",
    "argb",
    "label",
]

#: Stage names as the runtime's timeline writes them, in pipeline order.
STAGES = ("staging", "h2d", "compute", "d2h", "unstaging")
#: A transfer from another worker, as the timeline names it...
TRANSFER = "transfer"
#: ...and its lane (streams are 0, 1, ...; the copy threads -1).
TRANSFER_LANE = -2
#: What the dashboard calls each stage.
DISPLAY_NAMES = {
    "staging": "staging",
    "h2d": "H2D",
    "compute": "kernel",
    "d2h": "D2H",
    "unstaging": "unstaging",
    TRANSFER: "transfer in",
}
#: ``#rrggbb`` of each stage (the copy threads' stages in grey and brown).
COLORS = {
    "staging": "#bdbdbd",
    "h2d": "#1f77b4",
    "compute": "#2ca02c",
    "d2h": "#ff7f0e",
    "unstaging": "#8c564b",
    TRANSFER: "#9467bd",
}
#: The colour of anything that is not a known stage.
OTHER_COLOR = "#7f7f7f"


def label(stage: str) -> str:
    """The fine-performance-metric label of a stage.

    Examples
    --------
    >>> label("h2d"), label("staging")
    ('overlap-h2d', 'overlap-staging')
    """
    return f"overlap-{stage}"


def argb(stage: str | None) -> int:
    """``stage``'s colour as the opaque ARGB integer NVTX takes.

    Examples
    --------
    >>> hex(argb("h2d"))
    '0xff1f77b4'
    """
    return 0xFF000000 | int(COLORS.get(stage or "", OTHER_COLOR)[1:], 16)
