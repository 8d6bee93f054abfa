"""Run infrastructure shared by every layer above: publishing folders atomically, content keys,
the learning-rate schedule, resumable training state, provenance marks and torch.distributed
processes. Nothing here knows about models or merge methods."""
