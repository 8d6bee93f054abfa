"""Latent-space merging: weight tensors encoded by a transformer VAE (``ls_merge``)."""
