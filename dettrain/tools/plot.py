"""matplotlib for the tools that draw (``panel --out``, ``diff --plot``), or one line naming the extra."""

from __future__ import annotations

from typing import Any

from dettrain.errors import UserError


def pyplot(what: str) -> Any:
    """matplotlib's pyplot on the Agg backend, or a UserError naming the extra that installs it."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise UserError(f"{what} needs matplotlib: pip install 'dettrain[plot]' (or pip install "
                        "matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text in an SVG stays text: searchable, copyable
    return plt
