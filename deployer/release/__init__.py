"""Release making: delta patches, signatures, and the ledger of release counters."""
