"""Cluster planning: what a recipe puts on each node and GPU, and whether it fits in memory.

Pure arithmetic on the recipe and the model's config.json (or the built-in Qwen2.5 shapes), so a
dry run works on a login node without torch, Ray or a GPU.
"""
