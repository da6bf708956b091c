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
        """The predictions, each labelled with its input row's index label: `frame.assign(score=...)` and joins on
        the index put each one beside its own row, whatever the frame's index (a filtered frame's is not 0..n-1)."""
        import polars as pl

        from shardline.trainer.serving import INPUT_ROW

        rows = pl.from_pandas(model_input).with_columns(pl.int_range(pl.len(), dtype=pl.Int64).alias(INPUT_ROW))
        out = self.predictor.predict_frame(rows, params=params).to_pandas()
        if INPUT_ROW in out.columns:  # every prediction keyed to its row (`serving.row_keys`)
            out.index = model_input.index[out.pop(INPUT_ROW).to_numpy()]
        return out


mlflow.models.set_model(ShardlineModel())
