"""Evaluation: comparing what models compute."""
