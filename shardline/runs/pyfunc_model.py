"""The MLflow model, logged as code (no pickle): raw rows in, predictions keyed to the rows out."""

import mlflow
import pandas as pd


class ShardlineModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        from shardline.trainer.serving import Predictor

        self.predictor = Predictor.from_files(
            context.artifacts["bundle"], context.artifacts["weights"], context.artifacts.get("tokenizer")
        )

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        import polars as pl

        return self.predictor.predict_frame(pl.from_pandas(model_input), params=params).to_pandas()


mlflow.models.set_model(ShardlineModel())
