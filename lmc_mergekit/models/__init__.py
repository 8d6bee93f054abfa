"""Model layer: the canonical view of a decoder-only transformer and the checkpoint adapters."""
