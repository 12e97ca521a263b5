"""``lowmem report``: the grid of configurations (:mod:`.grid`, :mod:`.combined`), their
analysis and tables (:mod:`.run`), plots (:mod:`.plot`)."""

from lowmem_jax.report.run import (
    ENVELOPE,
    in_envelope,
    run_report,
    summary_table,
    to_markdown,
    write_report,
)

__all__ = ["ENVELOPE", "in_envelope", "run_report", "write_report", "to_markdown", "summary_table"]
