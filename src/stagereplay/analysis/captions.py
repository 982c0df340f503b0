"""The figures' captions, as the report and ``snakemake --report`` show them: the catalogue's title and caption
of each figure (:data:`stagereplay.catalogue.FIGURES`, written there), in the catalogue's order, which numbers them.
The ``workflow/report/<figure>.rst`` files hold :func:`rst_text` word for word (a test checks that they agree).

Captions sit outside the images. They say how each figure encodes its data, never what the data show: a finding
is built from a run's files by the report, not written here.
"""

from __future__ import annotations

import textwrap

from stagereplay import catalogue

# name -> (title, caption); the order is the figures' numbering.
CAPTIONS = {figure.name: (figure.title, figure.caption) for figure in catalogue.FIGURES}


def rst_text(name: str, number: int | None = None) -> str:
    """The caption as ``workflow/report/<name>.rst`` holds it: one paragraph, wrapped at 116 columns."""
    number = number or list(CAPTIONS).index(name) + 1
    title, caption = CAPTIONS[name]
    return textwrap.fill(f"**Figure {number}. {title}** {caption}", width=116, break_long_words=False,
                         break_on_hyphens=False) + "\n"
