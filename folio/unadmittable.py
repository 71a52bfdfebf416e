"""The generator's last resort when a job can never be admitted."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from folio.results import Result

if TYPE_CHECKING:
    from folio.generator import DynamicGenerator

logger = logging.getLogger("folio.generator")


def fail_unadmittable(generator: DynamicGenerator, results: list[Result]) -> list[Result]:
    """Nothing ran, nothing is running and jobs wait: the first of them does not fit even an empty cache (the
    checks at enqueue should make this impossible). Fail it rather than return nothing forever."""
    scheduler = generator.scheduler
    if results or scheduler.active or not scheduler.pending:
        return []
    seq = scheduler.pending[0]
    logger.error("job %s cannot be admitted into an empty cache; failing it", seq.job.serial)
    return [generator.emitter.fail(seq, RuntimeError(
        f"the job ({len(seq.token_ids)} tokens) cannot be admitted even into an empty cache of "
        f"{generator.cache_manager.num_pages} pages of {generator.page_size} tokens"))]
