"""One look per domain in every plot: a colour and a line style (or hatch, for stacked areas) that no other domain
of the same figure shares, for any number of domains up to 32 (and beyond: 40 distinct pairs).

Why: matplotlib's default cycle has 10 colours, so the demo's 13 languages drew en/nl, fr/uk and de/pt in the same
colour. Colours cycle through tab10 (the default's colours, so small figures look as before); each further ten
domains take the next line style and hatch, so the pair is unique and the legend tells them apart in print too.
"""

from __future__ import annotations

__all__ = ["COLORS", "HATCHES", "LINESTYLES", "series_style"]

#: matplotlib's tab10 (its default colour cycle).
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", ":", "-.")
HATCHES = ("", "//", "..", "xx")


def series_style(i: int) -> dict[str, str]:
    """The colour, line style and hatch of the ``i``-th series (domain or task) of a figure."""
    group = (i // len(COLORS)) % len(LINESTYLES)
    return {"color": COLORS[i % len(COLORS)], "linestyle": LINESTYLES[group], "hatch": HATCHES[group]}
