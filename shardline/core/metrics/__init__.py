"""Metrics: evaluation's scores and baselines (`scores`), its plots and tables (`report`), ranking metrics
(`ranking`, `split_ranking`) and text metrics (`text`)."""
