"""The mergekit-facing layer: method registration, recipes, the pre-merge pipeline, the CLI."""
