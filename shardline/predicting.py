"""Kept for models registered before the code moved into layers: their logged `pyfunc_model.py`
imports `shardline.predicting.Predictor`. New code imports `shardline.trainer.serving`."""

from shardline.trainer.serving import Predictor

__all__ = ["Predictor"]
