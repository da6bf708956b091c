"""Shardline's trainer: windows over shards, the built-in model families, a resumable training loop, generation.

Pure PyTorch + numpy (no Prefect, no MLflow). Each name is imported from its own module (`shardline.trainer.loop`'s
`fit`, `shardline.trainer.data`'s `open_split`, ...), so `import shardline.trainer` stays cheap.
"""
