"""The names the pipeline gives: its own columns beside a table's, and where a table's mirror
lives. Kept below every stage that writes or reads them (the stateful step, the mirrors, the
histories, a rebase's seed), so none of those imports another for a name."""

from __future__ import annotations

OPERATION = "_cdc_operation"
"""The stateful step's output: UPSERT (the key's final image) or DELETE (the key alone)."""
LAST_APPLIED_COLUMN = "last_applied"
"""The stateful step's output: the position of the key's last applied change."""
KEYS_COLUMN = "_cdc_keys"
"""Mirror column: the row's primary key as the change log spells it (JSON)."""
POSITION_COLUMN = "_cdc_last_applied"
"""Mirror column: the change-log position of the row's last applied change (commit timestamp
text, transaction id, record sequence, mod index). With ``_cdc_keys`` it lets a rebase seed
state from the mirror exactly (``pipeline.state.seed``)."""
VALID_FROM, VALID_FROM_TEXT = "_valid_from", "_valid_from_text"
VALID_TO, VALID_TO_TEXT = "_valid_to", "_valid_to_text"
"""History columns: the Spanner times a row version held from and until (NULL: still holds)."""
IS_CURRENT = "_is_current"
"""History column: true on the version that holds now (``_valid_to`` is NULL)."""
PRODUCT_COLUMNS = frozenset(
    {KEYS_COLUMN, POSITION_COLUMN, VALID_FROM, VALID_FROM_TEXT, VALID_TO, VALID_TO_TEXT, IS_CURRENT}
)
"""What the product keeps beside a table's own columns in mirrors and histories; an as-of read
leaves them out."""
FIRST_CHANGE, FIRST_CHANGE_TEXT = "_cdc_first_change", "_cdc_first_change_text"
"""The stateful step's output: the position of the key's first change in the micro-batch."""


def mirror_uri(mirror_root: str, table: str) -> str:
    """A table's mirror: a folder named after the table under the mirror root."""
    return f"{mirror_root.rstrip('/')}/{table}"
